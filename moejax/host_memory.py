"""An opt-in allocator setting for CPU runs: keep freed heap memory in the process.

XLA's CPU runtime and numpy allocate their large buffers with ``malloc`` on every execution.
glibc serves a chunk above its mmap threshold (adaptive, at most 32 MiB on 64-bit) from a
fresh mapping and unmaps it on ``free``, and trims the heap's free top back to the kernel, so
each training step touches new pages: one page fault per 4 KiB, and a fault costs more than
the arithmetic on that page's floats. Measured on the issue-17 MoE block (2048 tokens, d 256,
8 SwiGLU experts of width 1024, forward + backward, ``dispatch="host"``): 11.5k page faults
per step by default, 130 after :func:`retain_freed_memory` (the residual buffers the forward
hands the backward are the bulk of them). XLA's own temporary buffer of a large program is
one allocation above 32 MiB and stays a fresh mapping either way (the XLA capacity path: 30.6k
-> 29.0k faults per step).

This is the CPU analogue of what PyTorch's CPU tuning guide does with jemalloc / tcmalloc. It
is process-wide, so nothing in moejax calls it implicitly: a program (or a benchmark's
``block_malloc`` key) calls it once at start. The cost is memory: the process keeps its peak
heap instead of returning it. Off glibc (macOS, musl) it changes nothing and returns False.
"""

from __future__ import annotations

import ctypes
import platform
import resource

__all__ = ["retain_freed_memory", "minor_page_faults", "GLIBC_MAX_MMAP_THRESHOLD"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3   # glibc's mallopt parameters
GLIBC_MAX_MMAP_THRESHOLD = 32 * 2**20   # DEFAULT_MMAP_THRESHOLD_MAX for 64-bit glibc


def retain_freed_memory(mmap_threshold: int = GLIBC_MAX_MMAP_THRESHOLD,
                        trim_threshold: int = 2**31 - 1, top_pad: int = 64 * 2**20) -> bool:
    """Serve allocations below ``mmap_threshold`` from the heap, never trim the heap's free
    top below ``trim_threshold`` and grow it ``top_pad`` bytes at a time (glibc ``mallopt``).
    True when glibc took every setting, False where the C library is not glibc."""
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold),
                (_M_TOP_PAD, top_pad))
    rejected = [name for (param, value), name in zip(settings, ("mmap", "trim", "top_pad"))
                if mallopt(param, value) != 1]
    if rejected:
        raise ValueError(f"glibc rejected the malloc settings {rejected} (mmap_threshold="
                         f"{mmap_threshold}, trim_threshold={trim_threshold}, top_pad="
                         f"{top_pad}); older glibc takes mmap_threshold <= "
                         f"{GLIBC_MAX_MMAP_THRESHOLD}")
    return True


def minor_page_faults() -> int:
    """Minor page faults of this process so far (``getrusage``): take a difference."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
