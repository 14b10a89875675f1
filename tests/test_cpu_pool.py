"""The CPU client's worker pool: sized so that several CPU devices cannot deadlock in a
collective when the host runs ahead (jaxlib < 0.12), and left alone where it need not be; jax's
persistent compilation cache off where a jaxlib deadlocks on the programs it loads."""

import warnings
from types import SimpleNamespace

import jax
import pytest

from moejax.cpu_pool import (
    cache_deadlocks,
    check_pool,
    compile_here,
    needs_pool,
    pool_env,
    pool_threads,
    threads_needed,
)
from moejax.train.distributed import cpu_devices_env
from tests.devices import run_on_devices


def test_only_a_jaxlib_before_0_12_needs_the_pool():
    assert needs_pool("0.11.2") and needs_pool("0.10.0")
    assert not needs_pool("0.12.0.1") and not needs_pool("0.13.0") and not needs_pool("1.0.0")


def test_the_pool_asked_for_leaves_a_thread_free_beside_two_per_device():
    assert threads_needed(8) == 17 and threads_needed(2) == 5
    old = "0.11.2"
    assert pool_env(8, {"NPROC": "2"}, old) == {"PJRT_NPROC": "17"}
    assert pool_env(2, {"PJRT_NPROC": "4"}, old) == {"PJRT_NPROC": "5"}  # too small: replaced
    assert pool_env(8, {"PJRT_NPROC": "17"}, old) == {}  # large enough: kept
    assert pool_env(8, {"PJRT_NPROC": "3", "NPROC": "64"}, old) == {"PJRT_NPROC": "17"}
    assert pool_env(1, {"NPROC": "1"}, old) == {}  # one device: no collective
    assert pool_env(8, {"NPROC": "2"}, "0.12.0.1") == {}  # a jaxlib that launches without waiting
    assert pool_threads({"PJRT_NPROC": "9", "NPROC": "3"}) == 9
    assert pool_threads({"NPROC": "3"}) == 3 and pool_threads({}) >= 1


def test_a_process_with_several_cpu_devices_gets_the_pool_where_its_jaxlib_needs_it():
    env = cpu_devices_env(8, {"NPROC": "2"})
    assert (env.get("PJRT_NPROC") == "17") == needs_pool()
    assert "PJRT_NPROC" not in cpu_devices_env(1, {"NPROC": "2"})


def test_only_a_jaxlib_seen_to_deadlock_on_a_cached_program_compiles_its_own():
    assert cache_deadlocks("0.12.1") and cache_deadlocks("0.12.1rc1")
    assert cache_deadlocks("0.13.0.dev20261201")  # until a release is seen to fix it
    assert not cache_deadlocks("0.12.0.1") and not cache_deadlocks("0.11.2")


def _compile_here(monkeypatch, version):
    """What :func:`compile_here` sets (recorded, not applied) and warns on ``version``."""
    calls = []
    monkeypatch.setattr(jax.config, "update", lambda *a: calls.append(a))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = compile_here(version)
    return folder, calls, [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_the_cache_is_turned_off_naming_its_folder_only_on_a_jaxlib_that_deadlocks(monkeypatch):
    cache = jax.config.jax_compilation_cache_dir
    assert cache  # the suite's compilation cache (tests/conftest.py)
    folder, calls, (message,) = _compile_here(monkeypatch, "0.12.1")
    assert folder == cache and calls == [("jax_enable_compilation_cache", False)]
    assert "jaxlib 0.12.1 deadlocks" in message and cache in message
    assert _compile_here(monkeypatch, "0.12.0.1") == (None, [], [])


def _cpus(n):
    return [SimpleNamespace(platform="cpu")] * n


def _warnings(devices, version) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_pool(devices, version)
    return [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_a_mesh_on_too_small_a_pool_is_warned_about_with_the_fix(monkeypatch):
    monkeypatch.setenv("PJRT_NPROC", "2")
    (message,) = _warnings(_cpus(8), "0.11.2")
    assert "deadlock" in message and "PJRT_NPROC=17" in message and "2 worker threads" in message
    assert _warnings(_cpus(8), "0.12.0.1") == []  # a jaxlib that launches without waiting
    assert _warnings(_cpus(1), "0.11.2") == []  # one device: no collective
    assert _warnings([SimpleNamespace(platform="gpu")] * 8, "0.11.2") == []
    monkeypatch.setenv("PJRT_NPROC", "17")
    assert _warnings(_cpus(8), "0.11.2") == []  # the pool is large enough


# A step whose all-reduce spans the mesh's expert axis, dispatched 600 programs ahead of the
# devices; with one pool thread per device jaxlib 0.11.2 deadlocked here in every run.
_RUN_AHEAD = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
w = jax.device_put(jnp.ones((8, 256, 256)) / 256, NamedSharding(mesh, P("expert")))
x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P()))

@jax.jit
def step(w, x):
    for _ in range(4):
        x = jnp.tanh(jnp.einsum("bd,edf->bef", x, w).sum(1))
    return x

assert "all-reduce" in step.lower(w, x).compile().as_text()
for _ in range(300):
    tok = jnp.argmax(x, -1)
    x = step(w, x)
c = 1.0  # every entry stays equal: each step maps c to tanh(8 experts x c), 4 times
for _ in range(1200):
    c = np.tanh(8 * c)
np.testing.assert_allclose(np.asarray(x), np.full((64, 256), c), rtol=1e-5)
print("steps done", 300)
print("OK")
"""


@pytest.mark.slow
def test_eight_cpu_devices_do_not_deadlock_when_the_host_runs_ahead():
    out = run_on_devices(_RUN_AHEAD, hang_s=30, timeout=300)  # a deadlock ends at 30 s
    assert "steps done 300" in out, out[-2000:]
