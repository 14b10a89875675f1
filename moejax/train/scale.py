"""The scale of what a run trained, as the training loop reports it: the largest trained
model's parameters and the tokens (or, for images and features, the examples) it was
trained on.

The loop records ``/moejax/train/params``, ``/moejax/train/tokens_per_step`` (or
``/moejax/train/rows_per_step``) and ``/moejax/train/steps`` as :mod:`jax.monitoring`
scalars when a run starts, or when it is restored finished from its own checkpoints (a
rerun in the same directory reports the scale its first run did)
(:func:`moejax.train.loop.train`); :func:`measure_scale` listens while a study runs, so a
verdict can state the scale it was reached at beside the paper's. Models a study loads
already trained (a cached substrate) or trains outside the loop are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import jax

from moejax.pytree import fmt_count

__all__ = ["RunScale", "measure_scale", "PARAMS", "TOKENS_PER_STEP", "ROWS_PER_STEP", "STEPS"]

PARAMS = "/moejax/train/params"
TOKENS_PER_STEP = "/moejax/train/tokens_per_step"
ROWS_PER_STEP = "/moejax/train/rows_per_step"
STEPS = "/moejax/train/steps"


@dataclass
class RunScale:
    """The largest model trained so far (``params``; ties: the later run) and what it was
    trained on (``per_step`` and ``tokens`` = per step times steps, in ``unit``: tokens, or
    examples for images and features); ``runs``: training runs seen."""

    params: float = 0.0
    per_step: float = 0.0
    tokens: float = 0.0
    unit: str = "tokens"
    runs: int = 0

    def text(self) -> str:
        """E.g. ``"82.4K parameters, 1.6M training tokens (the largest of 3 trained
        models)"``; ``""`` when nothing was trained."""
        if not self.runs:
            return ""
        of = f" (the largest of {self.runs} trained models)" if self.runs > 1 else ""
        return (f"{fmt_count(self.params)} parameters, {fmt_count(self.tokens)} training "
                f"{self.unit}{of}")


@contextlib.contextmanager
def measure_scale() -> Iterator[RunScale]:
    """Listen to the training loop's scalars inside the block; the :class:`RunScale` fills
    as runs start."""
    scale, current = RunScale(), {}

    def listen(event: str, value: float, **_) -> None:
        if event == PARAMS:
            current.clear()
            current[PARAMS] = value
        elif event in (TOKENS_PER_STEP, ROWS_PER_STEP, STEPS) and PARAMS in current:
            current[event] = value
            per_step = current.get(TOKENS_PER_STEP, current.get(ROWS_PER_STEP))
            if per_step is not None and STEPS in current:
                scale.runs += 1
                if current[PARAMS] >= scale.params:
                    scale.params, scale.per_step = current[PARAMS], per_step
                    scale.tokens = per_step * current[STEPS]
                    scale.unit = "tokens" if TOKENS_PER_STEP in current else "examples"
                current.clear()

    jax.monitoring.register_scalar_listener(listen)
    try:
        yield scale
    finally:
        jax.monitoring.unregister_scalar_listener(listen)
