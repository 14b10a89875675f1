"""Row layouts of grouped (dropless MoE) matmuls, shared by the jnp ``grouped`` dispatch path
and the Pallas grouped-matmul kernels.

* :func:`group_tiles`, block-padded: every group's rows padded to a multiple of a row tile
  ``tm``, so each tile belongs to one group, and ``T = ceil(M / tm) + G`` tiles bound the
  padded extent statically (``sum_g ceil(s_g / tm) <= M / tm + G``). The rows are copied into
  that layout and back.
* :func:`group_visits`, megablox's tile metadata: the rows stay where they are, and a row tile
  that two groups share is visited once per group, each visit masking the other group's
  rows. The visits of the ``G`` groups and of the rows past ``sum(group_sizes)`` (a tail
  segment, whose visits write zeros) number at most ``ceil(M / tm) + G``.

Both are a few fused array ops, with no loop: the group of a row or tile is found by
comparing it with every group boundary at once (:func:`count_le`) rather than by
``jnp.searchsorted``'s default binary search, which lowers to a loop of small sequential
kernels on a GPU or TPU, once per grouped product."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["group_tiles", "group_visits", "count_le", "launch_order", "GROUP_VISITS",
           "RAGGED_DIMS"]

# a grouped layer's three products as ragged dot dimension numbers
# (jax.lax.ragged_dot_general): fwd x [M, K] . w [G, K, N] -> [M, N], rows ragged, w grouped;
# dlhs dy [M, N] . w [G, K, N] -> [M, K], contracting N; drhs x [M, K] . dy [M, N] -> [G, K, N],
# the ragged M contracted group by group
RAGGED_DIMS = {
    "fwd": jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0]),
    "dlhs": jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0]),
    "drhs": jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], []),
}
# visits that run over every output block before the next ones start (grouped launch order):
# their rows of x stay in L2 while the weight blocks stream past
GROUP_VISITS = 8

# Above this many comparisons, count_le sorts instead (a GPU or TPU sort, no loop either)
COMPARE_ALL_MAX = 1 << 24


def count_le(ends_G: jax.Array, rows_M: jax.Array) -> jax.Array:
    """int32 ``[M]``: how many of the ascending group ends ``ends_G`` are ``<=`` each row
    index (or tile, or visit) in ``rows_M`` (``searchsorted(ends, rows, side="right")``), as
    one compare-and-count over ``M x G`` pairs (no loop), or by sorting where that is over
    ``COMPARE_ALL_MAX``."""
    method = "compare_all" if rows_M.size * ends_G.size <= COMPARE_ALL_MAX else "sort"
    return jnp.searchsorted(ends_G, rows_M, side="right", method=method).astype(jnp.int32)


def group_tiles(group_sizes_G: jax.Array, m: int, tm: int):
    """Block-padded layout of ``m`` rows in groups of ``group_sizes_G``: ``(padded_row_M,
    tile_group_T, tile_start_G, tiles_G, T)``; rows past ``sum(group_sizes)`` get the
    out-of-range index ``T * tm`` (dropped on scatter, zero on gather)."""
    G = group_sizes_G.shape[0]
    T = -(-m // tm) + G
    gs = group_sizes_G.astype(jnp.int32)
    tiles_G = (gs + tm - 1) // tm
    tile_end_G = jnp.cumsum(tiles_G)
    tile_start_G = tile_end_G - tiles_G
    row_end_G = jnp.cumsum(gs)
    row_start_G = row_end_G - gs
    rows_M = jnp.arange(m, dtype=jnp.int32)
    group_M = jnp.clip(count_le(row_end_G, rows_M), 0, G - 1)
    padded_M = tile_start_G[group_M] * tm + rows_M - row_start_G[group_M]
    padded_M = jnp.where(rows_M < row_end_G[-1], padded_M, T * tm)
    tile_group_T = jnp.clip(count_le(tile_end_G, jnp.arange(T, dtype=jnp.int32)), 0, G - 1)
    return padded_M, tile_group_T, tile_start_G.astype(jnp.int32), tiles_G.astype(jnp.int32), T


def group_visits(group_sizes_G: jax.Array, m: int, tm: int):
    """Megablox-style visits of ``m`` rows in row tiles of ``tm``: ``(segment_V, tile_V,
    row_lo_S, row_hi_S, V)``. Segments ``0..G-1`` are the groups, ``G`` the rows past
    ``sum(group_sizes)`` and ``G + 1`` an empty segment (``row_lo = row_hi = 0``) that the
    unused visits name. Visit ``v`` covers the rows of tile ``tile_V[v]`` that lie in
    ``[row_lo_S[s], row_hi_S[s])``, ``s = segment_V[v]``; visits are in row order, so one
    segment's visits are consecutive. ``V = ceil(m / tm) + G`` bounds the visits statically
    (the ``k`` non-empty segments of a partition of the rows touch at most ``ceil(m / tm) +
    k - 1`` tiles)."""
    G = group_sizes_G.shape[0]
    V = -(-m // tm) + G
    gs = group_sizes_G.astype(jnp.int32)
    row_end_G = jnp.cumsum(gs)
    row_lo = jnp.concatenate([row_end_G - gs, row_end_G[-1:]])
    row_hi = jnp.concatenate([row_end_G, jnp.full((1,), m, jnp.int32)])
    first = row_lo // tm
    n_visits = jnp.where(row_hi > row_lo, (row_hi + tm - 1) // tm - first, 0)
    visit_end = jnp.cumsum(n_visits)
    v = jnp.arange(V, dtype=jnp.int32)
    segment = count_le(visit_end, v)
    s = jnp.clip(segment, 0, G)
    used = v < visit_end[-1]
    tile = jnp.where(used, first[s] + v - (visit_end[s] - n_visits[s]), 0)
    segment = jnp.where(used, segment, G + 1)
    zero = jnp.zeros((1,), jnp.int32)
    return (segment, tile.astype(jnp.int32), jnp.concatenate([row_lo, zero]),
            jnp.concatenate([row_hi, zero]), V)


def launch_order(pid, n_v: int, n_o: int, group: int = GROUP_VISITS):
    """Program ``pid`` of a 1-D grid of ``n_v x n_o`` -> ``(visit, output block)`` in grouped
    launch order: ``group`` consecutive visits cover every output block before the next
    visits start."""
    per = group * n_o
    first = (pid // per) * group
    size = jnp.minimum(n_v - first, group)
    return first + (pid % per) % size, (pid % per) // size
