import gc
import os
import platform
from pathlib import Path

from moejax.xla_flags import with_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests run tiny models: compiling dominates their time, running them does not. LLVM's
# optimisation level 0 compiles 30-40% faster here (e.g. the darex_controlled smoke test
# 23-26 s -> 14-19 s) and changes no result beyond float rounding. The flag is passed only
# where the installed XLA knows it (an unknown flag aborts the process). Set
# MOEJAX_TEST_XLA_OPT=1 to test with XLA's defaults.
#
# XLA's CPU code for a CPU with AVX512-BF16 (jaxlib 0.12.0.1 on an Intel Xeon with AMX)
# keeps the float32 value where a program rounds it to bfloat16 and back inside a Pallas
# kernel run in the interpreter (decode_qkv's product rounded before its bias is added), so a
# test expecting the bits of the XLA step it replaces fails on such a machine alone. The
# tests cap XLA's x86 instruction set at AVX512, where every conversion rounds.
_FLAGS = ["--xla_cpu_max_isa=AVX512"] if platform.machine() in ("x86_64", "AMD64") else []
if os.environ.get("MOEJAX_TEST_XLA_OPT", "0") != "1":
    _FLAGS.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = with_flags(_FLAGS)

# Tracing a program allocates millions of short-lived Python objects, and with CPython's
# default thresholds (700, 10, 10) the collector walks the whole heap again and again while it
# does: about 10% of a study smoke test's time (bench_speculative 36.6 s -> 32.0 s,
# moe_kd 32.2 s -> 29.1 s, cold compilation cache). Collecting less often frees the same
# cycles later; nothing a test checks depends on when.
gc.set_threshold(50_000, 20, 20)

# A deprecated API in use fails the suite (pyproject's filterwarnings), in the Python
# subprocesses the multi-device and fault tests start too. Allowed: jax's Pallas Triton
# backend, which the float32 and pre-Hopper GPU kernels use while jax has it (bf16 and f16 on
# Hopper go through Mosaic GPU), and jax 0.12.1's two deprecations that tokamax and orbax use
# (by message here: moejax's own use of them fails the in-process tests, pyproject's filters).
os.environ["PYTHONWARNINGS"] = (
    "error::DeprecationWarning,"
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning,"
    "ignore:jax.pallas.GridSpec is deprecated:DeprecationWarning,"
    "ignore:jax.sharding.SingleDeviceSharding is deprecated:DeprecationWarning")

# Many tests compile the same tiny programs (the tiny substrates, the same train step on the
# same shapes); XLA's persistent compilation cache, shared by the pytest workers and by the
# Python subprocesses the multi-device tests start (they inherit these variables), compiles
# each once per machine: in the user's cache folder, so a fresh clone or worktree reuses what
# another compiled (a cold suite spends about half its time compiling). Keyed by the program,
# jax version and flags, so it is never stale; bounded by MOEJAX_TEST_JAX_CACHE_GB (default 2):
# past it, a session starts by removing the oldest entries. MOEJAX_TEST_JAX_CACHE=DIR names
# another folder (an empty one measures a cold suite).
JAX_CACHE = Path(os.environ.get("MOEJAX_TEST_JAX_CACHE")
                 or Path.home() / ".cache" / "moejax" / "jax-tests")
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(JAX_CACHE)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# Runs the tests finish go to an index of their own, not to the repository's runs/index.jsonl
# that the results documents are generated from (moejax.harness.run_index).
os.environ["MOEJAX_RUN_INDEX"] = os.environ.get(
    "MOEJAX_TEST_RUN_INDEX", str(Path(__file__).resolve().parent.parent / ".cache" /
                                 "test-run-index.jsonl"))

import pytest  # noqa: E402

# Property tests draw the same examples on every run (derandomize: CI cannot flake on a new
# draw), keep no example database in the checkout, and have no per-example deadline (a first
# example pays jax's compilation). A machine without hypothesis (a GPU machine's image, whose
# stages run test files that draw nothing) runs the rest; the files that draw import it.
try:
    from hypothesis import settings  # noqa: E402
except ImportError:
    settings = None
if settings is not None:
    settings.register_profile("moejax", max_examples=60, derandomize=True, database=None,
                              deadline=None)
    settings.load_profile("moejax")


def prune_cache(folder: Path, max_bytes: int) -> int:
    """Remove the oldest files of ``folder`` (by modification time) until the rest fit in
    ``max_bytes``; returns how many were removed. Files that vanish meanwhile (another
    session pruning) are skipped."""
    files = []
    for f in folder.rglob("*") if folder.is_dir() else ():
        try:
            st = f.stat()
        except OSError:
            continue
        if f.is_file():
            files.append((st.st_mtime, st.st_size, f))
    total, removed = sum(size for _, size, _ in files), 0
    for _, size, f in sorted(files, key=lambda t: t[0]):
        if total <= max_bytes:
            break
        f.unlink(missing_ok=True)
        total, removed = total - size, removed + 1
    return removed


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once per session, in the controlling process
        prune_cache(JAX_CACHE, int(float(os.environ.get("MOEJAX_TEST_JAX_CACHE_GB", "2"))
                                   * 2**30))


@pytest.fixture()
def abandoned_reads_collected():
    """A restore of a deliberately corrupted orbax checkpoint fails inside orbax's asynchronous
    reads, which leave their unfinished read coroutines to the garbage collector: collected
    after the test, so that their "exception ignored" reports stay with it (where a
    ``filterwarnings`` mark expects them) rather than surfacing in whichever test runs next."""
    yield
    gc.collect()


@pytest.fixture()
def tiny_recipes(monkeypatch, tmp_path):
    """Tiny substrate recipes in the registry (tests/tiny_substrates.py); returns a fresh
    cache directory."""
    from moejax.substrates import registry
    from tests.tiny_substrates import tiny_registry

    monkeypatch.setattr(registry, "SUBSTRATES", tiny_registry())
    return tmp_path / "subs"
