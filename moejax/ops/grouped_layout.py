"""The block-padded grouped layout of dropless MoE (megablox-style): every group's rows padded
to a multiple of a row tile ``tm``, so each tile belongs to one group, and ``T = ceil(M / tm) +
G`` tiles bound the padded extent statically (``sum_g ceil(s_g / tm) <= M / tm + G``). Shared
by the jnp ``grouped`` dispatch path and the Pallas grouped-matmul kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["group_tiles"]


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
    group_M = jnp.clip(jnp.searchsorted(row_end_G, rows_M, side="right"), 0, G - 1)
    padded_M = tile_start_G[group_M] * tm + rows_M - row_start_G[group_M]
    padded_M = jnp.where(rows_M < row_end_G[-1], padded_M, T * tm)
    tile_group_T = jnp.clip(jnp.searchsorted(tile_end_G, jnp.arange(T, dtype=jnp.int32),
                                             side="right"), 0, G - 1).astype(jnp.int32)
    return padded_M, tile_group_T, tile_start_G.astype(jnp.int32), tiles_G.astype(jnp.int32), T
