"""The grouped matmul's Mosaic GPU kernels (moejax.kernels.grouped.gmm_mgpu, one warpgroup, and
gmm_mgpu_ws, warp-specialized) in Mosaic GPU's interpreter on this CPU: forward, dX and dW each
equal a numpy loop over the groups (empty groups, groups spanning tiles, row tiles two groups
share, rows past the groups, every dimension off the blocks, bf16 and f16); the row-store ladder
and the block fitting; float32 is refused the way tokamax refuses it (so ragged_dot falls back
to the Triton kernel). Exported for an H100, each product is one Mosaic GPU kernel and no Triton
kernel, and ragged_dot's train step runs the three on it when ``OWN_TIERS`` names it."""

import re

import jax
import jax.export as je
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import autotune
from moejax.kernels import tuning
from moejax.kernels.grouped import gmm_mgpu as gm
from moejax.kernels.grouped import gmm_mgpu_ws as gm_ws
from moejax.kernels.grouped import ragged as rd
from moejax.kernels.mgpu import row_ladder
from moejax.kernels.targets import lowering_target
from moejax.kernels.tiling import hopper_target
from moejax.train.aot import TRITON

# (group sizes, M): an empty group, a group over several tiles, tiles two or three groups
# share, rows past the groups (their output is 0)
CASES = [((70, 0, 100, 64), 320), ((3, 130, 1, 0), 200), ((0, 0, 64, 0), 64)]
# interpret mode's launches (rows, contraction, columns, warps, stages): one warpgroup, and
# warp-specialized (two computing warpgroups of 128 columns, or 64 rows of dW, each; stored 64
# columns at a time)
TILES = tuning.TritonConfig(64, 64, 64, 4, 2)
SPECIALIZED = tuning.TritonConfig(64, 64, 128, 12, 2)


def _group_rows(sizes):
    ends = np.cumsum(sizes)
    return list(zip(ends - np.asarray(sizes), ends))


def _np_gmm(x, w, sizes):
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    y = np.zeros((x.shape[0], w.shape[2]), np.float32)
    for g, (a, b) in enumerate(_group_rows(sizes)):
        y[a:b] = x[a:b] @ w[g]
    return y


def _np_tgmm(x, dy, sizes):
    x, dy = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    return np.stack([x[a:b].T @ dy[a:b] for a, b in _group_rows(sizes)])


def _data(m, k, n, G, dtype, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(m, k)), dtype),
            jnp.asarray(rng.normal(size=(G, k, n)) / np.sqrt(k), dtype),
            jnp.asarray(rng.normal(size=(m, n)), dtype))


def _assert_close(got, want, dtype):
    """Within two steps of ``dtype`` of the float32 oracle's largest value (the kernels sum in
    float32 and round once)."""
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape
    step = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * step * np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("sizes,m", CASES)
@pytest.mark.parametrize("k,n,dtype,tiles", [(128, 192, jnp.bfloat16, TILES),
                                             (72, 136, jnp.float16, TILES),
                                             (192, 320, jnp.bfloat16, SPECIALIZED)])
def test_the_three_products_equal_numpy_loops(sizes, m, k, n, dtype, tiles):
    G = len(sizes)
    x, w, dy = _data(m, k, n, G, dtype, seed=m + k)
    gs = jnp.asarray(sizes, jnp.int32)
    run = dict(interpret=True, tiles=tiles)
    _assert_close(gm.gmm_mgpu(x, w, gs, **run), _np_gmm(x, w, sizes), dtype)
    _assert_close(gm.gmm_t_mgpu(dy, w, gs, **run), _np_gmm(dy, jnp.swapaxes(w, 1, 2), sizes),
                  dtype)
    dw = gm.tgmm_mgpu(x, dy, gs, **run)
    _assert_close(dw, _np_tgmm(x, dy, sizes), dtype)
    empty = np.asarray(sizes) == 0
    assert float(jnp.abs(dw[empty].astype(jnp.float32)).max(initial=0.0)) == 0.0


def test_a_wrong_row_range_fails_the_oracle(monkeypatch):
    """The oracle sees a store of one row too many (the neighbouring group's row written
    with this group's weights) and a dW that keeps a neighbour's rows (either launch)."""
    sizes, m = (70, 0, 100, 64), 320
    x, w, dy = _data(m, 128, 128, len(sizes), jnp.bfloat16, seed=3)
    gs = jnp.asarray(sizes, jnp.int32)
    want = _np_gmm(x, w, sizes)
    store = gm._store_rows
    monkeypatch.setattr(gm, "_store_rows", lambda acc, o, row0, first, size, *a: store(
        acc, o, row0, first, jnp.minimum(size + 1, TILES[0] - first), *a))
    with pytest.raises(AssertionError):
        _assert_close(gm.gmm_mgpu(x, w, gs, interpret=True, tiles=TILES), want, jnp.bfloat16)
    monkeypatch.undo()
    for module in (gm, gm_ws):
        monkeypatch.setattr(module, "zero_rows_outside", lambda *a: None)
    for tiles in (TILES, SPECIALIZED):
        with pytest.raises(AssertionError):
            _assert_close(gm.tgmm_mgpu(x, dy, gs, interpret=True, tiles=tiles),
                          _np_tgmm(x, dy, sizes), jnp.bfloat16)


def test_the_kernels_take_a_forced_configuration_as_a_tuned_one_is_read():
    """Blocks other than the defaults (as the autotune tries them and a tuned table gives
    them): 128-column contraction steps, 256-column outputs, 3 stages; still the oracle's."""
    sizes, m = (3, 130, 1, 0), 200
    x, w, dy = _data(m, 256, 256, len(sizes), jnp.bfloat16, seed=5)
    gs = jnp.asarray(sizes, jnp.int32)
    with tuning.forced(tuning.TritonConfig(64, 128, 256, 4, 3)):
        _assert_close(gm.gmm_mgpu(x, w, gs, interpret=True), _np_gmm(x, w, sizes),
                      jnp.bfloat16)
        _assert_close(gm.tgmm_mgpu(x, dy, gs, interpret=True), _np_tgmm(x, dy, sizes),
                      jnp.bfloat16)
    fn, args, oracle = autotune._call("tgmm_mgpu", autotune.AutotuneConfig(rows=64, groups=4),
                                      jnp.bfloat16, 128, 64, jax.random.key(0))
    assert [a.shape for a in args] == [(64, 128), (64, 64), (4,)]
    assert oracle(*args).shape == (4, 128, 64)


def test_store_ladder_and_block_fitting():
    for tm in (64, 128, 96):
        ladder = row_ladder(tm)
        assert list(ladder) == sorted(ladder, reverse=True) and ladder[-1] == 1
        for r in range(tm + 1):  # every row count is a sum of distinct rungs
            assert sum(length for length in ladder if r & length) == r
    assert gm.fit_block(704, 128) == 64 and gm.fit_block(1408, 128) == 128
    assert gm.fit_block(2048, 256) == 256 and gm.fit_block(100, 128) == 128  # padded


def test_float32_and_other_gpus_are_refused_as_tokamax_refuses_them():
    """float32 anywhere, and bf16 built for a device without wgmma (a CPU; an A100):
    ``NotImplementedError``, on which ragged_dot falls back to the Triton kernel; a Hopper
    GPU takes bf16."""
    x, w, dy = _data(64, 64, 64, 2, jnp.float32, seed=0)
    gs = jnp.asarray([30, 34], jnp.int32)
    calls = (lambda x, w, dy: gm.gmm_mgpu(x, w, gs), lambda x, w, dy: gm.gmm_t_mgpu(dy, w, gs),
             lambda x, w, dy: gm.tgmm_mgpu(x, dy, gs))
    for call in calls:
        with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
            call(x, w, dy)
        bf16 = [a.astype(jnp.bfloat16) for a in (x, w, dy)]
        if hopper_target():  # a Hopper GPU here: the kernel takes bf16
            assert jnp.isfinite(call(*bf16).astype(jnp.float32)).all()
            continue
        with pytest.raises(NotImplementedError, match="needs a Hopper GPU"):
            call(*bf16)


# the names these kernels' Mosaic GPU calls carry (tokamax's kernels are also mosaic_gpu_v2
# calls): "moejax_gmm_mgpu", "moejax_tgmm_mgpu" and their warp-specialized "..._ws"
OURS = "moejax_"


def _cuda_calls(fn, *args):
    with lowering_target("cuda"):
        text = je.export(jax.jit(fn), platforms=("cuda",),
                         disabled_checks=[je.DisabledSafetyCheck.custom_call(TRITON)])(
            *args).mlir_module()
    return re.findall(r"custom_call @([\w$.]+)", text), text


def test_each_product_exports_as_one_mosaic_gpu_kernel():
    S = jax.ShapeDtypeStruct
    m, k, n, G = 16384, 1024, 1408, 16  # a full preset's expert width, off 256-column blocks
    bf = jnp.bfloat16
    gs = S((G,), jnp.int32)
    for fn, a, b in ((gm.gmm_mgpu, S((m, k), bf), S((G, k, n), bf)),
                     (gm.gmm_t_mgpu, S((m, n), bf), S((G, k, n), bf)),
                     (gm.tgmm_mgpu, S((m, k), bf), S((m, n), bf))):
        calls, text = _cuda_calls(fn, a, b, gs)
        assert calls == ["mosaic_gpu_v2"] and OURS in text, (fn.__name__, calls)


@pytest.mark.skipif(not rd.AVAILABLE, reason="tokamax is not installed")
def test_ragged_dot_runs_the_mosaic_gpu_kernels_where_own_kernel_names_them(monkeypatch):
    """A large bf16 product (above OWN_FROM_FLOPS) with OWN_TIERS naming "gmm_mgpu" for the
    forward product and dX: forward and both gradients are these kernels, no Triton; float32
    falls back to Triton."""
    monkeypatch.setitem(rd.OWN_TIERS, "cuda", {"fwd": ((8e9, "gmm_mgpu"),),
                                               "dlhs": ((8e9, "gmm_mgpu"),)})

    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(rd.ragged_dot(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    S = jax.ShapeDtypeStruct
    m, k, n, g = 4096, 1024, 1408, 16
    for dtype, want in ((jnp.bfloat16, "mosaic_gpu_v2"), (jnp.float32, TRITON)):
        calls, text = _cuda_calls(step, S((m, k), dtype), S((g, k, n), dtype),
                                  S((g,), jnp.int32))
        assert calls.count(want) == 3 and len(calls) == 3, (dtype, calls)
        assert (OURS in text) == (dtype == jnp.bfloat16)  # these kernels, not tokamax's
    assert rd.implementation("cuda", "fwd", m, k, n) == "gmm_mgpu"


@pytest.mark.skipif(not rd.AVAILABLE, reason="tokamax is not installed")
def test_ragged_dot_kernel_names_one_implementation_at_every_size():
    """``kernel="gmm_mgpu"``: all three passes on these kernels even below OWN_FROM_FLOPS
    (where the measured choice is tokamax's for the forward product and dX); an unknown name
    is refused."""
    def step(kernel):
        def fn(x, w, gs):
            loss = lambda x, w: jnp.sum(  # noqa: E731
                rd.ragged_dot(x, w, gs, kernel=kernel).astype(jnp.float32) ** 2)
            return jax.value_and_grad(loss, (0, 1))(x, w)
        return fn

    S = jax.ShapeDtypeStruct
    args = (S((2048, 256), jnp.bfloat16), S((8, 256, 512), jnp.bfloat16), S((8,), jnp.int32))
    for kernel in ("gmm_mgpu", "measured"):  # measured: tokamax's forward and dX, the own dW
        calls, text = _cuda_calls(step(kernel), *args)
        assert len(calls) == 3 and OURS in text, kernel
        assert ("ragged_dot_sm90" in text) == (kernel == "measured"), kernel
    with pytest.raises(ValueError, match="kernel='bogus'"):
        rd.ragged_dot(jnp.ones((4, 2)), jnp.ones((1, 2, 3)), jnp.array([4]), kernel="bogus")


@pytest.mark.skipif(jax.default_backend() != "gpu" or not hopper_target(),
                    reason="the compiled kernels need a Hopper GPU (make gpu-check)")
@pytest.mark.parametrize("sizes,m", CASES)
def test_the_compiled_kernels_equal_numpy_loops_on_a_hopper_gpu(sizes, m):
    """The same products compiled for the GPU at hand, with its tuned or default blocks."""
    x, w, dy = _data(m, 256, 704, len(sizes), jnp.bfloat16, seed=m)
    gs = jnp.asarray(sizes, jnp.int32)
    _assert_close(jax.jit(gm.gmm_mgpu)(x, w, gs), _np_gmm(x, w, sizes), jnp.bfloat16)
    _assert_close(jax.jit(gm.gmm_t_mgpu)(dy, w, gs),
                  _np_gmm(dy, jnp.swapaxes(w, 1, 2), sizes), jnp.bfloat16)
    _assert_close(jax.jit(gm.tgmm_mgpu)(x, dy, gs), _np_tgmm(x, dy, sizes), jnp.bfloat16)
