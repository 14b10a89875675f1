"""``moejax.bench.cpu``: the matmul rate behind the FLOP bound and the block's FLOP count."""

from __future__ import annotations

import math

import numpy as np
import pytest

import moejax.bench.cpu as bench
from moejax.bench import moe_block
from moejax.bench.cpu import matmul_gflops, moe_block_flops
from moejax.bench.timing import device_matmul_gflops


@pytest.mark.parametrize("backend", ["xla", "numpy"])
def test_matmul_rate_is_the_flops_over_the_median_time(backend, monkeypatch):
    calls = []

    def timed(fn, *args, repeats):  # runs the multiply once, reports a known median
        calls.append(fn(*args))
        return {"median_s": 0.5}

    monkeypatch.setattr(bench, "time_call", timed)
    rate = matmul_gflops(64, 32, 48, repeats=2, backend=backend, inner=3)
    flops = 2.0 * 64 * 32 * 48 * (3 if backend == "xla" else 1)
    assert rate == pytest.approx(flops / 0.5 / 1e9)
    assert np.asarray(calls[0]).shape == (64, 48)  # what was timed is the [m, k] @ [k, n]
    assert math.isfinite(matmul_gflops(16, 8, 8, repeats=1, backend=backend, inner=1))


def test_matmul_rate_rejects_an_unknown_backend_and_an_empty_loop():
    with pytest.raises(ValueError, match="'xla' or 'numpy'"):
        matmul_gflops(8, 8, 8, backend="torch")
    with pytest.raises(ValueError, match="at least 1"):
        matmul_gflops(8, 8, 8, inner=0)


def test_block_flops_count_three_gated_matrices_forward_and_backward():
    # bench_dispatch's block: 2048 tokens, d 256, width 1024, top-2, SwiGLU -> 19.3 GFLOP
    assert moe_block_flops(2048, 256, 1024, 2) == pytest.approx(19.327e9, rel=1e-3)
    assert moe_block_flops(2048, 256, 1024, 2, gated=False) == pytest.approx(
        moe_block_flops(2048, 256, 1024, 2) * 2 / 3)


def test_a_torch_without_cuda_is_not_timed_as_a_gpus_peer(monkeypatch):
    """Beside a GPU jax, a torch that sees no GPU gives no time (its CPU time would be
    compared with the GPU's), and the block table says so instead of dividing by it."""
    import sys
    import types

    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert bench.torch_moe_block_s(8, 4, 4, 2, 1, device="cuda") == (None, bench.NO_CUDA)

    times = {"capacity cf=1.25": 0.002,
             f"{moe_block.TORCH})": "not timed: this torch has no CUDA"}
    rows = {r["impl"]: r for r in moe_block.block_rows(times, 0.001, {"xla": 10.0,
                                                                      "numpy": 1.0})}
    assert "vs_torch" not in rows["capacity cf=1.25"]  # nothing to divide by
    assert rows["capacity cf=1.25"]["vs_flop_bound"] == pytest.approx(2.0)
    assert rows[f"{moe_block.TORCH})"]["note"].startswith("not timed")
    assert "ms" not in rows[f"{moe_block.TORCH})"]
    monkeypatch.setattr(moe_block, "torch_moe_block_s", lambda *a, **k: (None, bench.NO_CUDA))
    noted = moe_block.block_times(moe_block.BlockShape(64, 16, 32, 4, 2), (), repeats=1)
    assert noted == {f"{moe_block.TORCH})": "not timed: this torch has no CUDA (a CUDA torch "
                                            "times the peer on the GPU)"}


def test_the_block_bound_on_an_accelerator_is_a_device_timed_matmul(monkeypatch):
    """On a GPU the bound's rate is XLA's matmul in device time (as the block is timed), not
    a host-timed one nor numpy's BLAS; the note names it."""
    assert device_matmul_gflops(64, 32, 16, iters=2, repeats=1) > 0  # runs here too
    asked = []
    monkeypatch.setattr(moe_block, "device_matmul_gflops", lambda *s: asked.append(s) or 500.0)
    monkeypatch.setattr(moe_block, "matmul_gflops", lambda *a, **k: pytest.fail("host rate"))
    monkeypatch.setattr(moe_block.jax, "default_backend", lambda: "gpu")
    shape = moe_block.BlockShape(2048, 256, 1024, 8, 2)
    bound, rates = moe_block.block_bound(shape)
    assert asked == [(2 * shape.tokens, shape.d, shape.f)]
    assert rates == {"XLA (device time)": 500.0}
    flops = moe_block_flops(shape.tokens, shape.d, shape.f, shape.top_k)
    assert bound == pytest.approx(flops / 500e9)
    row = moe_block.block_rows({}, bound, rates)[-1]
    assert row["note"] == "matmul rate here: XLA (device time) 500 GFLOP/s"
