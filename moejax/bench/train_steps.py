"""A train step's steady time: ``warmup`` untimed steps (the first one compiles), then
``steps`` timed ones, each to ``block_until_ready``, and, where a trace sees the device, one
more under the profiler (:func:`moejax.bench.profile.trace_kernels`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from moejax.bench.profile import sees_device, trace_kernels
from moejax.extras import progress

__all__ = ["StepTimes", "time_train_steps"]


class StepTimes(NamedTuple):
    """What :func:`time_train_steps` measured: the state after the steps, the seconds of
    compilation plus the first step, each timed step's seconds, the last step's metrics and
    the profiled step's kernels (None where none was traced)."""

    state: Any
    compile_s: float
    times_s: list[float]
    metrics: dict
    kernels: Any

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s))


def time_train_steps(step: Callable, state, batch_at: Callable[[int], Any], *, warmup: int,
                     steps: int, profile: bool = False, desc: str = "steps") -> StepTimes:
    """Run ``step(state, batch_at(i))`` for ``warmup + steps`` batches (and one more, traced,
    with ``profile`` where the profiler sees the device); times as the module docstring."""
    if warmup < 1 or steps < 1:
        raise ValueError(f"warmup={warmup} and steps={steps} must be >= 1")
    t0 = time.perf_counter()
    compile_s = 0.0
    for i in range(warmup):
        state, m = step(state, batch_at(i))
        jax.block_until_ready(m["loss"])
        if i == 0:
            compile_s = time.perf_counter() - t0
    times = []
    for i in progress(range(steps), desc=desc, leave=False):
        batch = batch_at(warmup + i)
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    kernels = None
    if profile and sees_device():
        held = {"state": state}

        def one_step():
            held["state"], out = step(held["state"], batch_at(warmup + steps))
            return out["loss"]

        kernels = trace_kernels(one_step)
        state = held["state"]
    return StepTimes(state, compile_s, times, m, kernels)
