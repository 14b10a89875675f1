"""Shared pieces of the DeRS studies (not an experiment itself; do not register).

* corpora: ``"stdlib_code"`` (CPython stdlib source) or moejax TFDS prose (``"prose/pydoc"``,
  ``"prose/kjv"``) as byte arrays; a prose corpus that fails to load falls back to the stdlib
  code (noted in the run summary);
* the dense substrate of the quick preset: a tiny byte-level LM pre-trained on one corpus and
  optionally "pre-fine-tuned" on a second, cached (orbax, via ``train``'s resume) under
  ``<substrate_dir>`` so re-runs skip it; the full preset imports SmolLM2-135M-Instruct through
  ``moejax.io.smollm2``;
* evaluation and peak-memory measurement (XLA's compiled memory analysis, not process RSS).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from moejax.config import Config, config
from moejax.data.lm_batches import WindowBatches
from moejax.data.stdlib_corpus import load_stdlib_bytes
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.train.loop import train
from moejax.train.optim import TrainConfig, make_optimizer
from moejax.train.step import init_train_state, lm_loss_fn, make_eval_step, make_train_step

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


_NOTES: list[str] = []


def load_corpus(name: str, split: str) -> np.ndarray:
    """Bytes (uint8) of ``split`` ("train" / "validation") of a corpus."""
    if name == "stdlib_code":
        return load_stdlib_bytes(split)
    try:
        from moejax.data import datasets

        ds = datasets.load(name, split)
        texts = [datasets.decode_text(ds[i]["text"]).encode("utf-8") + b"\0"
                 for i in range(len(ds))]
        return np.frombuffer(b"".join(texts), np.uint8)
    except Exception as e:  # noqa: BLE001 - any loading failure -> documented fallback
        _NOTES.append(f"corpus {name!r} failed to load ({type(e).__name__}: {e}); "
                      "fell back to the stdlib code corpus")
        return load_stdlib_bytes(split)


def notes() -> list[str]:
    return list(_NOTES)


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer():
    from moejax.io.smollm2 import load_smollm2

    return load_smollm2()[1]


def _smollm2_encode(data: np.ndarray) -> np.ndarray:
    """Tokenise corpus bytes with SmolLM2's BPE tokenizer (rebuilt from the GGUF metadata)."""
    text = bytes(data).replace(b"\0", b"\n\n").decode("utf-8", "replace")
    return np.asarray(_smollm2_tokenizer().encode(text), np.int32)


def batches(name: str, split: str, *, batch_size: int, seq_len: int, seed: int,
            source: str = "tiny"):
    """LM windows of a corpus: raw bytes (``source="tiny"``) or SmolLM2 tokens."""
    data = load_corpus(name, split)
    if source == "smollm2":
        data = _smollm2_encode(data)
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


class Evaluator:
    """Mean validation cross-entropy over fixed batches. The eval step is compiled once per
    graphdef; :meth:`peak_bytes` is XLA's compiled memory analysis of that step (one
    batch: weights + activations + loss), i.e. the inference peak."""

    def __init__(self, source, n_batches: int):
        self.batches = [source.batch(i) for i in range(n_batches)]
        self._fns: dict = {}

    def _compiled(self, model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        fn = self._fns.get(graphdef)
        if fn is None:
            jitted = make_eval_step(graphdef, lm_loss_fn)
            fn = jitted.lower(params, rest, self.batches[0], jax.random.key(0)).compile()
            self._fns[graphdef] = fn
        return fn, params, rest

    def __call__(self, model) -> float:
        fn, params, rest = self._compiled(model)
        key = jax.random.key(0)
        return float(np.mean([float(fn(params, rest, b, key)["ce"]) for b in self.batches]))

    def peak_bytes(self, model) -> int:
        return _peak(self._compiled(model)[0])

    def argument_bytes(self, model) -> int:
        """Arguments of the compiled eval step: weights + buffers + one batch."""
        return _args(self._compiled(model)[0])


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    if m is None:
        return -1
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - getattr(m, "alias_size_in_bytes", 0))


def _args(compiled) -> int:
    m = compiled.memory_analysis()
    return -1 if m is None else int(m.argument_size_in_bytes)


def fit(model, source, tcfg: TrainConfig, desc: str = "train") -> dict:
    """Train ``model`` in place for ``tcfg.steps`` steps (fresh optimizer state; the step is
    compiled ONCE, and its XLA memory analysis is the training peak: params + optimizer
    state + batch + outputs + temporaries - donated/aliased). Returns ``peak_train_bytes``,
    ``train_state_bytes`` (the step's arguments: params + optimizer state + buffers + batch),
    ``final_loss`` (mean of the last 10 steps)."""
    tx = make_optimizer(tcfg)
    graphdef, state = init_train_state(model, tx, tcfg.seed)
    step = make_train_step(graphdef, lm_loss_fn, tx, tcfg, donate=True)
    compiled = step.lower(state, source.batch(0)).compile()
    losses = []
    for i in tqdm(range(tcfg.steps), desc=desc, leave=False):
        state, metrics = compiled(state, source.batch(i))
        losses.append(metrics["ce"])
    nnx.update(model, state.params, state.rest)
    final = float(np.mean([float(x) for x in losses[-10:]]))
    if not np.isfinite(final):
        raise FloatingPointError(f"{desc}: non-finite training loss; lower the lr")
    return {"peak_train_bytes": _peak(compiled), "train_state_bytes": _args(compiled),
            "final_loss": final}


def nbytes_of(model) -> int:
    """Bytes of every variable of the model (parameters and buffers)."""
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(nnx.state(model))))


def fmt_count(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}K"
    return str(int(n)) if float(n).is_integer() else f"{n:.3g}"


__all__ = ["SubstrateConfig", "load_corpus", "batches", "dense_config", "dense_substrate",
           "Evaluator", "fit", "nbytes_of", "fmt_count",
           "notes"]
