"""Capture the training runs a recipe starts, for ahead-of-time proof at their real shapes.

    with capture_steps(train=False) as captured:
        study.run(cfg, run_dir)          # every `train(...)` inside records its step
    for c in captured:
        prove_step(c, ("cuda", "tpu"))   # moejax.train.aot

Inside the block, the training loop appends one :class:`CapturedStep` per run (its jitted
step, the mesh it runs under, and the abstract shapes of its state and first batch) before
its first step. With ``train=False`` no step runs: each run returns its model unchanged, so
a recipe goes through every training run it has without the cost of one. The capture is a
context variable: scoped to the ``with`` block and its thread, never seen elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax

__all__ = ["CapturedStep", "capture_steps", "active_capture"]


@dataclasses.dataclass(frozen=True)
class CapturedStep:
    """One training run's step: ``step`` (from :func:`moejax.train.step.make_train_step`,
    with ``.jitted(state)``), its ``mesh``, abstract ``state`` and ``batch``, its
    ``TrainConfig`` and the run's label."""

    label: str
    step: Any
    mesh: Any
    state: Any
    batch: Any
    cfg: Any


@dataclasses.dataclass
class _Capture:
    train: bool
    steps: list[CapturedStep]


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "moejax_capture_steps", default=None)


@contextlib.contextmanager
def capture_steps(*, train: bool = True):
    """Yield the list the training runs inside append their :class:`CapturedStep` to;
    ``train=False``: the runs stop before their first step."""
    capture = _Capture(train, [])
    token = _ACTIVE.set(capture)
    try:
        yield capture.steps
    finally:
        _ACTIVE.reset(token)


def active_capture() -> _Capture | None:
    return _ACTIVE.get()


def abstract(tree):
    """``tree`` as ``jax.ShapeDtypeStruct`` s (shardings kept)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)
