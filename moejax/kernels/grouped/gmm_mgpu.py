"""The grouped matmul's three products (:mod:`moejax.kernels.grouped.pallas_gmm`) as Pallas
Mosaic GPU kernels for Hopper: TMA copies into swizzled shared memory, wgmma into float32
accumulators, bf16 / f16 operands (:mod:`moejax.kernels.mgpu`). They run on megablox's tile
metadata (:func:`moejax.kernels.grouped.layout.group_visits`): the rows stay where they are and no
operand is copied into a padded layout. One warpgroup a program here; warp-specialized (one
loading, two computing, as jax's Hopper matmul is) in :mod:`moejax.kernels.grouped.gmm_mgpu_ws`
(``num_warps`` 12 in the configuration, the default: :data:`WARPS`).

* :func:`mgpu_visits` ``[M, n_out]`` (forward ``x w_g``; dX ``dy w_g^T`` with ``transpose``,
  the weight read as stored and given to wgmma as a transposed view): a 1-D grid over
  (visit, output block) in grouped launch order
  (:func:`moejax.kernels.grouped.layout.launch_order`). A visit pipelines its row tile and its
  group's weight blocks over the contraction; the visit of the rows past the groups skips
  the product and writes zeros. A row tile two groups share is visited once per group, so
  each visit stores only its group's rows: TMA copies of the accumulator's rows in a ladder
  of power-of-two lengths (:func:`moejax.kernels.mgpu.store_row_range`), since a TMA copy's
  shape is static.
* :func:`mgpu_tgmm` ``[G, K, N]`` (dW ``x_g^T dy_g``): grid (group, K block, N block); a
  program pipelines over its group's row tiles, giving wgmma the ``x`` block as a transposed
  view. The first and last tiles can hold neighbouring groups' rows: their ``x`` rows are
  zeroed in shared memory before the product. An empty group writes zeros.

The kernels take operands in whole blocks; :func:`gmm_mgpu`, :func:`gmm_t_mgpu` and
:func:`tgmm_mgpu` choose blocks that divide the shape where they can (:func:`fit_block`) and
zero-pad otherwise (exact: padded rows lie past the groups, padded contraction adds zeros,
padded columns are cut off). The launch (rows, contraction and output-column blocks, warps,
stages) is :func:`moejax.kernels.tuning.config_for`'s (``"gmm_mgpu"``, ``"tgmm_mgpu"``).
``interpret=True`` runs them in Mosaic GPU's interpreter on the CPU (for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moejax.kernels.grouped.gmm_mgpu_ws import mgpu_tgmm_ws, mgpu_visits_ws
from moejax.kernels.grouped.layout import group_visits, launch_order
from moejax.kernels.mgpu import (
    block_spec,
    mgpu_kernel,
    mma,
    store_block,
    store_row_range,
    takes_dtype,
    weight_spec,
    zero_rows_outside,
)
from moejax.kernels.tiling import hopper_target, pad_to
from moejax.kernels.tuning import TritonConfig, config_for

__all__ = ["gmm_mgpu", "gmm_t_mgpu", "tgmm_mgpu", "mgpu_visits", "mgpu_tgmm", "fit_block",
           "WARPS", "PASSES"]

# a configuration's num_warps -> the kernel: one warpgroup (mgpu_visits, mgpu_tgmm) or three,
# one loading and two computing (mgpu_visits_ws, mgpu_tgmm_ws)
WARPS = {4: "one", 12: "specialized"}
# wgmma's M: row blocks and the weight gradient's K blocks are multiples of it
WGMMA_M = 64


def _store_rows(acc_f32, o_g, row0, first, size, col, tm: int, to: int, dtype):
    """:func:`moejax.kernels.mgpu.store_row_range` through a scoped shared-memory block."""
    pl.run_scoped(lambda o_smem: store_row_range(acc_f32, o_smem, o_g, row0, first, size, col,
                                                tm, to, dtype),
                  plgpu.SMEM((tm, to), dtype))


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

    return mgpu_kernel(body, ((m, n_out), dt), (V * n_o,), ("p",), interpret,
                       "moejax_gmm_mgpu")(
        seg_V, tile_V, lo_S, hi_S, x_MR, w)


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
                    zero_rows_outside(x_s, (first + i) * tm, lo, hi)

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
                       interpret, "moejax_tgmm_mgpu")(lo_S, hi_S, x_MK, dy_MN)


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


def _config(kernel: str, dtype, k: int, n: int, interpret: bool, tiles) -> TritonConfig:
    """The launch: interpret mode's ``tiles`` as given, else the tuned or default configuration
    for the device being lowered for (:func:`moejax.kernels.tuning.config_for`), its
    contraction and column blocks fitted to ``k`` and ``n`` (:func:`fit_block`; a
    warp-specialized program takes ``2 tn`` output columns, or ``2 tk`` rows of dW)."""
    c = TritonConfig(*tiles) if interpret and tiles is not None else config_for(
        kernel, dtype, k, n)
    if c.num_warps not in WARPS:
        raise ValueError(f"{kernel}: num_warps={c.num_warps}; one of {tuple(WARPS)} "
                         "(one warpgroup, or one loading and two computing)")
    if interpret and tiles is not None:
        return c
    pair = 2 if WARPS[c.num_warps] == "specialized" else 1
    if kernel == "tgmm_mgpu":  # dW's K rows split between the computing warpgroups
        return c._replace(tk=fit_block(k, pair * c.tk, least=pair * WGMMA_M) // pair,
                          tn=fit_block(n, c.tn))
    return c._replace(tk=fit_block(k, c.tk),
                      tn=fit_block(n, pair * c.tn, least=pair * WGMMA_M) // pair)


def _check(a, b, interpret: bool):
    """``NotImplementedError`` (what tokamax raises for a call its kernel does not take, so
    :func:`moejax.kernels.grouped.ragged.ragged_pass` falls back to the Triton kernel) unless
    the operands are bf16 / f16 of one dtype and the program is built for a Hopper GPU."""
    if not (takes_dtype(a.dtype) and a.dtype == b.dtype):
        raise NotImplementedError(f"the Mosaic GPU grouped matmul takes bfloat16 or float16 "
                                  f"operands of one dtype, not {a.dtype} and {b.dtype} (float32: "
                                  "the Triton kernel, moejax.kernels.grouped.pallas_gmm)")
    if not (interpret or hopper_target()):
        raise NotImplementedError("the Mosaic GPU grouped matmul needs a Hopper GPU (wgmma); "
                                  "elsewhere the Triton kernel, moejax.kernels.grouped.pallas_gmm")


def _visits_call(a_MR, w, group_sizes_G, transpose: bool, interpret: bool, tiles):
    """:func:`mgpu_visits` (or :func:`mgpu_visits_ws`, as the configuration's warps say) on
    operands zero-padded to its blocks, the result cut back."""
    _check(a_MR, w, interpret)
    m, R = a_MR.shape
    n_out = w.shape[1] if transpose else w.shape[2]
    c = _config("gmm_mgpu", a_MR.dtype, R, n_out, interpret, tiles)
    ws = WARPS[c.num_warps] == "specialized"
    cols = c.tn * (2 if ws else 1)
    a = pad_to(pad_to(a_MR, 0, c.tm), 1, c.tk)
    w = pad_to(pad_to(w, 2 if transpose else 1, c.tk), 1 if transpose else 2, cols)
    kernel = mgpu_visits_ws if ws else mgpu_visits
    return kernel(a, w, group_sizes_G, (c.tm, c.tk, c.tn, c.num_stages), transpose,
                  interpret)[:m, :n_out]


def gmm_mgpu(x_MK, w_GKN, group_sizes_G, *, interpret: bool = False, tiles=None):
    """``[M, K] x [G, K, N] -> [M, N]``, :func:`jax.lax.ragged_dot`'s meaning (rows past the
    groups give 0), by :func:`mgpu_visits`; operands zero-padded to its blocks and the result
    cut back. bf16 / f16 only (``NotImplementedError`` otherwise). ``tiles``: interpret
    mode's launch, a :class:`~moejax.kernels.tuning.TritonConfig` (its ``num_warps``:
    :data:`WARPS`)."""
    return _visits_call(x_MK, w_GKN, group_sizes_G, False, interpret, tiles)


def gmm_t_mgpu(dy_MN, w_GKN, group_sizes_G, *, interpret: bool = False, tiles=None):
    """``[M, N] x [G, K, N]^T -> [M, K]`` (the input gradient of :func:`gmm_mgpu`), the
    weights read as stored."""
    return _visits_call(dy_MN, w_GKN, group_sizes_G, True, interpret, tiles)


def tgmm_mgpu(x_MK, dy_MN, group_sizes_G, *, interpret: bool = False, tiles=None):
    """``dW [G, K, N]``, ``dW[g] = x_g^T dy_g`` (the weight gradient of :func:`gmm_mgpu`; 0 for
    an empty group), by :func:`mgpu_tgmm` or :func:`mgpu_tgmm_ws` as the configuration's
    warps say."""
    _check(x_MK, dy_MN, interpret)
    K, N = x_MK.shape[1], dy_MN.shape[1]
    c = _config("tgmm_mgpu", x_MK.dtype, K, N, interpret, tiles)
    ws = WARPS[c.num_warps] == "specialized"
    x = pad_to(pad_to(x_MK, 0, c.tm), 1, c.tk * (2 if ws else 1))
    dy = pad_to(pad_to(dy_MN, 0, c.tm), 1, c.tn)
    kernel = mgpu_tgmm_ws if ws else mgpu_tgmm
    return kernel(x, dy, group_sizes_G, (c.tm, c.tk, c.tn, c.num_stages), interpret)[:, :K, :N]


# the grouped layer's three products (moejax.kernels.grouped.layout.RAGGED_DIMS) on these kernels
PASSES = {"fwd": gmm_mgpu, "dlhs": gmm_t_mgpu, "drhs": tgmm_mgpu}
