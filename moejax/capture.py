"""Capture the training runs and decode loops a recipe starts, for ahead-of-time proof at
their real shapes.

    with capture_steps(steps=2, rows=4) as captured:
        study.run(cfg, run_dir)          # every `train(...)` and decode loop records itself
    for c in captured:
        prove_step(c) if isinstance(c, CapturedStep) else prove_decode(c)   # moejax.train.aot

Inside the block, the training loop appends one :class:`CapturedStep` per run (its jitted
step, the mesh it runs under, its ``TrainConfig`` and the abstract shapes of its state and
first batch) before its first step, and ``on_capture`` (if given) sees it at once, so what is
proven of a long recipe survives the recipe being stopped. ``steps`` / ``rows`` then cut what
it executes: at most ``steps`` steps (0: none; the model is returned unchanged) on the first
``rows`` rows of each batch, so a recipe goes through every training run it has, with results
to read, at the cost of a smoke run, while each run is recorded at its real shapes and step
count. A run cut to ``rows`` rows writes no checkpoint (nor a ``keep_best`` best): its steps
are not those of the run its config describes, which would resume from them later.

The jitted decode loops (:func:`moejax.nn.sample.sample`,
:func:`moejax.nn.speculative.speculative_generate`, and the one-token step of
:func:`moejax.nn.generate.generate`) append one :class:`CapturedDecode` per call (the jitted
function, its static arguments and its arguments' abstract shapes) and then run as usual, at
the shapes the recipe gives them.

The capture is a context variable: scoped to the ``with`` block and its thread, never seen
elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax

__all__ = ["CapturedStep", "CapturedDecode", "capture_steps", "active_capture",
           "record_decode", "record_step", "abstract"]


@dataclasses.dataclass(frozen=True)
class CapturedStep:
    """One training run's step: ``step`` (from :func:`moejax.train.step.make_train_step`,
    with ``.jitted(state)``), its ``mesh``, abstract ``state`` and ``batch``, its
    ``TrainConfig``, the run's label and ``program`` (set where steps of the same shapes are
    different programs, e.g. a benchmark's dispatch paths)."""

    label: str
    step: Any
    mesh: Any
    state: Any
    batch: Any
    cfg: Any
    program: str = ""  # what else tells this program apart from others of its shapes


@dataclasses.dataclass(frozen=True)
class CapturedDecode:
    """One decode loop's call: the jitted ``fn``, its abstract positional ``args`` and its
    ``static`` keyword arguments (``fn(*args, **static)`` reruns it), and the ``label``."""

    label: str
    fn: Any
    args: tuple
    static: dict


@dataclasses.dataclass
class _Capture:
    steps: int | None
    rows: int | None
    captured: list
    on_capture: Any = None

    def add(self, item) -> None:
        """Record ``item`` (a :class:`CapturedStep` or :class:`CapturedDecode`)."""
        self.captured.append(item)
        if self.on_capture is not None:
            self.on_capture(item)


def record_decode(label: str, fn, args: tuple, static: dict) -> None:
    """Inside :func:`capture_steps`: record a decode loop's call (arrays as abstract shapes,
    anything else such as a graphdef as is); outside: nothing."""
    capture = _ACTIVE.get()
    if capture is not None:
        args = tuple(abstract(a) if _is_arrays(a) else a for a in args)
        capture.add(CapturedDecode(label, fn, args, dict(static)))


def record_step(label: str, step, state, batch, cfg, *, mesh=None, program: str = "") -> None:
    """Inside :func:`capture_steps`: record a training step that runs outside the training
    loop (a benchmark's own timed loop) at its real shapes; outside: nothing."""
    capture = _ACTIVE.get()
    if capture is not None:
        capture.add(CapturedStep(label, step, mesh, abstract(state), abstract(batch), cfg,
                                 program))


def _is_arrays(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, jax.Array) for x in leaves)


_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "moejax_capture_steps", default=None)


@contextlib.contextmanager
def capture_steps(*, steps: int | None = None, rows: int | None = None, on_capture=None):
    """Yield the list the training runs and decode loops inside append their
    :class:`CapturedStep` / :class:`CapturedDecode` to; each training run executes at most
    ``steps`` steps of ``rows`` rows (``None``: as configured). ``on_capture(item)`` is
    called with each one as it is recorded (before the run's first step)."""
    for name, value in (("steps", steps), ("rows", rows)):
        if value is not None and value < (0 if name == "steps" else 1):
            raise ValueError(f"capture_steps({name}={value}): expected None or a count "
                             f">= {0 if name == 'steps' else 1}")
    capture = _Capture(steps, rows, [], on_capture)
    token = _ACTIVE.set(capture)
    try:
        yield capture.captured
    finally:
        _ACTIVE.reset(token)


def active_capture() -> _Capture | None:
    return _ACTIVE.get()


def abstract(tree):
    """``tree`` as ``jax.ShapeDtypeStruct`` s (shardings kept)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)
