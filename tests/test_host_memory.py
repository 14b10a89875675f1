"""``retain_freed_memory``: glibc keeps freed heap memory, so a step that allocates and frees
the same large buffers stops page-faulting (run in subprocesses: the setting is process-wide).
``release_freed_memory``: free chunks held inside the heap go back to the kernel.
``advise_huge_pages``: a fresh mapping written after the advice faults once per 2 MiB."""

import mmap
import platform
import subprocess
import sys

import numpy as np
import pytest

import moejax.kernels.host_memory as hmem
from moejax.train import step_cache
from moejax.train.hparams import TrainConfig

STEP = """
import sys, numpy as np
from moejax.kernels.host_memory import retain_freed_memory, minor_page_faults
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def step():  # three 12 MiB buffers, touched, freed: the heap's free top exceeds glibc's trim
    arrs = [np.empty(3 * 2**20, np.float32) for _ in range(3)]
    for a in arrs:
        a[:] = 1
for _ in range(3):
    step()
f0 = minor_page_faults()
for _ in range(10):
    step()
print((minor_page_faults() - f0) / 10)
"""


def _faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_retained_memory_stops_the_page_faults():
    default, retained = _faults_per_step("default"), _faults_per_step("retain")
    assert default > 500, f"the default allocator should fault here (got {default}/step)"
    assert retained < default / 10, (default, retained)


def _fresh(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """A private anonymous mapping no page of which has been touched (as XLA's are)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, np.float32)


def _first_write_faults(advise: bool) -> int:
    m, a = _fresh(16 * 2**20)
    if advise:
        assert hmem.advise_huge_pages(a) >= 14 * 2**20   # all but the unaligned ends
    f0 = hmem.minor_page_faults()
    a[:] = 1.0
    faults = hmem.minor_page_faults() - f0
    assert float(a.sum()) == a.size                       # the values are ordinary memory
    del a
    m.close()
    return faults


@pytest.mark.skipif(hmem.transparent_huge_pages() in (None, "never"),
                    reason="transparent huge pages are off in this kernel")
def test_advised_fresh_memory_faults_once_per_huge_page():
    plain, advised = _first_write_faults(False), _first_write_faults(True)
    assert plain >= 4000, plain                           # one per 4 KiB page
    assert advised <= 64, advised                         # 8 huge pages (+ unaligned ends)


def test_touching_arrays_are_advised_as_one_range(monkeypatch):
    calls = []
    monkeypatch.setattr(hmem, "_madvise", lambda: lambda lo, n, flag: calls.append((lo, n)) or 0)
    m, a = _fresh(8 * 2**20)
    halves = a[: a.size // 2], a[a.size // 2:]            # back to back, each 4 MiB
    assert hmem.advise_huge_pages(*halves) == 8 * 2**20   # page-aligned mapping: all of it
    assert calls == [(a.ctypes.data, 8 * 2**20)]          # one range, not two
    calls.clear()
    apart = a[: 2**18], a[2**19: 2**19 + 2**18]           # 1 MiB each, a gap between
    assert hmem.advise_huge_pages(*apart, min_bytes=2**20) == 2 * 2**20
    assert len(calls) == 2
    calls.clear()
    assert hmem.advise_huge_pages(a[:1000]) == 0 and not calls   # under min_bytes: skipped
    del a, halves, apart
    m.close()


def test_no_transparent_huge_pages_means_no_advice(monkeypatch):
    monkeypatch.setattr(hmem, "transparent_huge_pages", lambda: "never")
    hmem._madvise.cache_clear()
    try:
        assert hmem._madvise() is None
        assert hmem.advise_huge_pages(np.ones(2**20, np.float32)) == 0
    finally:
        monkeypatch.undo()
        hmem._madvise.cache_clear()


def test_malloc_huge_pages_reads_the_glibc_tunable(monkeypatch):
    monkeypatch.setattr(hmem, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(hmem.platform, "libc_ver", lambda: ("glibc", "2.36"))
    on = {"GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.hugetlb=1"}
    assert hmem.malloc_huge_pages(on)
    assert not hmem.malloc_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not hmem.malloc_huge_pages({})
    monkeypatch.setattr(hmem, "transparent_huge_pages", lambda: "never")
    assert not hmem.malloc_huge_pages(on)           # the kernel has THP off: no effect
    monkeypatch.setattr(hmem, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(hmem.platform, "libc_ver", lambda: ("", ""))
    assert not hmem.malloc_huge_pages(on)           # not glibc: the variable means nothing


RELEASE = """
import ctypes, os, sys
from moejax.kernels.host_memory import release_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
chunks = [libc.malloc(4000) for _ in range(50000)]   # 200 MB of small chunks, touched
for c in chunks:
    ctypes.memset(c, 1, 4000)
pin = libc.malloc(4000)   # above them all: the heap's top cannot shrink past it
for c in chunks:
    libc.free(c)
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page / 2**20
before = rss()
if sys.argv[1] == "release":
    assert release_freed_memory()
print(before - rss())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_release_freed_memory_returns_free_chunks_inside_the_heap():
    def freed(mode):
        out = subprocess.run([sys.executable, "-c", RELEASE, mode], capture_output=True,
                             text=True, check=True)
        return float(out.stdout.strip())

    assert freed("keep") < 20            # glibc alone keeps the 200 MB mapped
    assert freed("release") > 150        # ... and gives it back when asked


def test_available_fraction_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")
    assert hmem.available_fraction(str(f)) == 0.25
    f.write_text("nothing here\n")
    assert hmem.available_fraction(str(f)) is None
    assert hmem.available_fraction(str(tmp_path / "absent")) is None


def test_the_loop_drops_its_cached_steps_only_when_memory_is_short():
    step_cache.cached_step.cache_clear()
    step_cache.cached_step(None, None, None, TrainConfig(steps=1), None)  # one cached step
    assert step_cache.release_memory(lambda: 0.9) is False
    assert step_cache.cached_step.cache_info().currsize == 1
    assert step_cache.release_memory(lambda: 0.1) is True
    assert step_cache.cached_step.cache_info().currsize == 0
