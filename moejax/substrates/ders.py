"""Shared pieces of the DeRS studies (not an experiment itself; do not register).

* corpora (:mod:`moejax.data.corpora`): ``"stdlib_code"`` (CPython stdlib source) or TFDS
  prose (``"prose/pydoc"``, ``"prose/kjv"``) as byte tokens, or SmolLM2 tokens (full preset);
* the dense model to upcycle: the ``dense_lm_prose`` / ``dense_lm_code`` substrates
  (:mod:`moejax.substrates`, built once and cached); the full preset imports
  SmolLM2-135M-Instruct through ``moejax.io.smollm2``;
* :func:`fit`: the training loop with XLA's compiled memory analysis of the step (not RSS).
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np

from moejax.config import Config, config
from moejax.data.corpora import corpus_bytes, corpus_tokens, corpus_windows, document_tokens
from moejax.data.lm_batches import WindowBatches
from moejax.data.tokenizer import ByteTokenizer
from moejax.io.smollm2 import SMOLLM2_CONTEXT, load_smollm2
from moejax.substrates import build as build_substrate
from moejax.substrates import substrate_config
from moejax.substrates.lm import LMSubstrateConfig
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train

Corpus = Literal["stdlib_code", "prose/pydoc", "prose/kjv"]


@config
class SubstrateConfig(Config):
    """The dense model before upcycling: the library substrates (quick) or SmolLM2 (full).

    ``not fine-tuned`` = ``dense_lm_prose`` (pre-trained on the Python docs' prose);
    ``pre-fine-tuned`` = ``dense_lm_code`` (that model fine-tuned on stdlib code), each built
    once per config and cached by :mod:`moejax.substrates`. The upcycled MoE then trains on
    ``downstream_corpus`` windows of ``seq_len`` tokens."""

    source: Literal["substrates", "smollm2"] = "substrates"
    pretrained: LMSubstrateConfig = substrate_config("dense_lm_prose", "quick")
    prefinetuned: LMSubstrateConfig = substrate_config("dense_lm_code", "quick")
    cache_dir: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    seq_len: int = 64
    downstream_corpus: Corpus = "stdlib_code"

    def unread_fields(self) -> dict[str, str]:
        return self._read_only_with("source", {"pretrained": ("substrates",),
                                               "prefinetuned": ("substrates",)})

    def validate(self):
        if self.source == "smollm2":
            longest, what = SMOLLM2_CONTEXT, "SmolLM2's context"
        else:
            longest = min(self.pretrained.max_seq_len, self.prefinetuned.max_seq_len)
            what = "the substrates' max_seq_len"
        self._require(self.seq_len <= longest, f"seq_len={self.seq_len} (the downstream "
                                               f"window) exceeds {what}, {longest}")


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer():
    return load_smollm2()[1]


def batches(name: str, split: str, *, batch_size: int, seq_len: int, seed: int,
            source: str = "substrates"):
    """LM windows of a corpus: byte tokens (``ByteTokenizer``) or SmolLM2 tokens."""
    return corpus_windows(name, split, batch_size=batch_size, seq_len=seq_len, seed=seed,
                          tokenizer=_smollm2_tokenizer() if source == "smollm2" else None)


def text_windows(s: SubstrateConfig, split: str, *, batch_size: int, seed: int,
                 tokenizer=None) -> tuple[WindowBatches, float]:
    """``(windows, bytes_per_token)`` of the downstream corpus's ``split``: ``tokenizer`` None,
    the study's own tokens (the windows of :func:`batches`); otherwise the same text in
    another model's tokens (an imported checkpoint's). Bytes per token turn a loss per token
    into one per byte (:class:`moejax.evaluate.LMEvaluator`'s ``bpb``), which compares the
    two: the substrates read the corpus's documents
    (:func:`moejax.data.corpora.document_tokens`), SmolLM2 its bytes."""
    name = s.downstream_corpus
    if s.source == "smollm2":
        ids = corpus_tokens(name, split, tokenizer or _smollm2_tokenizer())
        n_bytes = len(corpus_bytes(name, split))
    else:
        ids, n_bytes = document_tokens(name, split, tokenizer or ByteTokenizer())
    return (WindowBatches(ids, batch_size=batch_size, seq_len=s.seq_len, seed=seed),
            n_bytes / len(ids))


def _smollm2(s: SubstrateConfig):
    model, _ = load_smollm2(max_seq_len=max(512, s.seq_len))
    return model


def dense_substrate(s: SubstrateConfig, *, prefinetune: bool):
    """``(model, description)``: the dense model to upcycle, pre-trained (and pre-fine-tuned
    when asked); substrates are built on first use and then loaded from the cache."""
    if s.source == "smollm2":
        return _smollm2(s), "SmolLM2-135M-Instruct"
    name, cfg = (("dense_lm_code", s.prefinetuned) if prefinetune
                 else ("dense_lm_prose", s.pretrained))
    sub = build_substrate(name, cfg, cache_dir=s.cache_dir or None, progress=True)
    return sub.model, (f"substrate {name} ({sub.path.name}, val loss "
                       f"{sub.metrics['val_loss']:.3f} on {cfg.corpus})")


def fit(model, source, tcfg: TrainConfig, desc: str = "train") -> dict:
    """Train ``model`` in place (fresh optimizer state) through the one training loop and
    return ``peak_train_bytes`` / ``train_state_bytes`` (XLA's memory analysis of the compiled
    step: peak = params + optimizer state + batch + outputs + temporaries - donated;
    state = its arguments) and ``final_loss`` (mean ``ce`` of the last 10 steps)."""
    hist = train(model, source, tcfg, measure_memory=True, desc=desc)
    return {"peak_train_bytes": hist.memory["peak_bytes"],
            "train_state_bytes": hist.memory["argument_bytes"],
            "final_loss": float(np.mean([h["ce"] for h in hist[-10:]]))}


# Both DeRS studies' full preset (SmolLM2-135M-Instruct, lr 2e-5 as in the paper's tables): the
# substrate, the training run and the evaluation batches.
# batch 32 of 512 tokens in two micro-batches: at one, the upcycled SmolLM2's float32 step
# needs about 122 GB per device (XLA's buffer assignment at the full shapes), past one H100
FULL_PRESET = dict(
    substrate=SubstrateConfig(source="smollm2", seq_len=512),
    train=TrainConfig(steps=2000, batch_size=32, grad_accum=2, lr=2e-5, warmup_steps=100,
                      seed=2, log_every=20),
    eval_batches=32)

__all__ = ["SubstrateConfig", "batches", "dense_substrate", "fit", "text_windows", "FULL_PRESET"]
