"""Grouped matmul for dropless top-k MoE training, as Pallas kernels with a ``custom_vjp``.

``y = gmm(x_MK, w_GKN, group_sizes_G)`` has :func:`jax.lax.ragged_dot`'s meaning: the rows of
``x`` are sorted by group, the first ``group_sizes[0]`` rows use ``w[0]``, the next
``group_sizes[1]`` rows ``w[1]``, ...; rows past ``sum(group_sizes)`` give 0.

Rows are laid out block-padded (megablox-style, :func:`moejax.ops.grouped_layout.group_tiles`):
every group's rows padded to a multiple of the row tile ``tm``, so each of the ``T = ceil(M /
tm) + G`` row tiles belongs to one group. Three products, each tiled over rows, columns *and*
the contraction, so a program holds three small tiles whatever ``K`` and ``N`` are:

* forward ``y_t = x_t w[g_t]`` and ``dX_t = dy_t w[g_t]^T`` (the transpose is taken in the
  kernel: no transposed weight stack is materialised);
* ``dW[g] = sum over g's tiles of x_t^T dy_t`` (:func:`tgmm`; an empty group gets 0).

The kernel is chosen when the function is lowered, per platform
(:func:`jax.lax.platform_dependent`), so one jitted program lowers to the right kernel on each:

* TPU: Mosaic. Grid ``(tiles, output blocks, contraction blocks)``; the tiles' groups are
  scalar-prefetched so each program DMAs only its group's ``[tk, tn]`` weight block, and an
  f32 accumulator lives in VMEM scratch across the contraction axis. Tiles past the used ones
  skip their matmul. ``dW`` walks the tiles in order and accumulates while the group stays
  the same (the output block stays resident), writing when it changes.
* GPU: Triton. Grid ``(tiles, output blocks)`` (``dW``: ``(groups, K blocks, N blocks)``); each
  program loops over the contraction in ``tk`` steps, loading its group's weight block by
  dynamic offsets, with an f32 accumulator in registers. Block sizes are powers of two (what
  ``tl.dot`` takes); ``K`` and ``N`` are padded to them. Tiles, warps and stages come from
  :func:`moejax.kernels.tuning.config_for` (the tuned table for the device being lowered
  for, per dtype and shape bucket, else the anchors' H100 defaults).
* CPU: the TPU kernels in Pallas interpret mode (correct and slow: for tests; the CPU's fast
  MoE path is the host kernel of :mod:`moejax.kernels.host`).

``interpret=True`` forces interpret mode on every platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from moejax.kernels.tiling import block, choose_platform, pad_to, pow2
from moejax.kernels.tuning import config_for
from moejax.ops.grouped_layout import group_tiles

__all__ = ["gmm", "gmm_t", "tgmm", "group_tiles", "GMM_TILES"]

# Default tiles (rows, contraction, columns) of the TPU kernels: the MXU works on
# 128-multiples (the GPU's come from moejax.kernels.tuning)
GMM_TILES = {"tpu": (128, 128, 128)}


def _scatter_rows(x_MK, padded_M, T, tm):
    return jnp.zeros((T * tm, x_MK.shape[1]), x_MK.dtype).at[padded_M].set(x_MK, mode="drop")


# -- TPU (Mosaic) and interpret mode -------------------------------------------------------------
def _mosaic_tiles_kernel(group_ref, active_ref, x_ref, w_ref, o_ref, acc_ref, *, transpose):
    t, r = pl.program_id(0), pl.program_id(2)

    @pl.when(r == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(t < active_ref[0])
    def _():
        w = w_ref[0]
        dims = (((1,), (1,)), ((), ())) if transpose else (((1,), (0,)), ((), ()))
        acc_ref[...] += jax.lax.dot_general(x_ref[...], w, dims,
                                            preferred_element_type=jnp.float32)

    @pl.when(r == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _mosaic_tiles(xp, w, tile_group_T, n_active, tm, tr, to, *, transpose, interpret):
    """``[T tm, n_out]``: row tile ``t`` of ``xp`` times ``w[g_t]`` (``w^T`` with ``transpose``),
    contraction blocks of ``tr``, output blocks of ``to``."""
    T, R = tile_group_T.shape[0], xp.shape[1]
    n_out = w.shape[1] if transpose else w.shape[2]
    if transpose:
        w_spec = pl.BlockSpec((1, to, tr), lambda t, o, r, g, a: (g[t], o, r))
    else:
        w_spec = pl.BlockSpec((1, tr, to), lambda t, o, r, g, a: (g[t], r, o))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(T, n_out // to, R // tr),
        in_specs=[pl.BlockSpec((tm, tr), lambda t, o, r, g, a: (t, r)), w_spec],
        out_specs=pl.BlockSpec((tm, to), lambda t, o, r, g, a: (t, o)),
        scratch_shapes=[pltpu.VMEM((tm, to), jnp.float32)])
    return pl.pallas_call(
        functools.partial(_mosaic_tiles_kernel, transpose=transpose),
        out_shape=jax.ShapeDtypeStruct((T * tm, n_out), xp.dtype), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(tile_group_T, n_active, xp, w)


def _mosaic_tgmm_kernel(group_ref, first_ref, last_ref, x_ref, dy_ref, o_ref, acc_ref):
    t = pl.program_id(2)

    @pl.when(first_ref[t] == 1)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jax.lax.dot_general(x_ref[...], dy_ref[...], (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    @pl.when(last_ref[t] == 1)
    def _():
        o_ref[0] = acc_ref[...].astype(o_ref.dtype)


def _mosaic_tgmm(xp, dyp, tile_group_T, first_T, last_T, G, tm, tk, tn, interpret):
    T, K, N = tile_group_T.shape[0], xp.shape[1], dyp.shape[1]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(K // tk, N // tn, T),
        in_specs=[pl.BlockSpec((tm, tk), lambda k, n, t, g, f, e: (t, k)),
                  pl.BlockSpec((tm, tn), lambda k, n, t, g, f, e: (t, n))],
        out_specs=pl.BlockSpec((1, tk, tn), lambda k, n, t, g, f, e: (g[t], k, n)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
    return pl.pallas_call(
        _mosaic_tgmm_kernel, out_shape=jax.ShapeDtypeStruct((G, K, N), xp.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(tile_group_T, first_T, last_T, xp, dyp)


# -- GPU (Triton) ------------------------------------------------------------------------------
def _triton_tiles_kernel(group_ref, active_ref, x_ref, w_ref, o_ref, *, tr, n_red, transpose):
    t, o = pl.program_id(0), pl.program_id(1)
    g = group_ref[t]
    to = o_ref.shape[1]

    def body(r, acc):
        x = x_ref[:, pl.ds(r * tr, tr)]
        if transpose:
            w = w_ref[g, pl.ds(o * to, to), pl.ds(r * tr, tr)]
            return acc + pltriton.dot(x, w, trans_b=True)
        w = w_ref[g, pl.ds(r * tr, tr), pl.ds(o * to, to)]
        return acc + pltriton.dot(x, w)

    # integer arithmetic, not jnp.where: Triton's scf.for wants i32 bounds, and a select of
    # two literals lowers to i1 (rejected when the GPU compiles the module)
    steps = jnp.minimum(jnp.maximum(active_ref[0] - t, 0), 1) * n_red
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _triton_tiles(xp, w, tile_group_T, n_active, tm, tr, to, *, transpose, warps, stages):
    T, R = tile_group_T.shape[0], xp.shape[1]
    n_out = w.shape[1] if transpose else w.shape[2]
    Tp = pow2(T)
    groups = pad_to(tile_group_T, 0, Tp)
    return pl.pallas_call(
        functools.partial(_triton_tiles_kernel, tr=tr, n_red=R // tr, transpose=transpose),
        out_shape=jax.ShapeDtypeStruct((T * tm, n_out), xp.dtype),
        grid=(T, n_out // to),
        in_specs=[pl.BlockSpec((Tp,), lambda t, o: (0,)),
                  pl.BlockSpec((1,), lambda t, o: (0,)),
                  pl.BlockSpec((tm, R), lambda t, o: (t, 0)),
                  pl.BlockSpec(w.shape, lambda t, o: (0, 0, 0))],
        out_specs=pl.BlockSpec((tm, to), lambda t, o: (t, o)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(groups, n_active, xp, w)


def _triton_tgmm_kernel(start_ref, tiles_ref, x_ref, dy_ref, o_ref, *, tm):
    g, k, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tk, tn = o_ref.shape[1], o_ref.shape[2]

    def body(i, acc):
        rows = pl.ds((start_ref[g] + i) * tm, tm)
        x = x_ref[rows, pl.ds(k * tk, tk)]
        dy = dy_ref[rows, pl.ds(n * tn, tn)]
        return acc + pltriton.dot(x, dy, trans_a=True)

    acc = jax.lax.fori_loop(0, tiles_ref[g], body, jnp.zeros((tk, tn), jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


def _triton_tgmm(xp, dyp, tile_start_G, tiles_G, tm, tk, tn, warps, stages):
    G, K, N = tile_start_G.shape[0], xp.shape[1], dyp.shape[1]
    Gp = pow2(G)
    return pl.pallas_call(
        functools.partial(_triton_tgmm_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((G, K, N), xp.dtype),
        grid=(G, K // tk, N // tn),
        in_specs=[pl.BlockSpec((Gp,), lambda g, k, n: (0,)),
                  pl.BlockSpec((Gp,), lambda g, k, n: (0,)),
                  pl.BlockSpec(xp.shape, lambda g, k, n: (0, 0)),
                  pl.BlockSpec(dyp.shape, lambda g, k, n: (0, 0))],
        out_specs=pl.BlockSpec((1, tk, tn), lambda g, k, n: (g, k, n)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(pad_to(tile_start_G, 0, Gp), pad_to(tiles_G, 0, Gp), xp, dyp)


# -- layout and platform choice --------------------------------------------------------------
def _layout(group_sizes_G, m: int, tm: int):
    """Row layout of ``m`` rows in tiles of ``tm``: scatter index, each tile's group, each
    group's first tile and tile count, the tile count ``T`` and the used tiles (``[1]``)."""
    padded_M, tile_group_T, tile_start_G, tiles_G, T = group_tiles(group_sizes_G, m, tm)
    n_active = jnp.reshape(tile_start_G[-1] + tiles_G[-1], (1,)).astype(jnp.int32)
    return padded_M, tile_group_T, tile_start_G, tiles_G, T, n_active


def _tiles_product(x_MR, w, group_sizes_G, tiles, transpose, interpret):
    """``[M, n_out]``: each row times its group's ``w`` (``w^T`` with ``transpose``). Each
    platform lays the rows out with its own row tile."""
    m, R = x_MR.shape
    n_out = w.shape[1] if transpose else w.shape[2]
    w = w.astype(x_MR.dtype)

    def pad_w(w, tr, to):
        return pad_to(pad_to(w, 2 if transpose else 1, tr), 1 if transpose else 2, to)

    def product(kernel, tm, tr, to):
        def run(x_MR, w, group_sizes_G):
            padded_M, tile_group_T, _, _, T, n_active = _layout(group_sizes_G, m, tm)
            xp = pad_to(_scatter_rows(x_MR, padded_M, T, tm), 1, tr)
            yp = kernel(xp, pad_w(w, tr, to), tile_group_T, n_active, tm, tr, to)[:, :n_out]
            return yp.at[padded_M].get(mode="fill", fill_value=0)
        return run

    def mosaic(interp):
        tm, tr_pref, to_pref = tiles
        kernel = functools.partial(_mosaic_tiles, transpose=transpose, interpret=interp)
        return product(kernel, tm, block(R, tr_pref), block(n_out, to_pref))

    def triton(*args):  # the launch configuration is read when the GPU branch is traced
        c = config_for("gmm", x_MR.dtype, R, n_out)
        kernel = functools.partial(_triton_tiles, transpose=transpose, warps=c.num_warps,
                                   stages=c.num_stages)
        return product(kernel, c.tm, min(pow2(R, 16), c.tk), min(pow2(n_out, 16), c.tn))(*args)

    return choose_platform((x_MR, w, group_sizes_G), mosaic=mosaic, triton=triton,
                           interpret=interpret)


def tgmm(x_MK, dy_MN, group_sizes_G, *, tm: int = 128, tk: int = 128, tn: int = 128,
         interpret=None):
    """``dW [G, K, N]``, ``dW[g] = x_g^T dy_g`` over each group's rows (0 for an empty group):
    the weight gradient of :func:`gmm`. ``tm`` / ``tk`` / ``tn``: the TPU and interpret-mode
    tiles (the GPU kernel's come from :func:`moejax.kernels.tuning.config_for`)."""
    m, K = x_MK.shape
    N, G = dy_MN.shape[1], group_sizes_G.shape[0]
    dy_MN = dy_MN.astype(x_MK.dtype)

    def scatter(x_MK, dy_MN, group_sizes_G, tm, k_, n_):
        padded_M, tile_group_T, tile_start_G, tiles_G, T, _ = _layout(group_sizes_G, m, tm)
        xq = pad_to(_scatter_rows(x_MK, padded_M, T, tm), 1, k_)
        dq = pad_to(_scatter_rows(dy_MN, padded_M, T, tm), 1, n_)
        return xq, dq, tile_group_T, tile_start_G, tiles_G, T

    def mosaic(interp):
        k_, n_ = block(K, tk), block(N, tn)

        def run(x_MK, dy_MN, group_sizes_G):
            xq, dq, tile_group_T, _, tiles_G, T = scatter(x_MK, dy_MN, group_sizes_G, tm, k_,
                                                          n_)
            nxt = jnp.concatenate([tile_group_T[1:], jnp.full((1,), -1, jnp.int32)])
            prv = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile_group_T[:-1]])
            first_T = (tile_group_T != prv).astype(jnp.int32)
            last_T = ((tile_group_T != nxt) | (jnp.arange(T) == T - 1)).astype(jnp.int32)
            dw = _mosaic_tgmm(xq, dq, tile_group_T, first_T, last_T, G, tm, k_, n_, interp)
            visited = (tiles_G > 0) | (jnp.arange(G) == tile_group_T[-1])
            return jnp.where(visited[:, None, None], dw, 0)[:, :K, :N]
        return run

    def triton(x_MK, dy_MN, group_sizes_G):
        c = config_for("tgmm", x_MK.dtype, K, N)
        k_, n_ = min(pow2(K, 16), c.tk), min(pow2(N, 16), c.tn)
        xq, dq, _, tile_start_G, tiles_G, _ = scatter(x_MK, dy_MN, group_sizes_G, c.tm, k_, n_)
        return _triton_tgmm(xq, dq, tile_start_G, tiles_G, c.tm, k_, n_, c.num_warps,
                            c.num_stages)[:, :K, :N]

    return choose_platform((x_MK, dy_MN, group_sizes_G.astype(jnp.int32)), mosaic=mosaic,
                           triton=triton, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x_MK, w_GKN, group_sizes_G, tiles, interpret):
    return _tiles_product(x_MK, w_GKN, group_sizes_G, tiles, False, interpret)


def _gmm_fwd(x_MK, w_GKN, group_sizes_G, tiles, interpret):
    y = _tiles_product(x_MK, w_GKN, group_sizes_G, tiles, False, interpret)
    return y, (x_MK, w_GKN, group_sizes_G)


def _gmm_bwd(tiles, interpret, res, dy_MN):
    x_MK, w_GKN, group_sizes_G = res
    tm, tk, tn = tiles
    dy = dy_MN.astype(x_MK.dtype)
    dx = _tiles_product(dy, w_GKN, group_sizes_G, (tm, tn, tk), True, interpret)
    dw = tgmm(x_MK, dy, group_sizes_G, tm=tm, tk=tk, tn=tn, interpret=interpret)
    return dx, dw.astype(w_GKN.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm_t(dy_MN, w_GKN, group_sizes_G, *, tm: int = 128, tk: int = 128, tn: int = 128,
          interpret=None):
    """``[M, N] x [G, K, N]^T -> [M, K]``: each row times its group's ``w^T``, the input
    gradient of :func:`gmm` (not differentiable itself)."""
    return _tiles_product(dy_MN, w_GKN, group_sizes_G.astype(jnp.int32), (tm, tn, tk), True,
                          bool(interpret))


def gmm(x_MK, w_GKN, group_sizes_G, *, tm: int = 128, tk: int = 128, tn: int = 128,
        interpret=None):
    """Grouped matmul (see the module docstring): ``[M, K] x [G, K, N] -> [M, N]``,
    differentiable in ``x`` and ``w``. ``tm`` / ``tk`` / ``tn``: the TPU and interpret-mode
    tiles (rows, contraction, columns; the GPU kernel's, powers of two as ``tl.dot`` needs,
    come from :func:`moejax.kernels.tuning.config_for`); ``interpret=True`` forces Pallas
    interpret mode."""
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"gmm: x {x_MK.shape} and w {w_GKN.shape} must be [M, K] and [G, K, N]")
    if group_sizes_G.shape != (w_GKN.shape[0],):
        raise ValueError(f"gmm: group_sizes {group_sizes_G.shape} must be [G={w_GKN.shape[0]}]")
    if min(tm, tk, tn) < 1:
        raise ValueError(f"gmm: tiles tm={tm}, tk={tk}, tn={tn} must be >= 1")
    return _gmm(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), (tm, tk, tn), bool(interpret))
