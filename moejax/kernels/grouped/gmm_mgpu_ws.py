"""The grouped matmul's Mosaic GPU kernels (:mod:`moejax.kernels.grouped.gmm_mgpu`)
warp-specialized, as jax's Hopper matmul is: three warpgroups a program, one issuing the TMA
copies, two computing with wgmma, each over half of the program's block.

* :func:`mgpu_visits_ws` ``[M, n_out]`` (forward, dX with ``transpose``): a visit's row tile
  and its group's weight blocks of ``2 to`` columns are loaded once; each computing
  warpgroup makes ``to`` of the columns and stores its group's rows of them, ``EPILOGUE_COLS``
  columns at a time (the shared memory the pipeline's stages leave).
* :func:`mgpu_tgmm_ws` ``[G, K, N]`` (dW): the group's row tiles of ``x`` (``2 tk`` columns)
  and ``dy`` are loaded once; each computing warpgroup makes the ``[tk, tn]`` block of ``dW``
  of its half of those columns, zeroing its half's rows outside the group in the first and
  last tiles.

Same contracts as the one-warpgroup kernels: operands in whole blocks, bf16 / f16, a visit of
the rows past the groups (or an empty group) writes zeros. ``interpret=True``: Mosaic GPU's
interpreter (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moejax.kernels.grouped.layout import group_visits, launch_order
from moejax.kernels.mgpu import store_row_range, swizzled, zero_rows_outside

__all__ = ["mgpu_visits_ws", "mgpu_tgmm_ws", "EPILOGUE_COLS"]

# the warp-specialized kernel stores its accumulators this many columns at a time (the
# shared memory the pipeline's stages leave)
EPILOGUE_COLS = 64


def mgpu_visits_ws(x_MR, w, group_sizes_G, tiles, transpose: bool, interpret: bool = False):
    """:func:`~moejax.kernels.grouped.gmm_mgpu.mgpu_visits` warp-specialized: a program is three
    warpgroups, one issuing the TMA copies of its row tile and weight blocks, two computing with
    wgmma, each over half of the program's ``2 to`` output columns (``to``: ``tiles[2]``)."""
    tm, tr, to, stages = tiles
    m, R = x_MR.shape
    G = group_sizes_G.shape[0]
    n_out = w.shape[1] if transpose else w.shape[2]
    seg_V, tile_V, lo_S, hi_S, V = group_visits(group_sizes_G, m, tm)
    n_o = n_out // (2 * to)
    dt = x_MR.dtype
    w_block = (2 * to, tr) if transpose else (tr, 2 * to)

    def body(seg_g, tile_g, lo_g, hi_g, x_g, w_g, o_g, o_smem):
        v, o = launch_order(jax.lax.axis_index("p"), V, n_o)
        wg = jax.lax.axis_index("wg")
        s, t = seg_g[v], tile_g[v]
        row0 = t * tm
        first = jnp.clip(lo_g[s] - row0, 0, tm)
        size = jnp.clip(hi_g[s] - row0, 0, tm) - first
        col = 2 * o + wg  # this warpgroup's output block

        def step(_, x_s, w_s, acc):
            half = (w_s.at[pl.ds(wg * to, to)].T if transpose else
                    w_s.at[:, pl.ds(wg * to, to)])
            plgpu.wgmma(acc, x_s, half)
            plgpu.wgmma_wait(0)
            return acc

        def compute(eval_pipeline):
            def run(acc):
                eval_pipeline(acc)
                store_row_range(acc[...], o_smem.at[wg], o_g, row0, first, size, col, tm, to,
                               dt)
            pl.run_scoped(run, plgpu.ACC((tm, to)))

        w_cols = pl.ds(o * 2 * to, 2 * to)
        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(R // tr,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute,
            in_specs=[plgpu.BlockSpec((tm, tr), lambda r: (0, r),
                                      transforms=swizzled((tm, tr), dt, "x")),
                      plgpu.BlockSpec(w_block, lambda r: (0, r) if transpose else (r, 0),
                                      transforms=swizzled(w_block, dt, "w"))])

        @pl.when((s < G) & (size > 0))
        def _():
            pipeline(x_g.at[pl.ds(row0, tm)],
                     w_g.at[s, w_cols] if transpose else w_g.at[s, :, w_cols])

        @pl.when((s >= G) & (size > 0) & (wg < 2))  # rows past the groups: zeros
        def _():
            store_row_range(jnp.zeros((tm, to), jnp.float32), o_smem.at[wg], o_g, row0, first,
                           size, col, tm, to, dt)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n_out), dt), grid=(V * n_o,), grid_names=("p",),
        num_threads=3, thread_name="wg", kernel_name="moejax_gmm_mgpu_ws",
        scratch_types=[plgpu.SMEM((2, tm, min(to, EPILOGUE_COLS)), dt)],
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    return kernel(seg_V, tile_V, lo_S, hi_S, x_MR, w)


def mgpu_tgmm_ws(x_MK, dy_MN, group_sizes_G, tiles, interpret: bool = False):
    """:func:`~moejax.kernels.grouped.gmm_mgpu.mgpu_tgmm` warp-specialized: a program is three
    warpgroups, one issuing the TMA copies of the group's row tiles of ``x`` (``2 tk`` columns)
    and ``dy``, two computing, each the ``[tk, tn]`` block of ``dW`` for its half of those
    columns (and zeroing its half's rows outside the group in the first and last tiles)."""
    tm, tk, tn, stages = tiles
    m, K = x_MK.shape
    N, G = dy_MN.shape[1], group_sizes_G.shape[0]
    _, _, lo_S, hi_S, _ = group_visits(group_sizes_G, m, tm)
    dt = x_MK.dtype
    chunk = min(tn, EPILOGUE_COLS)

    def body(lo_g, hi_g, x_g, dy_g, o_g, o_smem):
        g, k, c = (jax.lax.axis_index(a) for a in ("g", "k", "c"))
        wg = jax.lax.axis_index("wg")
        lo, hi = lo_g[g], hi_g[g]
        first = jax.lax.div(lo, tm)
        tiles_g = jnp.where(hi > lo, jax.lax.div(hi + tm - 1, tm) - first, 0)
        rows = pl.ds((2 * k + wg) * tk, tk)  # this warpgroup's rows of dW[g]

        def store(acc_f32):
            for j in range(tn // chunk):
                plgpu.wait_smem_to_gmem(0)
                o_smem.at[wg][...] = acc_f32[:, j * chunk:(j + 1) * chunk].astype(dt)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                        o_g.at[g, rows, pl.ds(c * tn + j * chunk, chunk)])
            plgpu.wait_smem_to_gmem(0)

        def step(idx, x_s, dy_s, acc):
            (i,) = idx
            mine = x_s.at[:, pl.ds(wg * tk, tk)]

            @pl.when((i == 0) | (i == tiles_g - 1))
            def _():
                zero_rows_outside(mine, (first + i) * tm, lo, hi)

            plgpu.wgmma(acc, mine.T, dy_s)
            plgpu.wgmma_wait(0)
            return acc

        def compute(eval_pipeline):
            def run(acc):
                eval_pipeline(acc)
                store(acc[...])
            pl.run_scoped(run, plgpu.ACC((tk, tn)))

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(tiles_g,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute,
            in_specs=[plgpu.BlockSpec((tm, 2 * tk), lambda i: (first + i, 0),
                                      transforms=swizzled((tm, 2 * tk), dt, "x")),
                      plgpu.BlockSpec((tm, tn), lambda i: (first + i, 0),
                                      transforms=swizzled((tm, tn), dt, "dy"))])

        @pl.when(tiles_g > 0)
        def _():
            pipeline(x_g.at[:, pl.ds(k * 2 * tk, 2 * tk)], dy_g.at[:, pl.ds(c * tn, tn)])

        @pl.when((tiles_g == 0) & (wg < 2))  # an empty group: zeros
        def _():
            store(jnp.zeros((tk, tn), jnp.float32))

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((G, K, N), dt), grid=(G, K // (2 * tk), N // tn),
        grid_names=("g", "k", "c"), num_threads=3, thread_name="wg",
        kernel_name="moejax_tgmm_mgpu_ws",
        scratch_types=[plgpu.SMEM((2, tk, chunk), dt)],
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    return kernel(lo_S, hi_S, x_MK, dy_MN)
