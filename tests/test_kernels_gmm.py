"""The Pallas grouped-matmul kernels (moejax.kernels.grouped.pallas_gmm), the TPU ones and the
GPU (Triton) ones each in interpret mode on CPU, against jax.lax.ragged_dot and a per-group
dense oracle: values and gradients, empty groups, groups spanning several tiles, row tiles
that groups share, sizes that are not multiples of the tiles; their two row layouts'
invariants over random group sizes; and as the
MoE skeleton's ``dispatch="gmm"`` path against the dense oracle, as is ``dispatch="tokamax"``
(tokamax's reference implementation on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import gmm, group_tiles, tgmm
from moejax.kernels.grouped import layout as grouped_layout
from moejax.kernels.grouped.layout import group_visits
from moejax.kernels.grouped.ragged import AVAILABLE as RAGGED_DOT_AVAILABLE
from moejax.kernels.moe_ffn.api import dispatch
from moejax.nn.router import top_k_gates

CASES = [  # (group sizes, M, tm, tn): empty / multi-tile / unaligned groups, rows past the sum
    ([3, 0, 9, 4], 16, 4, 4),
    ([0, 0, 7, 0], 7, 4, 8),
    ([5, 5], 12, 8, 3),  # two rows past sum(group_sizes): zero output
    ([1, 2, 3, 4, 5], 15, 2, 5),
]


def oracle(x, w, gs):
    """Per group: its rows times its weight; rows past the sum stay 0."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, s in enumerate(gs):
        y[start:start + s] = x[start:start + s] @ w[g]
        start += s
    return y


def data(gs, m, k=5, n=6, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(m, k)), jnp.float32),
            jnp.asarray(rng.normal(size=(len(gs), k, n)), jnp.float32),
            jnp.asarray(gs, jnp.int32))


# the platform's kernel on this CPU (the TPU kernels interpreted) and the GPU's Triton kernels
# interpreted, with the test's tiles (a 2-column contraction step: several per product)
MODES = [None, "triton"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gs,m,tm,tn", CASES)
def test_gmm_matches_oracle_and_ragged_dot(gs, m, tm, tn, mode):
    x, w, g = data(gs, m)
    y = gmm(x, w, g, tm=tm, tk=2, tn=tn, interpret=mode)
    np.testing.assert_allclose(np.asarray(y), oracle(x, w, gs), rtol=1e-5, atol=1e-5)
    if sum(gs) == m:  # ragged_dot's output past the sum is unspecified
        np.testing.assert_allclose(np.asarray(y), np.asarray(jax.lax.ragged_dot(x, w, g)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gs,m,tm,tn", CASES)
def test_gmm_gradients_match_ragged_dot(gs, m, tm, tn, mode):
    x, w, g = data(gs, m, seed=1)
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(m, w.shape[2])), jnp.float32)
    valid = (jnp.arange(m) < sum(gs))[:, None]

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.where(valid, fn(x, w, g), 0.0) * ct)

    dx, dw = jax.grad(loss(lambda x, w, g: gmm(x, w, g, tm=tm, tk=2, tn=tn, interpret=mode)),
                      (0, 1))(x, w)
    rx, rw = jax.jit(jax.grad(loss(jax.lax.ragged_dot), (0, 1)))(x, w)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(rx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(rw), rtol=1e-5, atol=1e-5)
    for e, s in enumerate(gs):
        if s == 0:
            assert not np.any(np.asarray(dw[e]))  # an empty group gets exactly zero gradient
    # tgmm directly: dW[g] = x_g^T ct_g
    want = np.stack([np.asarray(x[sum(gs[:e]):sum(gs[:e + 1])]).T
                     @ np.asarray(ct[sum(gs[:e]):sum(gs[:e + 1])]) for e in range(len(gs))])
    np.testing.assert_allclose(np.asarray(tgmm(x, ct, g, tm=tm, tn=tn, interpret=mode)), want,
                               rtol=1e-5, atol=1e-5)


def test_group_tiles_layout_and_bf16():
    padded, tile_group, start, tiles, T = group_tiles(jnp.asarray([3, 0, 9, 4]), 16, 4)
    assert T == 4 + 4
    assert np.asarray(tiles).tolist() == [1, 0, 3, 1]
    assert np.asarray(start).tolist() == [0, 1, 1, 4]
    assert np.asarray(tile_group)[:5].tolist() == [0, 2, 2, 2, 3]
    # group 2's rows 3..11 fill tiles 1-3 (rows 4..12 of the padded layout), group 3 tile 4
    assert np.asarray(padded).tolist() == [0, 1, 2] + list(range(4, 13)) + list(range(16, 20))
    x, w, g = data([3, 0, 9, 4], 16)
    yb = gmm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), g, tm=4, tn=4)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yb, np.float32), oracle(x, w, [3, 0, 9, 4]),
                               rtol=5e-2, atol=5e-2)
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(x, w, g[:3])
    with pytest.raises(ValueError, match="interpret="):
        gmm(x, w, g, interpret="mosaic")


@pytest.mark.parametrize("compare_all", [True, False])
def test_count_le_is_searchsorted_right(compare_all, monkeypatch):
    """Against numpy over random ascending bounds with repeats (empty groups) and queries on,
    between and outside them; both methods (compare-all and, past its size, sort)."""
    monkeypatch.setattr(grouped_layout, "COMPARE_ALL_MAX", 1 << 24 if compare_all else 0)
    rng = np.random.default_rng(1)
    for _ in range(20):
        bounds = np.cumsum(rng.integers(0, 4, rng.integers(1, 12))).astype(np.int32)
        queries = rng.integers(-2, int(bounds[-1]) + 3, rng.integers(1, 40)).astype(np.int32)
        got = grouped_layout.count_le(jnp.asarray(bounds), jnp.asarray(queries))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got),
                                      np.searchsorted(bounds, queries, side="right"))


def test_group_visits_cover_every_row_once_within_the_static_bound():
    """Over random group sizes (empty groups, rows past the sum, groups inside one tile and
    across many): the used visits are consecutive, in row order, at most ``V``, and their
    masks cover every row exactly once, with its own group's segment (``G``: past the sum)."""
    rng = np.random.default_rng(0)
    # (G, tm, m): a few static shapes, each compiled once, with random sizes drawn into them
    shapes = [(1, 1, 5), (2, 8, 9), (3, 4, 20), (6, 8, 40), (6, 3, 70)]
    visits = jax.jit(group_visits, static_argnums=(1, 2))
    for _ in range(100):
        G, tm, m = shapes[rng.integers(len(shapes))]
        gs = rng.integers(0, 12, G) * (rng.random(G) < 0.7)
        while gs.sum() > m:  # a random group loses rows until the sizes fit
            gs[rng.integers(G)] //= 2
        seg, tile, lo, hi, V = map(np.asarray, visits(jnp.asarray(gs), m, tm))
        assert seg.shape == tile.shape == (V,) and V == -(-m // tm) + G
        used = seg <= G
        assert not np.any(used[np.argmax(~used):]) or used.all()  # used visits first
        owner = np.full(m, -1)
        for s, t in zip(seg[used], tile[used]):
            rows = np.arange(t * tm, min((t + 1) * tm, m))
            mine = rows[(rows >= lo[s]) & (rows < hi[s])]
            assert mine.size and np.all(owner[mine] == -1)
            owner[mine] = s
        want = np.repeat(np.arange(G + 1), [*gs, m - gs.sum()])
        np.testing.assert_array_equal(owner, want)
        assert np.all(np.diff(seg[used]) >= 0)
        assert lo[G + 1] == hi[G + 1] == 0  # the unused visits' empty segment


@pytest.mark.parametrize("method", [
    "gmm", pytest.param("tokamax", marks=pytest.mark.skipif(
        not RAGGED_DOT_AVAILABLE, reason="tokamax is not installed"))])
def test_grouped_matmul_dispatch_equals_dense_oracle_with_gradients(method):
    n, d, f, e, k = 10, 8, 12, 4, 2
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (n, d))
    w_g = jax.random.normal(ks[1], (d, e))
    w_up = jax.random.normal(ks[2], (e, d, f)) / np.sqrt(d)
    w_gate = jax.random.normal(ks[3], (e, d, f)) / np.sqrt(d)
    w_down = jax.random.normal(ks[4], (e, f, d)) / np.sqrt(f)
    ct = jax.random.normal(ks[5], (n, d))

    def loss(method):
        def fn(x, w_up, w_gate, w_down):
            r = top_k_gates(x @ w_g, k, renormalize=True)
            out = dispatch(method, x, r.ids_NK, r.weights_NK, w_up, w_down, w_gate,
                           activation="swiglu")
            return jnp.sum(out.y_ND * ct)
        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))

    (l_d, g_d), (l_g, g_g) = (jax.jit(loss("dense"))(x, w_up, w_gate, w_down),
                              loss(method)(x, w_up, w_gate, w_down))
    np.testing.assert_allclose(float(l_g), float(l_d), rtol=1e-5)
    for a, b in zip(g_g, g_d):
        assert float(jnp.max(jnp.abs(b))) > 1e-3
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas lowering needs a GPU")
def test_gmm_compiled_on_gpu_matches_ragged_dot():
    x, w, g = data([300, 0, 1000, 748], 2048, k=256, n=512)
    y = jax.jit(lambda x, w, g: gmm(x, w, g, interpret=False))(x, w, g)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.lax.ragged_dot(x, w, g)),
                               rtol=2e-2, atol=2e-2)
