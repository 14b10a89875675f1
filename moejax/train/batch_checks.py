"""What the training loop checks and records of its batches: a callable adapted to the
batch-source protocol, the first batch's rows and token ids refused before any step when
they do not fit the run, and the run's size (parameters, tokens or rows per step) recorded
for the scale listeners (:mod:`moejax.train.scale`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import moejax.train.scale as scale
from moejax.pytree import count_params
from moejax.train.hparams import TrainConfig


class FnSource:
    """Adapts a ``position -> batch`` callable to the batch-source protocol."""

    def __init__(self, fn: Callable[[int], Any], batch_size: int | None = None):
        self.fn, self.batch_size = fn, batch_size

    def batch(self, position: int):
        return self.fn(position)


def record_scale(params, batch, steps: int) -> None:
    """The run's size as ``jax.monitoring`` scalars: trained parameters, tokens per step (a
    batch of token ids) or rows per step (images, features), and the run's steps. Listeners
    (:func:`moejax.train.scale.measure_scale`, the full-preset smoke runs) read them;
    without one it is a no-op."""
    jax.monitoring.record_scalar(scale.PARAMS, float(count_params(params)))
    first = jax.tree.leaves(batch)[0]
    if (isinstance(batch, dict) and "mask" in batch) or (
            np.ndim(first) >= 2 and np.issubdtype(np.asarray(first).dtype, np.integer)):
        jax.monitoring.record_scalar(scale.TOKENS_PER_STEP, batch_tokens(batch))
    else:
        jax.monitoring.record_scalar(scale.ROWS_PER_STEP,
                                     float(np.shape(first)[0] * jax.process_count()))
    jax.monitoring.record_scalar(scale.STEPS, float(steps))


def batch_tokens(batch) -> float:
    """Real tokens (or rows) in the global batch, from this process's rows."""
    if isinstance(batch, dict) and "mask" in batch:
        n = float(np.sum(batch["mask"]))
    else:
        n = float(np.size(jax.tree.leaves(batch)[0]))
    return n * jax.process_count()


def check_batch_rows(batch, cfg: TrainConfig) -> None:
    """The first batch must hold this process's share of ``cfg.batch_size`` rows: a source
    that ignores the batch size would train on batches of another size, silently."""
    leaves = jax.tree.leaves(batch)
    want = cfg.batch_size // jax.process_count()
    if leaves and np.ndim(leaves[0]) and np.shape(leaves[0])[0] != want:
        raise ValueError(
            f"the source's first batch has {np.shape(leaves[0])[0]} rows but "
            f"TrainConfig.batch_size={cfg.batch_size} asks for {want} per process; the "
            "source does not follow the batch size. Fix: build the source with "
            f"batch_size={cfg.batch_size}, or set batch_size to the source's")


def check_token_ids(batch, vocab_size: int | None) -> None:
    """Token ids of the first batch must index the model's vocabulary (an id past it, or a
    negative one, makes the embedding lookup return NaN or garbage, silently)."""
    if not isinstance(batch, dict):
        return
    for key in ("inputs", "targets"):
        x = batch.get(key)
        if x is None or not np.issubdtype(np.asarray(x).dtype, np.integer):
            continue
        lo = int(np.min(x)) if np.size(x) else 0
        if lo < 0:
            raise ValueError(
                f"batch[{key!r}] holds the negative token id {lo} (JAX would wrap it around "
                "the embedding silently); the data or tokenizer is broken. Fix: check the "
                "batch source's token ids")
        hi = int(np.max(x)) if np.size(x) else 0
        if vocab_size and hi >= vocab_size:
            raise ValueError(
                f"batch[{key!r}] holds token id {hi} but the model's vocab_size is "
                f"{vocab_size}; the tokenizer's vocabulary does not fit the model. Fix: set "
                f"vocab_size >= {hi + 1} (e.g. the tokenizer's vocab_size)")
