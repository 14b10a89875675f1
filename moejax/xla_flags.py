"""XLA flags and per-function compile options checked against the XLA that will run them.

XLA aborts the whole process (a C++ ``F`` log line, no Python exception) on a flag it does
not know, and its flags come and go between jaxlib releases. Code that sets a flag for speed
(the test suite's compile-time flags, a benchmark's) asks :func:`supported` first: it starts
a Python with the flags in ``XLA_FLAGS`` and compiles one tiny program, so the answer comes
from the installed jaxlib itself (about 0.4 s; once per flag set and process).

A compile option set on one function (``lowered.compile(compiler_options=...)``) is refused
with an exception, not an abort, where the running XLA does not know it:
:func:`known_options` keeps those it knows. :data:`COMMAND_BUFFERS` puts a decoding's whole
loop, ``while`` and ``conditional`` included, into XLA's command buffers (CUDA graphs), so a
round of the loop never waits on the host (:func:`moejax.nn.sample.sampler`,
:func:`moejax.nn.speculative.speculative_decoder`).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["supported", "with_flags", "known_options", "call_compiled", "COMMAND_BUFFERS"]

COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer":
                   "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}

_PROBE = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"


@functools.cache
def _accepted(flags: tuple[str, ...], python: str) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    result = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, timeout=120)
    return result.returncode == 0


def supported(flags: Sequence[str], python: str | None = None) -> tuple[str, ...]:
    """The flags of ``flags`` (each ``--name=value``) that ``python``'s XLA accepts (default:
    this interpreter), in order. All together first; one by one only when that fails."""
    flags, python = tuple(flags), python or sys.executable
    if not flags or _accepted(flags, python):
        return flags
    return tuple(f for f in flags if _accepted((f,), python))


def with_flags(flags: Sequence[str], env=None) -> str:
    """``env``'s ``XLA_FLAGS`` (default ``os.environ``) with the supported ones of ``flags``
    appended (a flag whose name is already set keeps its value there); an unsupported flag
    is left out, so it can never abort the process."""
    env = os.environ if env is None else env
    have = env.get("XLA_FLAGS", "").split()
    names = {f.partition("=")[0] for f in have}
    new = [f for f in flags if f.partition("=")[0] not in names]
    return " ".join([*have, *supported(new)])


@functools.cache
def _option_known(name: str, value) -> bool:
    import jax  # the running backend's XLA, asked only when an option is set

    lowered = jax.jit(lambda x: x + 1).lower(1.0)
    try:
        lowered.compile(compiler_options={name: value})
    except Exception as e:  # noqa: BLE001 - XLA's INVALID_ARGUMENT for an unknown option
        if "compile option" in str(e) or "INVALID_ARGUMENT" in str(e):
            return False
        raise
    return True


def known_options(options: Mapping) -> tuple[dict, tuple[str, ...]]:
    """``(known, unknown)``: the compile options of ``options`` the running XLA takes, and
    the names of those it refuses (each compiled once into a tiny program, cached)."""
    known = {k: v for k, v in options.items() if _option_known(k, v)}
    return known, tuple(k for k in options if k not in known)


def call_compiled(jitted, args: tuple, static: dict, dynamic: tuple[int, ...], options: Mapping,
                  cache: dict):
    """``jitted(*args, **static)``, compiled with the compile ``options`` (known ones: see
    :func:`known_options`) once per shapes of its ``dynamic`` positional arguments (the
    others are its static ones) and mesh set for tracing, and kept in ``cache``; without
    options, the plain call."""
    if not options:
        return jitted(*args, **static)
    import jax

    dyn = tuple(args[i] for i in dynamic)
    key = tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
                for x in jax.tree.leaves(dyn)) + (jax.sharding.get_abstract_mesh(),)
    if key not in cache:
        cache[key] = jitted.lower(*args, **static).compile(compiler_options=dict(options))
    return cache[key](*dyn)
