"""Grouped matmul on the host's BLAS: exact group sizes, for the CPU backend.

``host_gmm(x_MK, w_GKN, group_sizes_G)`` has the contract of :func:`jax.lax.ragged_dot`: rows
``[s_g, s_g + group_sizes_G[g])`` of ``x_MK`` (``s_g`` = the sizes before ``g``) are multiplied
by ``w_GKN[g]``; rows past ``sum(group_sizes_G)`` give zeros. XLA needs static shapes, so its
own grouped paths pad (``grouped`` tiles, ``capacity`` buffers) or run every group on every
row (``ragged_dot`` on CPU); here a ``buffer_callback`` (JAX's in-place callback: numpy reads
the input buffers and writes the output buffer, no copies; ``pure_callback`` copied every
result and cost twice the matmul time) loops over the groups with their exact sizes, as an
eager framework's expert loop does. The
backward pass is two more callbacks (``dx = dy W^T`` per group, ``dW_g = x_g^T dy_g``) under a
``custom_vjp``, so ``jax.grad`` works and nothing is recomputed (first order only: the weight
gradient's callback has no derivative of its own).

CPU backend only: on an accelerator the callback would copy the activations to the host and
back (use ``jax.lax.ragged_dot`` or :func:`moejax.kernels.gmm.gmm` there); tracing on another
backend raises. Low-precision inputs are multiplied in float32 and cast back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

__all__ = ["host_gmm", "host_gmm_reference"]


def _segments(group_sizes_G):
    start = 0
    for g, size in enumerate(np.asarray(group_sizes_G).tolist()):
        if size > 0:
            yield g, start, start + size
        start += size


def _as_f32(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _matmul_into(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    if out.dtype == np.float32:
        np.matmul(a, b, out=out)
    else:
        out[...] = np.matmul(a, b).astype(out.dtype)


def _gmm_np(ctx, out_MN, x_MK, w_GKN, group_sizes_G, *, transpose_w: bool):
    """Per group ``x_g @ w_g`` (``w_g.T`` with ``transpose_w``) written into ``out_MN``; rows
    past the groups are 0."""
    del ctx
    out, x, w = np.asarray(out_MN), _as_f32(x_MK), _as_f32(w_GKN)
    end = 0
    for g, a, b in _segments(group_sizes_G):
        _matmul_into(out[a:b], x[a:b], w[g].T if transpose_w else w[g])
        end = b
    out[end:] = 0


def _tgmm_np(ctx, out_GKN, x_MK, dy_MN, group_sizes_G):
    """Per group ``x_g^T dy_g`` (the weight gradient) into ``out_GKN``; empty groups get 0."""
    del ctx
    out, x, dy = np.asarray(out_GKN), _as_f32(x_MK), _as_f32(dy_MN)
    filled = np.zeros(out.shape[0], bool)
    for g, a, b in _segments(group_sizes_G):
        _matmul_into(out[g], x[a:b].T, dy[a:b])
        filled[g] = True
    out[~filled] = 0


def _call(fn, shape, dtype, *args):
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"host_gmm runs on the host's BLAS and is for the CPU backend (this one is "
            f"{jax.default_backend()!r}); use dispatch='gmm' (Pallas kernel) or 'ragged' there")
    return buffer_callback(fn, jax.ShapeDtypeStruct(shape, dtype),
                           vmap_method="sequential")(*args)


def _forward(x_MK, w_GKN, group_sizes_G, transpose_w: bool):
    n = w_GKN.shape[1] if transpose_w else w_GKN.shape[2]
    return _call(functools.partial(_gmm_np, transpose_w=transpose_w), (x_MK.shape[0], n),
                 x_MK.dtype, x_MK, w_GKN, group_sizes_G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _host_gmm(x_MK, w_GKN, group_sizes_G, transpose_w: bool):
    return _forward(x_MK, w_GKN, group_sizes_G, transpose_w)


def _fwd(x_MK, w_GKN, group_sizes_G, transpose_w):
    return _forward(x_MK, w_GKN, group_sizes_G, transpose_w), (x_MK, w_GKN, group_sizes_G)


def _bwd(transpose_w, res, dy_MN):
    x_MK, w_GKN, group_sizes_G = res
    dx = _host_gmm(dy_MN, w_GKN, group_sizes_G, not transpose_w)
    if transpose_w:  # y = x w^T: dW = dy^T x per group
        dw = _call(_tgmm_np, w_GKN.shape, w_GKN.dtype, dy_MN, x_MK, group_sizes_G)
    else:
        dw = _call(_tgmm_np, w_GKN.shape, w_GKN.dtype, x_MK, dy_MN, group_sizes_G)
    return dx, dw, np.zeros(group_sizes_G.shape, jax.dtypes.float0)


_host_gmm.defvjp(_fwd, _bwd)


def host_gmm(x_MK, w_GKN, group_sizes_G):
    """``ragged_dot(x_MK, w_GKN, group_sizes_G)`` computed by numpy over the exact groups."""
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"host_gmm: expected x [M, K] and w [G, K, N], got {x_MK.shape} and "
                         f"{w_GKN.shape}")
    return _host_gmm(x_MK, w_GKN.astype(x_MK.dtype), jnp.asarray(group_sizes_G, jnp.int32),
                     False)


def host_gmm_reference(x_MK, w_GKN, group_sizes_G):
    """The obvious oracle: each row times its group's matrix, one row at a time (jnp)."""
    sizes = jnp.asarray(group_sizes_G, jnp.int32)
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(x_MK.shape[0])
    group_M = jnp.searchsorted(ends, rows, side="right")
    inside = rows < ends[-1]
    w_MKN = w_GKN[jnp.minimum(group_M, w_GKN.shape[0] - 1)]
    y = jnp.einsum("mk,mkn->mn", x_MK, w_MKN.astype(x_MK.dtype))
    return jnp.where(inside[:, None], y, 0).astype(x_MK.dtype)
