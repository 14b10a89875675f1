"""Grouped matmul for dropless top-k MoE training, as Pallas kernels with a ``custom_vjp``.

``y = gmm(x_MK, w_GKN, group_sizes_G)`` has :func:`jax.lax.ragged_dot`'s meaning: the rows of
``x`` are sorted by group, the first ``group_sizes[0]`` rows use ``w[0]``, the next
``group_sizes[1]`` rows ``w[1]``, ...; rows past ``sum(group_sizes)`` give 0.

Block-padded grouped layout (megablox-style): every group's rows are padded to a multiple of the
row tile ``tm``, so each tile of ``tm`` rows belongs to exactly one group; ``T = ceil(M / tm) +
G`` tiles bound the padded extent statically (``sum_g ceil(s_g / tm) <= M / tm + G``).
:func:`moejax.ops.grouped_layout.group_tiles` computes the layout, the row scatter and each
tile's group.

Kernels (grid and blocks):
* forward / dX (:func:`_grouped_tiles`): grid ``(T, N / tn)``; program ``(t, n)`` multiplies its
  ``[tm, K]`` row tile by ``w[tile_group[t]][:, n-block]`` (f32 accumulation, output in the
  input dtype). ``dX = gmm(dY, w^T)``.
* dW (:func:`tgmm`): grid ``(G, N / tn)``; program ``(g, n)`` loops over the group's tiles
  (a dynamic trip count; zero for an empty group, whose ``dW`` is then 0) and accumulates
  ``x_tile^T dY_tile``. Each program writes only its own output block, as GPU lowering needs.

``interpret`` defaults to True on CPU (Pallas interpret mode) and False elsewhere. Tests:
``tests/test_kernels_gmm.py`` (against ``ragged_dot`` and a per-group dense oracle, values and
gradients, empty / multi-tile / unaligned groups).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moejax.ops.grouped_layout import group_tiles

__all__ = ["gmm", "tgmm", "group_tiles"]  # group_tiles: re-exported from ops


def _default_interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else interpret


def _pad_last(a, tn):
    pad = (-a.shape[-1]) % tn
    return a if not pad else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])


def _scatter_rows(x_MK, padded_M, T, tm):
    return jnp.zeros((T * tm, x_MK.shape[1]), x_MK.dtype).at[padded_M].set(x_MK, mode="drop")


def _grouped_tiles_kernel(tile_group_ref, x_ref, w_ref, o_ref):
    g = tile_group_ref[pl.program_id(0)]
    o_ref[...] = jnp.dot(x_ref[...], w_ref[g],
                         preferred_element_type=jnp.float32).astype(o_ref.dtype)


def _grouped_tiles(xp, w_GKN, tile_group_T, tm: int, tn: int, interpret: bool):
    """``[T * tm, N]``: tile ``t`` of ``xp`` times ``w[tile_group[t]]``."""
    T, G, K = tile_group_T.shape[0], w_GKN.shape[0], w_GKN.shape[1]
    n = w_GKN.shape[2]
    w = _pad_last(w_GKN, tn)
    Np = w.shape[2]
    out = pl.pallas_call(
        _grouped_tiles_kernel,
        out_shape=jax.ShapeDtypeStruct((T * tm, Np), xp.dtype),
        grid=(T, Np // tn),
        in_specs=[pl.BlockSpec((T,), lambda t, j: (0,)),
                  pl.BlockSpec((tm, K), lambda t, j: (t, 0)),
                  pl.BlockSpec((G, K, tn), lambda t, j: (0, 0, j))],
        out_specs=pl.BlockSpec((tm, tn), lambda t, j: (t, j)),
        interpret=interpret,
    )(tile_group_T, xp, w)
    return out[:, :n]


def _gmm_impl(x_MK, w_GKN, group_sizes_G, tm, tn, interpret):
    m = x_MK.shape[0]
    padded_M, tile_group_T, _, _, T = group_tiles(group_sizes_G, m, tm)
    yp = _grouped_tiles(_scatter_rows(x_MK, padded_M, T, tm), w_GKN.astype(x_MK.dtype),
                        tile_group_T, tm, tn, interpret)
    return yp.at[padded_M].get(mode="fill", fill_value=0)


def _tgmm_kernel(tile_start_ref, tiles_ref, x_ref, dy_ref, o_ref, *, tm: int):
    g = pl.program_id(0)
    start, count = tile_start_ref[g], tiles_ref[g]
    K, tn = o_ref.shape[1], o_ref.shape[2]

    def body(i, acc):
        rows = pl.ds((start + i) * tm, tm)
        return acc + jnp.dot(x_ref[rows, :].T, dy_ref[rows, :],
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros((K, tn), jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


def tgmm(x_MK, dy_MN, group_sizes_G, *, tm: int = 128, tn: int = 128, interpret=None):
    """``dW [G, K, N]``, ``dW[g] = x_g^T dy_g`` over each group's rows (0 for an empty group):
    the weight gradient of :func:`gmm`."""
    interpret = _default_interpret(interpret)
    m, K = x_MK.shape
    n, G = dy_MN.shape[1], group_sizes_G.shape[0]
    padded_M, _, tile_start_G, tiles_G, T = group_tiles(group_sizes_G, m, tm)
    xp = _scatter_rows(x_MK, padded_M, T, tm)
    dyp = _pad_last(_scatter_rows(dy_MN, padded_M, T, tm), tn)
    Np = dyp.shape[1]
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((G, K, Np), x_MK.dtype),
        grid=(G, Np // tn),
        in_specs=[pl.BlockSpec((G,), lambda g, j: (0,)),
                  pl.BlockSpec((G,), lambda g, j: (0,)),
                  pl.BlockSpec((T * tm, K), lambda g, j: (0, 0)),
                  pl.BlockSpec((T * tm, tn), lambda g, j: (0, j))],
        out_specs=pl.BlockSpec((1, K, tn), lambda g, j: (g, 0, j)),
        interpret=interpret,
    )(tile_start_G, tiles_G, xp, dyp)
    return out[:, :, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(x_MK, w_GKN, group_sizes_G, tm, tn, interpret):
    return _gmm_impl(x_MK, w_GKN, group_sizes_G, tm, tn, interpret)


def _gmm_fwd(x_MK, w_GKN, group_sizes_G, tm, tn, interpret):
    return _gmm_impl(x_MK, w_GKN, group_sizes_G, tm, tn, interpret), (x_MK, w_GKN,
                                                                       group_sizes_G)


def _gmm_bwd(tm, tn, interpret, res, dy_MN):
    x_MK, w_GKN, group_sizes_G = res
    dx = _gmm_impl(dy_MN.astype(x_MK.dtype), jnp.swapaxes(w_GKN, 1, 2).astype(x_MK.dtype),
                   group_sizes_G, tm, tn, interpret)
    dw = tgmm(x_MK, dy_MN.astype(x_MK.dtype), group_sizes_G, tm=tm, tn=tn,
              interpret=interpret).astype(w_GKN.dtype)
    return dx, dw, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(x_MK, w_GKN, group_sizes_G, *, tm: int = 128, tn: int = 128, interpret=None):
    """Grouped matmul (see the module docstring): ``[M, K] x [G, K, N] -> [M, N]``,
    differentiable in ``x`` and ``w``."""
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"gmm: x {x_MK.shape} and w {w_GKN.shape} must be [M, K] and [G, K, N]")
    if group_sizes_G.shape != (w_GKN.shape[0],):
        raise ValueError(f"gmm: group_sizes {group_sizes_G.shape} must be [G={w_GKN.shape[0]}]")
    return _gmm(x_MK, w_GKN, group_sizes_G, tm, tn, _default_interpret(interpret))
