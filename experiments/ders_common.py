"""Shared pieces of the DeRS studies (not an experiment itself; do not register).

* corpora (:mod:`moejax.data.corpora`): ``"stdlib_code"`` (CPython stdlib source) or TFDS
  prose (``"prose/pydoc"``, ``"prose/kjv"``) as bytes, or as SmolLM2 tokens in the full preset;
* the dense substrate of the quick preset: a tiny byte-level LM pre-trained on one corpus and
  optionally "pre-fine-tuned" on a second, cached (orbax, via ``train``'s resume) under
  ``<substrate_dir>`` so re-runs skip it; the full preset imports SmolLM2-135M-Instruct through
  ``moejax.io.smollm2``;
* :func:`fit`: the training loop with XLA's compiled memory analysis of the step (not RSS).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import numpy as np
from flax import nnx

from moejax.config import Config, config
from moejax.data.corpora import corpus_bytes, corpus_tokens
from moejax.data.lm_batches import WindowBatches
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.train.loop import train
from moejax.train.optim import TrainConfig

Corpus = Literal["stdlib_code", "prose/pydoc", "prose/kjv"]


@config
class SubstrateConfig(Config):
    """The dense model before upcycling (quick preset: trained here; full: SmolLM2)."""

    source: Literal["tiny", "smollm2"] = "tiny"
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_hidden: int = 128
    seq_len: int = 64
    pretrain_corpus: Corpus = "stdlib_code"
    pretrain: TrainConfig = TrainConfig(steps=300, batch_size=16, lr=3e-3, warmup_steps=40,
                                        log_every=50)
    prefinetune_corpus: Corpus = "prose/pydoc"
    prefinetune: TrainConfig = TrainConfig(steps=200, batch_size=16, lr=1e-3, warmup_steps=20,
                                           log_every=50, seed=1)
    downstream_corpus: Corpus = "prose/pydoc"
    substrate_dir: str = ""  # "" -> <run dir>/substrate

    def validate(self) -> None:
        self._require(self.d_model % self.n_heads == 0,
                      f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer():
    from moejax.io.smollm2 import load_smollm2

    return load_smollm2()[1]


def batches(name: str, split: str, *, batch_size: int, seq_len: int, seed: int,
            source: str = "tiny"):
    """LM windows of a corpus: raw bytes (``source="tiny"``) or SmolLM2 tokens."""
    if source == "smollm2":
        data = corpus_tokens(name, split, _smollm2_tokenizer())
    else:
        data = corpus_bytes(name, split)
    return WindowBatches(data, batch_size=batch_size, seq_len=seq_len, seed=seed)


def dense_config(s: SubstrateConfig):
    return dense_decoder_config(vocab_size=256, d_model=s.d_model, n_layers=s.n_layers,
                                n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                                d_hidden=s.d_hidden, max_seq_len=max(128, s.seq_len))


def _smollm2(s: SubstrateConfig):
    from moejax.io.smollm2 import load_smollm2

    model, _ = load_smollm2(max_seq_len=max(512, s.seq_len))
    return model


def dense_substrate(s: SubstrateConfig, run_dir: Path, *, prefinetune: bool, seed: int = 0):
    """The dense model: pre-trained (and pre-fine-tuned when asked), cached on disk.

    ``train`` resumes from ``<dir>/pretrain`` / ``<dir>/prefinetune`` checkpoints, so a
    finished stage costs only a restore on re-runs."""
    if s.source == "smollm2":
        return _smollm2(s)
    root = Path(s.substrate_dir) if s.substrate_dir else Path(run_dir) / "substrate"
    model = DecoderLM(dense_config(s), rngs=nnx.Rngs(seed))
    src = batches(s.pretrain_corpus, "train", batch_size=s.pretrain.batch_size,
                  seq_len=s.seq_len, seed=seed)
    train(model, src, s.pretrain, run_dir=str(root / "pretrain"), progress=True)
    if prefinetune:
        src = batches(s.prefinetune_corpus, "train", batch_size=s.prefinetune.batch_size,
                      seq_len=s.seq_len, seed=seed + 1)
        train(model, src, s.prefinetune, run_dir=str(root / "prefinetune"), progress=True)
    return model


def fit(model, source, tcfg: TrainConfig, desc: str = "train") -> dict:
    """Train ``model`` in place (fresh optimizer state) through the one training loop and
    return ``peak_train_bytes`` / ``train_state_bytes`` (XLA's memory analysis of the compiled
    step: peak = params + optimizer state + batch + outputs + temporaries - donated;
    state = its arguments) and ``final_loss`` (mean ``ce`` of the last 10 steps)."""
    hist = train(model, source, tcfg, measure_memory=True, desc=desc)
    return {"peak_train_bytes": hist.memory["peak_bytes"],
            "train_state_bytes": hist.memory["argument_bytes"],
            "final_loss": float(np.mean([h["ce"] for h in hist[-10:]]))}


__all__ = ["SubstrateConfig", "batches", "dense_config", "dense_substrate", "fit"]
