"""Grouped matmul on the host's BLAS: exact group sizes, for the CPU backend.

``host_gmm(x_MK, w_GKN, group_sizes_G)`` has the contract of :func:`jax.lax.ragged_dot`: rows
``[s_g, s_g + group_sizes_G[g])`` of ``x_MK`` (``s_g`` = the sizes before ``g``) are multiplied
by ``w_GKN[g]``; rows past ``sum(group_sizes_G)`` give zeros. XLA needs static shapes, so its
own grouped paths pad (``grouped`` tiles, ``capacity`` buffers) or run every group on every
row (``ragged_dot`` on CPU); here one ``jax.pure_callback`` hands the arrays to numpy, which
loops over the groups with their exact sizes, as an eager framework's expert loop does. The
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


def _gmm_np(x_MK, w_GKN, group_sizes_G, *, transpose_w: bool):
    """Per group ``x_g @ w_g`` (``w_g.T`` with ``transpose_w``); rows past the groups are 0."""
    dtype = np.asarray(x_MK).dtype
    x, w = _as_f32(x_MK), _as_f32(w_GKN)
    n = w.shape[1] if transpose_w else w.shape[2]
    out = np.zeros((x.shape[0], n), np.float32)
    for g, a, b in _segments(group_sizes_G):
        np.matmul(x[a:b], w[g].T if transpose_w else w[g], out=out[a:b])
    return out.astype(dtype, copy=False)


def _tgmm_np(x_MK, dy_MN, group_sizes_G, *, n_groups: int):
    """Per group ``x_g^T dy_g`` (the weight gradient); empty groups get zeros."""
    dtype = np.asarray(x_MK).dtype
    x, dy = _as_f32(x_MK), _as_f32(dy_MN)
    out = np.zeros((n_groups, x.shape[1], dy.shape[1]), np.float32)
    for g, a, b in _segments(group_sizes_G):
        np.matmul(x[a:b].T, dy[a:b], out=out[g])
    return out.astype(dtype, copy=False)


def _call(fn, shape, dtype, *args):
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"host_gmm runs on the host's BLAS and is for the CPU backend (this one is "
            f"{jax.default_backend()!r}); use dispatch='gmm' (Pallas kernel) or 'ragged' there")
    return jax.pure_callback(fn, jax.ShapeDtypeStruct(shape, dtype), *args,
                             vmap_method="sequential")


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
    n_groups = w_GKN.shape[0]
    if transpose_w:  # y = x w^T: dW = dy^T x per group
        dw = _call(functools.partial(_tgmm_np, n_groups=n_groups), w_GKN.shape, w_GKN.dtype,
                   dy_MN, x_MK, group_sizes_G)
    else:
        dw = _call(functools.partial(_tgmm_np, n_groups=n_groups), w_GKN.shape, w_GKN.dtype,
                   x_MK, dy_MN, group_sizes_G)
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
