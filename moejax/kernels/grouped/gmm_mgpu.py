"""The grouped matmul's three products (:mod:`moejax.kernels.grouped.pallas_gmm`) as Pallas
Mosaic GPU kernels for Hopper: TMA copies into swizzled shared memory, wgmma into float32
accumulators, one warpgroup per program, bf16 / f16 operands
(:mod:`moejax.kernels.mgpu`). They run on megablox's tile metadata
(:func:`moejax.ops.grouped_layout.group_visits`): the rows stay where they are and no operand
is copied into a padded layout.

* :func:`mgpu_visits` ``[M, n_out]`` (forward ``x w_g``; dX ``dy w_g^T`` with ``transpose``,
  the weight read as stored and given to wgmma as a transposed view): a 1-D grid over
  (visit, output block) in grouped launch order
  (:func:`moejax.ops.grouped_layout.launch_order`). A visit pipelines its row tile and its
  group's weight blocks over the contraction; the visit of the rows past the groups skips
  the product and writes zeros. A row tile two groups share is visited once per group, so
  each visit stores only its group's rows: TMA copies of the accumulator's rows in a ladder
  of power-of-two lengths (a visit of ``r`` rows stores one copy per set bit of ``r``), since
  a TMA copy's shape is static.
* :func:`mgpu_tgmm` ``[G, K, N]`` (dW ``x_g^T dy_g``): grid (group, K block, N block); a
  program pipelines over its group's row tiles, giving wgmma the ``x`` block as a transposed
  view. The first and last tiles can hold neighbouring groups' rows: their ``x`` rows are
  zeroed in shared memory before the product. An empty group writes zeros.

Operands arrive whole multiples of the blocks (:func:`padded`, zero padding, exact: padded
rows lie past the groups, padded contraction adds zeros, padded columns are cut off).
``tiles`` is ``(rows, contraction, output columns, stages)`` from
:func:`moejax.kernels.tuning.config_for` (``"gmm_mgpu"``, ``"tgmm_mgpu"``).
``interpret=True`` runs them in Mosaic GPU's interpreter on the CPU (for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moejax.kernels.mgpu import block_spec, mgpu_kernel, mma, store_block, takes_dtype, weight_spec
from moejax.kernels.tiling import pad_to
from moejax.kernels.tuning import config_for
from moejax.ops.grouped_layout import group_visits, launch_order

__all__ = ["gmm_mgpu", "gmm_t_mgpu", "tgmm_mgpu", "mgpu_visits", "mgpu_tgmm", "fit_block",
           "visits_store_ladder"]

# wgmma's M: row blocks and the weight gradient's K blocks are multiples of it
WGMMA_M = 64


def visits_store_ladder(tm: int) -> tuple[int, ...]:
    """The TMA copy lengths a visit's store may use: the powers of two up to ``tm``,
    longest first (a visit of ``r <= tm`` rows uses those of ``r``'s set bits)."""
    return tuple(1 << b for b in reversed(range(tm.bit_length())) if 1 << b <= tm)


def _store_rows(acc_f32, o_g, row0, first, size, col, tm: int, to: int, dtype):
    """Rows ``[first, first + size)`` of the ``[tm, to]`` accumulator (``0 <= size <= tm``)
    to ``o_g`` at row ``row0 + first``, column block ``col``: through shared memory, one TMA
    copy per set bit of ``size``."""
    def write(o_smem):
        o_smem[...] = acc_f32.astype(dtype)
        plgpu.commit_smem()
        start = first
        for length in visits_store_ladder(tm):
            @pl.when((size & length) != 0)
            def _(start=start, length=length):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(start, length)],
                    o_g.at[pl.ds(row0 + start, length), pl.ds(col * to, to)])
            start = start + (size & length)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((tm, to), dtype))


def mgpu_visits(x_MR, w, group_sizes_G, tiles, transpose: bool, interpret: bool = False):
    """``[M, n_out]``: each row of ``x`` times its group's ``w[g]`` (``[G, R, n_out]``; with
    ``transpose`` ``w`` is ``[G, n_out, R]`` and the product takes ``w[g]^T``); rows past the
    groups give 0. ``M``, ``R`` and ``n_out`` are whole multiples of the tiles."""
    tm, tr, to, stages = tiles
    m, R = x_MR.shape
    G = group_sizes_G.shape[0]
    n_out = w.shape[1] if transpose else w.shape[2]
    seg_V, tile_V, lo_S, hi_S, V = group_visits(group_sizes_G, m, tm)
    n_o = n_out // to
    dt = x_MR.dtype

    def body(seg_g, tile_g, lo_g, hi_g, x_g, w_g, o_g):
        v, o = launch_order(jax.lax.axis_index("p"), V, n_o)
        s, t = seg_g[v], tile_g[v]
        row0 = t * tm
        first = jnp.clip(lo_g[s] - row0, 0, tm)
        size = jnp.clip(hi_g[s] - row0, 0, tm) - first

        def product(acc):
            @pl.when((s < G) & (size > 0))
            def _():
                plgpu.emit_pipeline(
                    lambda _, x_s, w_s: mma(acc, x_s, w_s, transpose), grid=(R // tr,),
                    in_specs=(block_spec((tm, tr), lambda r: (t, r), dt, "x"),
                              weight_spec(tr, to, transpose, dt, lambda r: s, o)),
                    max_concurrent_steps=stages)(x_g, w_g)
            return acc[...]

        acc = pl.run_scoped(product, plgpu.ACC((tm, to)))
        _store_rows(acc, o_g, row0, first, size, o, tm, to, dt)

    return mgpu_kernel(body, ((m, n_out), dt), (V * n_o,), ("p",), interpret)(
        seg_V, tile_V, lo_S, hi_S, x_MR, w)


def _zero_rows_outside(x_s, row0, lo, hi, tm: int):
    """Zero the rows of the ``[tm, tk]`` shared-memory block (rows ``row0 ..``) outside
    ``[lo, hi)``."""
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, x_s.shape, 0)
    keep = (rows >= lo) & (rows < hi)
    x_s[...] = jnp.where(keep, x_s[...], jnp.zeros(x_s.shape, x_s.dtype))
    plgpu.commit_smem()


def mgpu_tgmm(x_MK, dy_MN, group_sizes_G, tiles, interpret: bool = False):
    """``dW [G, K, N]``, ``dW[g] = x_g^T dy_g`` over each group's rows (0 for an empty
    group). ``M``, ``K`` and ``N`` are whole multiples of the tiles (rows, ``K``, ``N``)."""
    tm, tk, tn, stages = tiles
    m, K = x_MK.shape
    N, G = dy_MN.shape[1], group_sizes_G.shape[0]
    _, _, lo_S, hi_S, _ = group_visits(group_sizes_G, m, tm)
    dt = x_MK.dtype

    def body(lo_g, hi_g, x_g, dy_g, o_g):
        g, k, c = (jax.lax.axis_index(a) for a in ("g", "k", "c"))
        lo, hi = lo_g[g], hi_g[g]
        first = jax.lax.div(lo, tm)
        tiles_g = jnp.where(hi > lo, jax.lax.div(hi + tm - 1, tm) - first, 0)

        def product(acc):
            def step(idx, x_s, dy_s):
                (i,) = idx

                @pl.when((i == 0) | (i == tiles_g - 1))
                def _():
                    _zero_rows_outside(x_s, (first + i) * tm, lo, hi, tm)

                plgpu.wgmma(acc, x_s.T, dy_s)
                plgpu.wgmma_wait(1)

            @pl.when(tiles_g > 0)
            def _():
                plgpu.emit_pipeline(
                    step, grid=(tiles_g,),
                    in_specs=(block_spec((tm, tk), lambda i: (first + i, k), dt, "x"),
                              block_spec((tm, tn), lambda i: (first + i, c), dt, "dy")),
                    max_concurrent_steps=stages)(x_g, dy_g)
            return acc[...]

        acc = pl.run_scoped(product, plgpu.ACC((tk, tn)))
        store_block(acc, o_g, (g, pl.ds(k * tk, tk), pl.ds(c * tn, tn)), dt)

    return mgpu_kernel(body, ((G, K, N), dt), (G, K // tk, N // tn), ("g", "k", "c"),
                       interpret)(lo_S, hi_S, x_MK, dy_MN)


# -- padding, tiles and the three products ------------------------------------------------------
def fit_block(dim: int, pref: int, least: int = WGMMA_M) -> int:
    """The block for an axis of ``dim``: the largest of ``pref, pref / 2, ..., least`` that
    divides ``dim`` (no padding), else ``pref`` (the axis is zero-padded to it)."""
    b = pref
    while b >= least:
        if dim % b == 0:
            return b
        b //= 2
    return pref


def _tiles(kernel: str, dtype, k: int, n: int, interpret: bool, tiles):
    """``(rows, contraction, columns, stages)``: the caller's ``tiles`` in interpret mode
    when given, else the tuned or default configuration for the device being lowered for,
    its contraction and column blocks fitted to ``k`` and ``n`` (:func:`fit_block`)."""
    if interpret and tiles is not None:
        return tuple(tiles)
    c = config_for(kernel, dtype, k, n)
    return c.tm, fit_block(k, c.tk), fit_block(n, c.tn), c.num_stages


def _check(a, b):
    if not (takes_dtype(a.dtype) and a.dtype == b.dtype):
        raise NotImplementedError(f"the Mosaic GPU grouped matmul takes bfloat16 or float16 "
                                  f"operands of one dtype, not {a.dtype} and {b.dtype} (float32: "
                                  "the Triton kernel, moejax.kernels.grouped.pallas_gmm)")


def _visits_call(a_MR, w, group_sizes_G, transpose: bool, interpret: bool, tiles):
    """:func:`mgpu_visits` on operands zero-padded to its blocks, the result cut back."""
    _check(a_MR, w)
    m, R = a_MR.shape
    n_out = w.shape[1] if transpose else w.shape[2]
    tm, tr, to, st = _tiles("gmm_mgpu", a_MR.dtype, R, n_out, interpret, tiles)
    a = pad_to(pad_to(a_MR, 0, tm), 1, tr)
    w = pad_to(pad_to(w, 2 if transpose else 1, tr), 1 if transpose else 2, to)
    return mgpu_visits(a, w, group_sizes_G, (tm, tr, to, st), transpose, interpret)[:m, :n_out]


def gmm_mgpu(x_MK, w_GKN, group_sizes_G, *, interpret: bool = False, tiles=None):
    """``[M, K] x [G, K, N] -> [M, N]``, :func:`jax.lax.ragged_dot`'s meaning (rows past the
    groups give 0), by :func:`mgpu_visits`; operands zero-padded to its blocks and the result
    cut back. bf16 / f16 only (``NotImplementedError`` otherwise). ``tiles``: interpret
    mode's ``(rows, contraction, columns, stages)``."""
    return _visits_call(x_MK, w_GKN, group_sizes_G, False, interpret, tiles)


def gmm_t_mgpu(dy_MN, w_GKN, group_sizes_G, *, interpret: bool = False, tiles=None):
    """``[M, N] x [G, K, N]^T -> [M, K]`` (the input gradient of :func:`gmm_mgpu`), the
    weights read as stored."""
    return _visits_call(dy_MN, w_GKN, group_sizes_G, True, interpret, tiles)


def tgmm_mgpu(x_MK, dy_MN, group_sizes_G, *, interpret: bool = False, tiles=None):
    """``dW [G, K, N]``, ``dW[g] = x_g^T dy_g`` (the weight gradient of :func:`gmm_mgpu`; 0 for
    an empty group)."""
    _check(x_MK, dy_MN)
    K, N = x_MK.shape[1], dy_MN.shape[1]
    tm, tk, tn, st = _tiles("tgmm_mgpu", x_MK.dtype, K, N, interpret, tiles)
    x = pad_to(pad_to(x_MK, 0, tm), 1, tk)
    dy = pad_to(pad_to(dy_MN, 0, tm), 1, tn)
    return mgpu_tgmm(x, dy, group_sizes_G, (tm, tk, tn, st), interpret)[:, :K, :N]
