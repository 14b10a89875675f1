"""The grouped matmul's GPU products (:mod:`moejax.kernels.grouped.pallas_gmm`) as Pallas Triton
kernels, on megablox's tile metadata (:func:`moejax.kernels.grouped.layout.group_visits`): the rows
stay where they are, and a row tile two groups share is visited once per group, each visit
loading and storing only its group's rows (masked), so no operand is copied or padded.

* :func:`triton_tiles` ``[M, n_out]`` (forward; dX with ``transpose``): a 1-D grid over
  (visit, output block) in grouped launch order
  (:func:`moejax.kernels.grouped.layout.launch_order`); each program loops over the contraction,
  loading its group's weight block by dynamic offsets, with a float32 accumulator in
  registers. The visit of the rows past the groups stores zeros.
* :func:`triton_tgmm` ``[G, K, N]`` (dW): grid ``(N blocks, K blocks, groups)``, each
  program walking its group's row tiles (an empty group walks none: 0).

Blocks are powers of two (what ``tl.dot`` takes); the blocks' columns past ``K`` or ``N`` are
masked. Pallas Triton is deprecated since jax 0.12: :data:`AVAILABLE` says whether this jax
still ships it (the callers take the Mosaic GPU kernels or XLA where it does not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moejax.kernels.grouped.layout import group_visits, launch_order
from moejax.kernels.tiling import pad_to, pow2

try:  # deprecated since jax 0.12: these kernels run while jax still ships it
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    pltriton = None

__all__ = ["triton_tiles", "triton_tgmm", "AVAILABLE"]

AVAILABLE = pltriton is not None


def _span(start, size, lo, hi):
    """``[size]`` bool: which of the indices ``start + arange(size)`` lie in ``[lo, hi)``."""
    idx = start + jnp.arange(size, dtype=jnp.int32)
    return (idx >= lo) & (idx < hi)


def _both(rows, cols):
    return rows[:, None] & cols[None, :]


def _triton_tiles_kernel(seg_ref, tile_ref, lo_ref, hi_ref, x_ref, w_ref, o_ref, *, tm, tr, to,
                         n_v, n_o, groups, transpose):
    R, n_out = x_ref.shape[1], o_ref.shape[1]
    v, o = launch_order(pl.program_id(0), n_v, n_o)
    s = seg_ref[v]
    row0 = tile_ref[v] * tm
    rows = _span(row0, tm, lo_ref[s], hi_ref[s])  # this visit's group's rows of the tile
    cols = _span(o * to, to, 0, n_out)

    def body(r, acc):
        red = _span(r * tr, tr, 0, R)
        x = pltriton.load(x_ref.at[pl.ds(row0, tm), pl.ds(r * tr, tr)], mask=_both(rows, red),
                          other=0)
        if transpose:
            w = pltriton.load(w_ref.at[s, pl.ds(o * to, to), pl.ds(r * tr, tr)],
                              mask=_both(cols, red), other=0)
            return acc + pltriton.dot(x, w, trans_b=True)
        w = pltriton.load(w_ref.at[s, pl.ds(r * tr, tr), pl.ds(o * to, to)],
                          mask=_both(red, cols), other=0)
        return acc + pltriton.dot(x, w)

    # a group's visit runs the contraction; the tail's (rows past the groups) stores zeros.
    # Integer arithmetic, not jnp.where: Triton's scf.for wants i32 bounds, and a select of
    # two literals lowers to i1 (rejected when the GPU compiles the module)
    steps = jnp.minimum(jnp.maximum(groups - s, 0), 1) * pl.cdiv(R, tr)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((tm, to), jnp.float32))
    pltriton.store(o_ref.at[pl.ds(row0, tm), pl.ds(o * to, to)], acc.astype(o_ref.dtype),
                   mask=_both(rows, cols))


def triton_tiles(x_MR, w, group_sizes_G, tm, tr, to, *, transpose, warps, stages, interpret):
    """``[M, n_out]``: each row of ``x`` times its group's ``w`` (``w^T`` with ``transpose``),
    on megablox-style visits (:func:`group_visits`): nothing is copied or padded, each visit
    loads and stores its group's rows of one row tile (and the blocks' in-range columns)
    under a mask."""
    m = x_MR.shape[0]
    G = group_sizes_G.shape[0]
    n_out = w.shape[1] if transpose else w.shape[2]
    seg_V, tile_V, lo_S, hi_S, V = group_visits(group_sizes_G, m, tm)
    n_o = pl.cdiv(n_out, to)
    Vp, Sp = pow2(V), pow2(G + 2)
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_triton_tiles_kernel, tm=tm, tr=tr, to=to, n_v=V, n_o=n_o, groups=G,
                          transpose=transpose),
        out_shape=jax.ShapeDtypeStruct((m, n_out), x_MR.dtype),
        grid=(V * n_o,),
        in_specs=[full((Vp,)), full((Vp,)), full((Sp,)), full((Sp,)), full(x_MR.shape),
                  full(w.shape)],
        out_specs=full((m, n_out)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )(pad_to(seg_V, 0, Vp), pad_to(tile_V, 0, Vp), pad_to(lo_S, 0, Sp), pad_to(hi_S, 0, Sp),
      x_MR, w)


def _triton_tgmm_kernel(lo_ref, hi_ref, x_ref, dy_ref, o_ref, *, tm, tk, tn):
    n, k, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K, N = x_ref.shape[1], dy_ref.shape[1]
    lo, hi = lo_ref[g], hi_ref[g]
    first = lo // tm
    tiles = ((hi + tm - 1) // tm - first) * jnp.minimum(jnp.maximum(hi - lo, 0), 1)
    k_in, n_in = _span(k * tk, tk, 0, K), _span(n * tn, tn, 0, N)

    def body(i, acc):
        row0 = (first + i) * tm
        rows = _span(row0, tm, lo, hi)
        x = pltriton.load(x_ref.at[pl.ds(row0, tm), pl.ds(k * tk, tk)], mask=_both(rows, k_in),
                          other=0)
        dy = pltriton.load(dy_ref.at[pl.ds(row0, tm), pl.ds(n * tn, tn)],
                           mask=_both(rows, n_in), other=0)
        return acc + pltriton.dot(x, dy, trans_a=True)

    acc = jax.lax.fori_loop(0, tiles, body, jnp.zeros((tk, tn), jnp.float32))
    pltriton.store(o_ref.at[g, pl.ds(k * tk, tk), pl.ds(n * tn, tn)], acc.astype(o_ref.dtype),
                   mask=_both(k_in, n_in))


def triton_tgmm(x_MK, dy_MN, group_sizes_G, tm, tk, tn, *, warps, stages, interpret):
    """``dW [G, K, N]`` over the rows in place: program ``(N block, K block, group)`` walks
    its group's row tiles, masking the neighbours' rows (an empty group walks none: 0). The
    group is the slowest grid axis, so consecutive programs share a group's rows of x."""
    G, K, N = group_sizes_G.shape[0], x_MK.shape[1], dy_MN.shape[1]
    _, _, lo_S, hi_S, _ = group_visits(group_sizes_G, x_MK.shape[0], tm)
    Sp = pow2(G + 2)
    full = lambda shape: pl.BlockSpec(shape, lambda n, k, g: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_triton_tgmm_kernel, tm=tm, tk=tk, tn=tn),
        out_shape=jax.ShapeDtypeStruct((G, K, N), x_MK.dtype),
        grid=(pl.cdiv(N, tn), pl.cdiv(K, tk), G),
        in_specs=[full((Sp,)), full((Sp,)), full(x_MK.shape), full(dy_MN.shape)],
        out_specs=full((G, K, N)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )(pad_to(lo_S, 0, Sp), pad_to(hi_S, 0, Sp), x_MK, dy_MN)
