"""The (tile, expert) pair products (moejax.kernels.chunk_union.pairs) against numpy loops over the
pairs: empty tiles, experts in no union (zero weight gradient), plain and transposed weights,
operands indexed by pair or by tile, several blocks on every axis. Interpret mode on a CPU;
compiled on a GPU or TPU (scripts/gpu_check.sh)."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.chunk_union.pairs import pair_down, pair_up, pair_wgrad, union_pairs
from moejax.kernels.chunk_union.reference import union_members

S, E, U = 4, 6, 3


def _pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    active = rng.random((S, n, E)) < 0.15
    active[1] = False  # an empty tile
    active[:, :, 5] = False  # an expert in no union
    ids, _, sizes = union_members(jnp.asarray(active), U)
    count = jnp.minimum(sizes, U)
    return union_pairs(ids, count, E), np.asarray(ids), np.asarray(count), rng


def _members(ids, count):
    return [(s, j, int(ids[s, j])) for s in range(S) for j in range(int(count[s]))]


@pytest.mark.parametrize("n,K,N", [(5, 7, 9), (300, 260, 140)])
@pytest.mark.parametrize("transpose", [False, True])
def test_pair_up_and_down_equal_loops_over_the_pairs(n, K, N, transpose):
    pairs, ids, count, rng = _pairs(n)
    assert count[1] == 0 and all(e != 5 for _, _, e in _members(ids, count))
    w = rng.normal(size=(E, N, K) if transpose else (E, K, N)).astype(np.float32)
    wm = np.swapaxes(w, 1, 2) if transpose else w  # [E, K, N] as used
    xs = rng.normal(size=(S, n, K)).astype(np.float32)
    h = rng.normal(size=(S * U, n, K)).astype(np.float32)
    up_ref, down_ref = np.zeros((S * U, n, N)), np.zeros((S, n, N))
    for s, j, e in _members(ids, count):
        up_ref[s * U + j] = xs[s] @ wm[e]
        down_ref[s] += h[s * U + j] @ wm[e]
    up = pair_up(jnp.asarray(xs), jnp.asarray(w), pairs, transpose=transpose)
    down = pair_down(jnp.asarray(h), jnp.asarray(w), pairs, transpose=transpose)
    np.testing.assert_allclose(np.asarray(up), up_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(down), down_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("l_by,r_by", [("pair", "tile"), ("tile", "pair")])
@pytest.mark.parametrize("n,K,N", [(5, 7, 9), (300, 140, 260)])
def test_pair_wgrad_sums_each_experts_pairs(l_by, r_by, n, K, N):
    pairs, ids, count, rng = _pairs(n, seed=1)
    lhs = rng.normal(size=(S * U if l_by == "pair" else S, n, K)).astype(np.float32)
    rhs = rng.normal(size=(S * U if r_by == "pair" else S, n, N)).astype(np.float32)
    ref = np.zeros((E, K, N))
    for s, j, e in _members(ids, count):
        li = s * U + j if l_by == "pair" else s
        ri = s * U + j if r_by == "pair" else s
        ref[e] += lhs[li].T @ rhs[ri]
    dw = pair_wgrad(jnp.asarray(lhs), jnp.asarray(rhs), pairs, E, l_by=l_by, r_by=r_by)
    np.testing.assert_allclose(np.asarray(dw), ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(dw[5]), 0)  # in no union


def test_pair_tables_and_bad_operands():
    pairs, ids, count, _ = _pairs(5)
    valid = np.asarray(pairs.valid).reshape(S, U)
    np.testing.assert_array_equal(valid.sum(1), count)
    assert np.all(np.diff(np.asarray(pairs.sorted_expert)[: int(valid.sum())]) >= 0)
    np.testing.assert_array_equal(np.asarray(pairs.pairs_per_expert),
                                  np.bincount(ids[valid.astype(bool)], minlength=E))
    with pytest.raises(ValueError, match="pair_up"):
        pair_up(jnp.zeros((S, 5, 7)), jnp.zeros((E, 8, 9)), pairs)
    with pytest.raises(ValueError, match="l_by"):
        pair_wgrad(jnp.zeros((S, 5, 7)), jnp.zeros((S, 5, 9)), pairs, E, l_by="row",
                   r_by="tile")
