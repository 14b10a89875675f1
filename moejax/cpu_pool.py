"""How many worker threads jaxlib's CPU client needs so that several CPU devices cannot deadlock.

jaxlib < 0.12's CPU client launches each device's part of a program, and runs it, on one pool
of ``max(cores, devices)`` threads (``PJRT_NPROC`` sets the first term). A launch waits,
holding its thread, while its device already has 32 computations in flight. When the host runs
that far ahead of the devices (a decoding loop on a sharded model does), the devices whose part
of a collective is running hold some threads, the launches of the other parts wait on the
rest, and the computations that would free a slot find no thread: every participant that
arrived waits for the others forever. One thread per device for the running parts, one per
device for the waiting launches and one more always leaves a thread free, which is the pool
:func:`pool_env` asks for. jaxlib 0.12 launches without this wait, and nothing changes there.

A process that starts several CPU devices itself (``JAX_NUM_CPU_DEVICES``,
``--xla_force_host_platform_device_count``) sets ``PJRT_NPROC`` before jax starts;
:func:`check_pool` warns, naming the value, where a pool is too small.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import jaxlib

__all__ = ["POOL_ENV", "needs_pool", "threads_needed", "pool_threads", "pool_env", "check_pool"]

POOL_ENV = "PJRT_NPROC"
_SIZE_ENVS = (POOL_ENV, "NPROC")  # read in this order by the CPU client, as its core count
_FIXED_IN = (0, 12)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def needs_pool(jaxlib_version: str | None = None) -> bool:
    """Whether the CPU client of ``jaxlib_version`` (default: the installed one) deadlocks on a
    pool of one thread per device."""
    return _version(jaxlib_version or jaxlib.__version__) < _FIXED_IN


def threads_needed(n_devices: int) -> int:
    """The pool that always leaves a thread free: the running parts of a collective, the
    launches waiting for a slot, and one more."""
    return 2 * n_devices + 1


def pool_threads(env: Mapping[str, str] | None = None) -> int:
    """The CPU client's pool size for the core count ``env`` gives it (``PJRT_NPROC``, then
    ``NPROC``, else the CPUs this process may run on), before the device count is applied."""
    env = os.environ if env is None else env
    for name in _SIZE_ENVS:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pool_env(n_devices: int, env: Mapping[str, str] | None = None,
             jaxlib_version: str | None = None) -> dict[str, str]:
    """The variables to add to a new process's environment (``env``, default ``os.environ``)
    so that its ``n_devices`` CPU devices cannot deadlock: ``{"PJRT_NPROC": 2n+1}`` where the
    jaxlib needs it and the pool would be smaller, else nothing."""
    need = threads_needed(n_devices)
    if n_devices < 2 or not needs_pool(jaxlib_version) or pool_threads(env) >= need:
        return {}
    return {POOL_ENV: str(need)}


def check_pool(devices, jaxlib_version: str | None = None) -> None:
    """Warn, with the setting that fixes it, when ``devices`` are several CPU devices of a
    jaxlib (default: the installed one) whose pool is too small for them: the process may
    deadlock in a collective."""
    devices = list(devices)
    if (len(devices) < 2 or devices[0].platform != "cpu"
            or not pool_env(len(devices), jaxlib_version=jaxlib_version)):
        return
    version = jaxlib_version or jaxlib.__version__
    warnings.warn(
        f"jaxlib {version}'s CPU client can deadlock in a collective on "
        f"{len(devices)} CPU devices with {pool_threads()} worker threads once the host runs "
        f"ahead; start the process with {POOL_ENV}={threads_needed(len(devices))} (or jaxlib "
        ">= 0.12)", RuntimeWarning, stacklevel=3)
