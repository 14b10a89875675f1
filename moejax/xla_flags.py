"""XLA flags checked against the XLA that will run them.

XLA aborts the whole process (a C++ ``F`` log line, no Python exception) on a flag it does
not know, and its flags come and go between jaxlib releases. Code that sets a flag for speed
(the test suite's compile-time flags, a benchmark's) asks :func:`supported` first: it starts
a Python with the flags in ``XLA_FLAGS`` and compiles one tiny program, so the answer comes
from the installed jaxlib itself (about 0.4 s; once per flag set and process).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["supported", "with_flags"]

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
