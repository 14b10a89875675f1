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


def id_limits(model) -> dict[str, int]:
    """The ids the batches give ``model``, by batch key, and the bound each must stay below:
    ``inputs`` / ``targets`` its vocabulary, ``labels`` its classes, where the model says
    (``vocab_size`` / ``n_classes`` on it, a wrapper's too, else on its ``cfg``)."""
    def known(name):
        v = getattr(model, name, None)
        return v if v is not None else getattr(getattr(model, "cfg", None), name, None)

    vocab, classes = known("vocab_size"), known("n_classes")
    limits = {} if vocab is None else {"inputs": int(vocab), "targets": int(vocab)}
    return limits if classes is None else {**limits, "labels": int(classes)}


def check_token_ids(batch, limits: dict[str, int]) -> None:
    """Ids of the first batch must index what they index (``limits``: :func:`id_limits`): an
    id past the model's vocabulary or classes, or a negative one, makes the embedding lookup
    or the loss's gather return NaN or garbage, silently."""
    if not isinstance(batch, dict):
        return
    for key in ("inputs", "targets", "labels"):
        x = batch.get(key)
        if x is None or not np.issubdtype(np.asarray(x).dtype, np.integer):
            continue
        what = "class id" if key == "labels" else "token id"
        lo = int(np.min(x)) if np.size(x) else 0
        if lo < 0:
            raise ValueError(
                f"batch[{key!r}] holds the negative {what} {lo} (JAX would wrap it around "
                "silently); the data or tokenizer is broken. Fix: check the batch source's "
                "ids")
        hi, bound = (int(np.max(x)) if np.size(x) else 0), limits.get(key)
        if bound is None or hi < bound:
            continue
        if key == "labels":
            raise ValueError(
                f"batch['labels'] holds class id {hi} but the model has {bound} classes. Fix: "
                f"build the classifier with n_classes >= {hi + 1} (the labels' classes)")
        raise ValueError(
            f"batch[{key!r}] holds token id {hi} but the model's vocab_size is {bound}; the "
            f"tokenizer's vocabulary does not fit the model. Fix: set vocab_size >= {hi + 1} "
            "(e.g. the tokenizer's vocab_size)")
