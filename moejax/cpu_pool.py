"""What keeps jaxlib's CPU client out of a deadlock in a collective: a large enough worker pool
for several CPU devices of one process, and, across processes, programs compiled in the process.

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

Across processes (CPU collectives over gloo), jaxlib 0.12.1 deadlocks in an all-gather of a
program that jax's persistent compilation cache loaded instead of compiling: every device of
every process waits in gloo's all-gather and none returns. The same program compiled in the
process runs, and jaxlib 0.12.0.1 runs both. On such a jaxlib :func:`compile_here` turns the
persistent cache off for the process (:func:`moejax.train.distributed.initialize_from_env`
calls it where it selects gloo collectives); a jaxlib that fixes it goes into
:data:`CACHE_FIXED_IN`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping

import jax
import jaxlib

__all__ = ["POOL_ENV", "needs_pool", "threads_needed", "pool_threads", "pool_env", "check_pool",
           "cache_deadlocks", "compile_here", "CACHE_DEADLOCK_FROM", "CACHE_FIXED_IN"]

POOL_ENV = "PJRT_NPROC"
_SIZE_ENVS = (POOL_ENV, "NPROC")  # read in this order by the CPU client, as its core count
_FIXED_IN = (0, 12)
CACHE_DEADLOCK_FROM = (0, 12, 1)  # the first jaxlib seen to deadlock on a cached program
CACHE_FIXED_IN: tuple[int, ...] | None = None  # the first that runs it again, once one is seen


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        digits = re.match(r"\d+", p)  # 0.12.1rc1 -> (0, 12, 1)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


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


def cache_deadlocks(jaxlib_version: str | None = None) -> bool:
    """Whether ``jaxlib_version`` (default: the installed one) deadlocks running a program with
    collectives across processes that jax's persistent compilation cache loaded."""
    version = _version(jaxlib_version or jaxlib.__version__)
    return version >= CACHE_DEADLOCK_FROM and (CACHE_FIXED_IN is None or version < CACHE_FIXED_IN)


def compile_here(jaxlib_version: str | None = None) -> str | None:
    """Turn jax's persistent compilation cache off for this process where its jaxlib deadlocks
    on the programs the cache loads (:func:`cache_deadlocks`) and a cache folder is set, with a
    warning naming the folder; returns the folder turned off, else None. Call it before the
    process compiles anything."""
    folder = jax.config.jax_compilation_cache_dir
    version = jaxlib_version or jaxlib.__version__
    if not (folder and jax.config.jax_enable_compilation_cache and cache_deadlocks(version)):
        return None
    jax.config.update("jax_enable_compilation_cache", False)
    warnings.warn(
        f"jaxlib {version} deadlocks in a collective across "
        f"processes when a program comes from jax's persistent compilation cache ({folder}); "
        "this process compiles its programs instead (the cache is off for it)",
        RuntimeWarning, stacklevel=2)
    return folder
