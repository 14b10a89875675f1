"""The Mosaic GPU pair kernels (moejax.kernels.chunk_union.pairs_gpu) in Mosaic GPU's interpreter:
each product equals a numpy loop over the pairs (an empty tile, an expert in no union, plain
and transposed weights, rows and columns off the blocks, operands by pair or by tile); the
chunk-union layer on them equals the jnp union path in values and gradients (and the dense
oracle in values); a bf16 BlockFFN LM
train step lowered for an H100 runs them and no Triton kernel. On a Hopper GPU
``scripts/gpu_check.sh`` runs the compiled kernels through the layer tests."""

import jax
import jax.export as je
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.chunk_union.pairs import (
    GPU_INTERPRET,
    pair_down,
    pair_up,
    pair_wgrad,
    union_pairs,
)
from moejax.kernels.chunk_union.pallas import chunk_union_kernel
from moejax.kernels.chunk_union.reference import chunk_union_experts, dense_experts, union_members
from moejax.kernels.targets import lowering_target
from moejax.kernels.tiling import hopper_target
from moejax.train.aot import TRITON

S, E, U = 4, 6, 3
BF = jnp.bfloat16


def _pairs(n, rng):
    active = rng.random((S, n, E)) < 0.2
    active[1] = False  # an empty tile
    active[:, :, 5] = False  # an expert in no union
    ids, _, sizes = union_members(jnp.asarray(active), U)
    count = np.minimum(np.asarray(sizes), U)
    members = [(s, j, int(ids[s, j])) for s in range(S) for j in range(int(count[s]))]
    assert count[1] == 0 and members and all(e != 5 for *_, e in members)
    return union_pairs(ids, jnp.asarray(count), E), members


def _bf(rng, shape):
    """A bf16 array and its exact float32 value."""
    a = jnp.asarray(rng.normal(size=shape), BF)
    return a, np.asarray(a, np.float32)


def _steps(got, want) -> float:
    """The largest error of bf16 results of float32 sums, in bf16 steps (2^-8) of the
    reference's largest value (tests accept 2)."""
    err = np.abs(np.asarray(got, np.float32) - want).max()
    if err == 0:
        return 0.0
    largest = np.abs(want).max()
    return float(err / (2.0 ** -8 * largest)) if largest > 0 else float("inf")


@pytest.mark.parametrize("n,K,N", [(5, 72, 136), (70, 128, 64)])
@pytest.mark.parametrize("transpose", [False, True])
def test_up_and_down_equal_loops_over_the_pairs(n, K, N, transpose):
    rng = np.random.default_rng(n)
    pairs, members = _pairs(n, rng)
    w, w32 = _bf(rng, (E, N, K) if transpose else (E, K, N))
    wm = np.swapaxes(w32, 1, 2) if transpose else w32
    xs, xs32 = _bf(rng, (S, n, K))
    h, h32 = _bf(rng, (S * U, n, K))
    up_ref, down_ref = np.zeros((S * U, n, N)), np.zeros((S, n, N))
    for s, j, e in members:
        up_ref[s * U + j] = xs32[s] @ wm[e]
        down_ref[s] += h32[s * U + j] @ wm[e]
    kw = dict(transpose=transpose, interpret=GPU_INTERPRET)
    assert _steps(pair_up(xs, w, pairs, **kw), up_ref) <= 2
    assert _steps(pair_down(h, w, pairs, **kw), down_ref) <= 2


@pytest.mark.parametrize("l_by,r_by", [("pair", "tile"), ("tile", "pair")])
def test_wgrad_sums_each_experts_pairs(l_by, r_by):
    rng = np.random.default_rng(3)
    n, K, N = 70, 72, 136
    pairs, members = _pairs(n, rng)
    lhs, l32 = _bf(rng, (S * U if l_by == "pair" else S, n, K))
    rhs, r32 = _bf(rng, (S * U if r_by == "pair" else S, n, N))
    ref = np.zeros((E, K, N))
    for s, j, e in members:
        ref[e] += (l32[s * U + j if l_by == "pair" else s].T
                   @ r32[s * U + j if r_by == "pair" else s])
    dw = pair_wgrad(lhs, rhs, pairs, E, l_by=l_by, r_by=r_by, interpret=GPU_INTERPRET)
    assert _steps(dw, ref) <= 2
    assert not np.any(np.asarray(dw[5], np.float32))  # in no union: exactly zero


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        jax.default_backend() != "gpu" or not hopper_target(),
        reason="the compiled kernels need a Hopper GPU (make gpu-check)"))])
def test_the_layer_on_them_equals_the_union_oracle_with_gradients(compiled):
    """Gated (swiglu): every product of the layer, the gate's included."""
    rng = np.random.default_rng(7)
    N, D, F, tile = 13, 64, 64, 4
    x = jnp.asarray(rng.normal(size=(N, D)), BF)
    a = jnp.asarray(np.where(rng.random((N, E)) < 0.3, rng.random((N, E)) + 0.1, 0.0),
                    jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), BF)
          for s in ((E, D, F), (E, F, D), (E, D, F))]
    wg, act = ws[2], "swiglu"

    def loss(fn):
        def f(x, a, wu, wd):
            return jnp.sum(fn(x, a, wu, wd).astype(jnp.float32) ** 2)
        # compiled whole (op by op, each op compiles on its own)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, a, ws[0], ws[1])

    got = loss(lambda x, a, wu, wd: chunk_union_kernel(
        x, a, a > 0, wu, wd, wg, activation=act, tile=tile, max_union=E,
        interpret=None if compiled else GPU_INTERPRET)[0])
    f32 = lambda z: None if z is None else z.astype(jnp.float32)  # noqa: E731
    want = loss(lambda x, a, wu, wd: chunk_union_experts(
        f32(x), a, a > 0, f32(wu), f32(wd), f32(wg), act, tile=tile, max_union=E)[0])
    # the union path's forward is the dense one (every active expert is in its tile's union)
    np.testing.assert_allclose(float(want[0]), float(loss(lambda x, a, wu, wd: dense_experts(
        f32(x), a, f32(wu), f32(wd), f32(wg), act))[0]), rtol=1e-5)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=3e-2)
    for g, w in zip(got[1], want[1]):
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0,
                                   atol=0.05 * np.abs(w).max())


def test_a_bf16_blockffn_train_step_lowers_to_them_for_an_h100():
    """The chunk-union layer's forward and backward in bf16: 6 Mosaic GPU launches (up, down,
    dh, dx, dW_up, dW_down), no Triton; float32 keeps Triton (tests/test_export.py)."""
    n, d, f, tile = 64, 256, 128, 8

    def step(x, a, wu, wd):
        def loss(x, a, wu, wd):
            y, _ = chunk_union_kernel(x, a, a > 0, wu, wd, activation="relu", tile=tile,
                                      max_union=E)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss, (0, 1, 2, 3))(x, a, wu, wd)

    args = [jax.ShapeDtypeStruct(s, t) for s, t in
            (((n, d), BF), ((n, E), jnp.float32), ((E, d, f), BF), ((E, f, d), BF))]
    with lowering_target("cuda"):
        text = je.export(jax.jit(step), platforms=("cuda",),
                         disabled_checks=[je.DisabledSafetyCheck.custom_call(TRITON)])(
            *args).mlir_module()
    assert text.count("mosaic_gpu_v2") == 6 and TRITON not in text
