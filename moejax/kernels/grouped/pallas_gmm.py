"""Grouped matmul for dropless top-k MoE training, as Pallas kernels with a ``custom_vjp``.

``y = gmm(x_MK, w_GKN, group_sizes_G)`` has :func:`jax.lax.ragged_dot`'s meaning: the rows of
``x`` are sorted by group, the first ``group_sizes[0]`` rows use ``w[0]``, the next
``group_sizes[1]`` rows ``w[1]``, ...; rows past ``sum(group_sizes)`` give 0.

Three products, each tiled over rows, columns *and* the contraction, so a program holds three
small tiles whatever ``K`` and ``N`` are:

* forward ``y_t = x_t w[g_t]`` and ``dX_t = dy_t w[g_t]^T`` (the transpose is taken in the
  kernel: no transposed weight stack is materialised);
* ``dW[g] = sum over g's row tiles of x_t^T dy_t`` (:func:`tgmm`; an empty group gets 0).

The kernel is chosen per platform when the function is traced, for the platform the program
is built for (:func:`moejax.kernels.tiling.on_target`), so one function lowers to the right
kernel on each:

* GPU: Triton (:mod:`moejax.kernels.grouped.gmm_triton`), on megablox's tile metadata
  (:func:`moejax.kernels.grouped.layout.group_visits`): the rows stay where they are, each visit
  of a row tile loads and stores only its group's rows (masked), so no operand is copied or
  padded; the visits run in grouped launch order (their rows stay in L2 while the weight
  blocks stream past).
  Tiles, warps and stages come from :func:`moejax.kernels.tuning.config_for` (the tuned table
  for the device being lowered for, per dtype and shape bucket, else the defaults there).
  On a GPU this kernel serves what tokamax's Mosaic GPU kernels do not take: float32 (and GPUs
  older than sm80), and the large products where it measured faster. Its bf16 / f16 products
  also exist on Mosaic GPU (:mod:`moejax.kernels.grouped.gmm_mgpu`); float32 stays on Triton
  because on Mosaic GPU it means a tf32 wgmma, which takes K-major operands only (Mosaic GPU
  transposes 16-bit operands alone): the forward's ``w[g]`` (``[K, N]``, N fastest) and dW's
  ``x`` (contracted over its rows) would each need a transposed copy per step.
* TPU: Mosaic, on the block-padded layout (:func:`moejax.kernels.grouped.layout.group_tiles`:
  every group's rows copied into tiles of its own). Grid ``(tiles, output blocks, contraction
  blocks)``; the tiles' groups are scalar-prefetched so each program DMAs only its group's
  ``[tk, tn]`` weight block, and an f32 accumulator lives in VMEM scratch across the
  contraction axis. Tiles past the used ones skip their matmul. ``dW`` walks the tiles in
  order and accumulates while the group stays the same (the output block stays resident),
  writing when it changes. (On TPU this kernel only runs where tokamax's declines:
  :mod:`moejax.kernels.grouped.ragged`.)
* CPU: the TPU kernels in Pallas interpret mode (correct and slow: for tests; the CPU's fast
  MoE path is the host kernel of :mod:`moejax.kernels.moe_ffn.host`).

Where jax no longer ships Pallas Triton (deprecated since jax 0.12), a GPU runs the Mosaic GPU
kernels of :mod:`moejax.kernels.grouped.gmm_mgpu` (bf16 / f16 on a Hopper GPU) and otherwise
:func:`jax.lax.ragged_dot_general`.

``interpret=True`` runs the TPU kernels interpreted on every platform, ``interpret="triton"``
the GPU kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moejax.kernels.grouped.gmm_mgpu import PASSES as MGPU_PASSES
from moejax.kernels.grouped.gmm_triton import AVAILABLE as TRITON_AVAILABLE
from moejax.kernels.grouped.gmm_triton import triton_tgmm, triton_tiles
from moejax.kernels.grouped.layout import RAGGED_DIMS, group_tiles
from moejax.kernels.tiling import block, choose_platform, pad_to, pow2
from moejax.kernels.tuning import TritonConfig, config_for

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


# -- layout and platform choice --------------------------------------------------------------
def _layout(group_sizes_G, m: int, tm: int):
    """Row layout of ``m`` rows in tiles of ``tm``: scatter index, each tile's group, each
    group's first tile and tile count, the tile count ``T`` and the used tiles (``[1]``)."""
    padded_M, tile_group_T, tile_start_G, tiles_G, T = group_tiles(group_sizes_G, m, tm)
    n_active = jnp.reshape(tile_start_G[-1] + tiles_G[-1], (1,)).astype(jnp.int32)
    return padded_M, tile_group_T, tile_start_G, tiles_G, T, n_active


def _mode(interpret):
    """``interpret`` as False, True (the TPU kernels interpreted) or ``"triton"`` (the GPU
    kernels interpreted)."""
    if interpret == "triton":
        if not TRITON_AVAILABLE:
            raise ValueError("interpret='triton': this jax has no Pallas Triton "
                             "(jax.experimental.pallas.triton); use interpret=True")
        return interpret
    if interpret not in (None, False, True):
        raise ValueError(f"interpret={interpret!r}; allowed: None, False, True, 'triton'")
    return bool(interpret)


def _without_triton(which: str):
    """Product ``which`` on a GPU where jax no longer ships Pallas Triton: the Mosaic GPU
    kernels (bf16 / f16 on a Hopper GPU), else XLA's ragged dot."""
    def run(a, b, group_sizes_G):
        try:
            return MGPU_PASSES[which](a, b, group_sizes_G)
        except NotImplementedError:
            return jax.lax.ragged_dot_general(
                a, b, group_sizes_G, RAGGED_DIMS[which],
                preferred_element_type=b.dtype if which == "drhs" else a.dtype)
    return run


def _run(*args, which: str, mosaic, triton, interpret):
    """Product ``which`` on ``args``: ``mosaic(interp)`` / ``triton(interp)`` build the TPU /
    GPU kernels; ``interpret`` (from :func:`_mode`) ``"triton"`` runs the GPU kernels
    interpreted, otherwise the platform's kernel is chosen when the program is lowered (on a
    GPU without Pallas Triton: :func:`_without_triton`)."""
    if interpret == "triton":
        return triton(True)(*args)
    gpu = triton(False) if TRITON_AVAILABLE else _without_triton(which)
    return choose_platform(args, mosaic=mosaic, triton=gpu, interpret=interpret)


def _triton_config(kernel, dtype, k, n, tiles, interpret):
    """The Triton launch: interpreted, the caller's tiles as they are; compiled, the tuned or
    default configuration for the device being lowered for (read when the GPU branch is
    traced), its blocks capped at the operands' powers of two (what ``tl.dot`` takes)."""
    if interpret:
        return TritonConfig(*tiles)
    c = config_for(kernel, dtype, k, n)
    return c._replace(tk=min(pow2(k, 16), c.tk), tn=min(pow2(n, 16), c.tn))


def _tiles_product(x_MR, w, group_sizes_G, tiles, transpose, interpret):
    """``[M, n_out]``: each row times its group's ``w`` (``w^T`` with ``transpose``).
    ``interpret``: False (the platform's kernel), True (the TPU kernel interpreted) or
    ``"triton"`` (the GPU kernel interpreted)."""
    m, R = x_MR.shape
    n_out = w.shape[1] if transpose else w.shape[2]
    w = w.astype(x_MR.dtype)

    def pad_w(w, tr, to):
        return pad_to(pad_to(w, 2 if transpose else 1, tr), 1 if transpose else 2, to)

    def mosaic(interp):
        tm, tr, to = tiles[0], block(R, tiles[1]), block(n_out, tiles[2])

        def run(x_MR, w, group_sizes_G):
            padded_M, tile_group_T, _, _, T, n_active = _layout(group_sizes_G, m, tm)
            xp = pad_to(_scatter_rows(x_MR, padded_M, T, tm), 1, tr)
            yp = _mosaic_tiles(xp, pad_w(w, tr, to), tile_group_T, n_active, tm, tr, to,
                               transpose=transpose, interpret=interp)[:, :n_out]
            return yp.at[padded_M].get(mode="fill", fill_value=0)
        return run

    def triton(interp):
        def run(x_MR, w, group_sizes_G):
            c = _triton_config("gmm", x_MR.dtype, R, n_out, tiles, interp)
            return triton_tiles(x_MR, w, group_sizes_G, c.tm, c.tk, c.tn, transpose=transpose,
                                 warps=c.num_warps, stages=c.num_stages, interpret=interp)
        return run

    return _run(x_MR, w, group_sizes_G, which="dlhs" if transpose else "fwd", mosaic=mosaic,
                triton=triton, interpret=interpret)


def tgmm(x_MK, dy_MN, group_sizes_G, *, tm: int = 128, tk: int = 128, tn: int = 128,
         interpret=None):
    """``dW [G, K, N]``, ``dW[g] = x_g^T dy_g`` over each group's rows (0 for an empty group):
    the weight gradient of :func:`gmm`. ``tm`` / ``tk`` / ``tn``: the TPU and interpret-mode
    tiles (the GPU kernel's come from :func:`moejax.kernels.tuning.config_for`);
    ``interpret``: as :func:`gmm`'s."""
    m, K = x_MK.shape
    N, G = dy_MN.shape[1], group_sizes_G.shape[0]
    dy_MN = dy_MN.astype(x_MK.dtype)

    def mosaic(interp):
        k_, n_ = block(K, tk), block(N, tn)

        def run(x_MK, dy_MN, group_sizes_G):
            padded_M, tile_group_T, _, tiles_G, T, _ = _layout(group_sizes_G, m, tm)
            xq = pad_to(_scatter_rows(x_MK, padded_M, T, tm), 1, k_)
            dq = pad_to(_scatter_rows(dy_MN, padded_M, T, tm), 1, n_)
            nxt = jnp.concatenate([tile_group_T[1:], jnp.full((1,), -1, jnp.int32)])
            prv = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile_group_T[:-1]])
            first_T = (tile_group_T != prv).astype(jnp.int32)
            last_T = ((tile_group_T != nxt) | (jnp.arange(T) == T - 1)).astype(jnp.int32)
            dw = _mosaic_tgmm(xq, dq, tile_group_T, first_T, last_T, G, tm, k_, n_, interp)
            visited = (tiles_G > 0) | (jnp.arange(G) == tile_group_T[-1])
            return jnp.where(visited[:, None, None], dw, 0)[:, :K, :N]
        return run

    def triton(interp):
        def run(x_MK, dy_MN, group_sizes_G):
            c = _triton_config("tgmm", x_MK.dtype, K, N, (tm, tk, tn), interp)
            return triton_tgmm(x_MK, dy_MN, group_sizes_G, c.tm, c.tk, c.tn,
                                warps=c.num_warps, stages=c.num_stages, interpret=interp)
        return run

    return _run(x_MK, dy_MN, group_sizes_G.astype(jnp.int32), which="drhs", mosaic=mosaic,
                triton=triton, interpret=_mode(interpret))


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
                          _mode(interpret))


def gmm(x_MK, w_GKN, group_sizes_G, *, tm: int = 128, tk: int = 128, tn: int = 128,
        interpret=None):
    """Grouped matmul (see the module docstring): ``[M, K] x [G, K, N] -> [M, N]``,
    differentiable in ``x`` and ``w``. ``tm`` / ``tk`` / ``tn``: the TPU and interpret-mode
    tiles (rows, contraction, columns; the GPU kernel's, powers of two as ``tl.dot`` needs,
    come from :func:`moejax.kernels.tuning.config_for`). ``interpret=True`` runs the TPU
    kernels in Pallas interpret mode on any platform, ``interpret="triton"`` the GPU kernels
    (with these tiles), so both are checked on a CPU."""
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"gmm: x {x_MK.shape} and w {w_GKN.shape} must be [M, K] and [G, K, N]")
    if group_sizes_G.shape != (w_GKN.shape[0],):
        raise ValueError(f"gmm: group_sizes {group_sizes_G.shape} must be [G={w_GKN.shape[0]}]")
    if min(tm, tk, tn) < 1:
        raise ValueError(f"gmm: tiles tm={tm}, tk={tk}, tn={tn} must be >= 1")
    return _gmm(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), (tm, tk, tn), _mode(interpret))
