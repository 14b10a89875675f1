"""Fewer page faults on CPU: huge pages for large fresh buffers, and an opt-in allocator
setting that keeps freed heap memory in the process.

XLA's CPU runtime and numpy allocate their large buffers with ``malloc`` on every execution.
glibc serves a chunk above its mmap threshold (adaptive, at most 32 MiB on 64-bit) from a
fresh mapping and unmaps it on ``free``, and trims the heap's free top back to the kernel, so
each training step touches new pages: one page fault per 4 KiB, and a fault costs more than
the arithmetic on that page's floats. Three remedies, from local to global:

* :func:`advise_huge_pages`: for one buffer about to be written for the first time, ask the
  kernel (``madvise(MADV_HUGEPAGE)``) to back its aligned 2 MiB ranges with transparent huge
  pages, so a first write faults once per 2 MiB instead of once per 4 KiB. The host expert
  kernel (:mod:`moejax.kernels.moe_ffn.host`) gives it its output buffers, which XLA allocates
  fresh every step. Where THP is off or the platform is not Linux it does nothing; a touched
  range then costs 2 MiB of memory.
* glibc (2.35 and later) has the same advice built in for every large allocation of the
  process, XLA's included, switched on before the process starts: ``GLIBC_TUNABLES=`` +
  :data:`HUGE_PAGE_MALLOC` (``make demo``, ``make studies`` and ``make bench`` set it;
  :func:`malloc_huge_pages` tells whether this process has it).
* :func:`release_freed_memory`: the other way, once: give the heap's free memory back (the
  training loop does at the end of every run, so a study's many runs do not add up).
* :func:`retain_freed_memory` (opt-in, process-wide): glibc keeps freed memory instead of
  returning it, so later steps reuse already-faulted pages; the CPU analogue of PyTorch's
  jemalloc / tcmalloc advice. Nothing in moejax calls it implicitly (a program, or a
  benchmark's ``block_retain_memory`` key, calls it once at start); the process keeps its
  peak heap. Off glibc it changes nothing and returns False.

``bench_dispatch`` measures what each of them saves on this machine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import resource

import numpy as np

__all__ = ["retain_freed_memory", "release_freed_memory", "available_fraction",
           "minor_page_faults", "advise_huge_pages",
           "transparent_huge_pages", "malloc_huge_pages", "GLIBC_MAX_MMAP_THRESHOLD",
           "HUGE_PAGE_BYTES", "HUGE_PAGE_MALLOC"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3   # glibc's mallopt parameters
GLIBC_MAX_MMAP_THRESHOLD = 32 * 2**20   # DEFAULT_MMAP_THRESHOLD_MAX for 64-bit glibc
HUGE_PAGE_BYTES = 2 * 2**20              # x86-64 / arm64 transparent huge page (PMD) size
HUGE_PAGE_MALLOC = "glibc.malloc.hugetlb=1"   # glibc tunable: madvise THP on malloc's memory
_MADV_HUGEPAGE = 14
_PAGE = 4096


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


def release_freed_memory() -> bool:
    """Return the heap's free memory to the kernel now (glibc ``malloc_trim(0)``). A compile
    and a training run free much of what they allocated, but malloc keeps its arenas' free
    chunks mapped, so a process that runs many training runs in a row (a study's methods and
    seeds) grows by each run's compile and allocations. The training loop calls it when a run
    ends. True where glibc did it, False off glibc."""
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return False
    ctypes.CDLL(None).malloc_trim(0)
    return True


def available_fraction(meminfo: str = "/proc/meminfo") -> float | None:
    """The fraction of the machine's memory still available (Linux ``MemAvailable`` over
    ``MemTotal``), or None where the kernel does not say."""
    try:
        fields = dict(line.split(":", 1) for line in open(meminfo).read().splitlines()
                      if ":" in line)
        return int(fields["MemAvailable"].split()[0]) / int(fields["MemTotal"].split()[0])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def minor_page_faults() -> int:
    """Minor page faults of this process so far (``getrusage``): take a difference."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def malloc_huge_pages(environ=None) -> bool:
    """Whether this process's glibc puts malloc's memory on transparent huge pages: started
    with ``glibc.malloc.hugetlb=1`` (or ``=2``) in ``GLIBC_TUNABLES``, on glibc, with THP on.
    ``environ`` defaults to ``os.environ`` (the variable is read once, at process start)."""
    env = os.environ if environ is None else environ
    tunables = dict(t.split("=", 1) for t in env.get("GLIBC_TUNABLES", "").split(":") if "=" in t)
    return (tunables.get("glibc.malloc.hugetlb") in ("1", "2")
            and platform.libc_ver()[0] == "glibc"
            and transparent_huge_pages() not in (None, "never"))


def transparent_huge_pages() -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"), None where there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


@functools.cache
def _madvise():
    if platform.system() != "Linux" or transparent_huge_pages() in (None, "never"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge_pages(*arrays, min_bytes: int = HUGE_PAGE_BYTES) -> int:
    """Ask for transparent huge pages behind the given arrays (module docstring); returns the
    bytes advised (0 where THP is unavailable). Arrays that touch in memory (XLA lays a
    callback's outputs out back to back) are advised as one range, so only the range's two
    ends fall outside whole 2 MiB pages; ranges under ``min_bytes`` are skipped. Advice only:
    values, ownership and lifetime are untouched, and a range the kernel refuses is skipped."""
    madvise = _madvise()
    if madvise is None:
        return 0
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes)
                   for a in map(np.asarray, arrays) if a.nbytes)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    done = 0
    for lo, hi in merged:
        if hi - lo < min_bytes:
            continue
        lo, hi = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE   # madvise takes whole pages
        if hi > lo and madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            done += hi - lo
    return done
