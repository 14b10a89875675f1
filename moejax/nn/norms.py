"""Normalisation layers (statistics always computed in float32).

Parameter paths (relative to the module):

* ``RMSNorm``: ``scale`` ``[dim]`` (init 1).  ``y = x / sqrt(mean(x^2) + eps) * scale``
* ``LayerNorm``: ``scale`` ``[dim]`` (init 1), ``bias`` ``[dim]`` (init 0).
  ``y = (x - mean) / sqrt(var + eps) * scale + bias``

Both normalise over the last axis and return the compute ``dtype`` (default: the input's dtype).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn import axes as ax

__all__ = ["RMSNorm", "LayerNorm", "NormKind", "make_norm", "inv_rms"]

NormKind = Literal["rmsnorm", "layernorm"]


def inv_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm's per-row factor ``rsqrt(mean(x^2) + eps)`` over the last axis (float32, kept
    dims): what a decode step folds after its product (:mod:`moejax.nn.lean_decode`)."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learnable scale (Llama, BlockFFN router)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None,
                 dtype=None, param_dtype=jnp.float32):
        del rngs  # deterministic init; kept for a uniform constructor signature
        self.eps = float(eps)
        self.dtype = dtype
        self.scale = ax.param(jnp.ones((dim,), param_dtype), ax.NORM)

    def __call__(self, x: jax.Array) -> jax.Array:
        out_dtype = self.dtype or x.dtype
        y = x.astype(jnp.float32) * inv_rms(x, self.eps) * self.scale[...].astype(jnp.float32)
        return y.astype(out_dtype)


class LayerNorm(nnx.Module):
    """Layer norm with learnable scale and bias (BERT, ViT)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, rngs: nnx.Rngs | None = None,
                 dtype=None, param_dtype=jnp.float32):
        del rngs
        self.eps = float(eps)
        self.dtype = dtype
        self.scale = ax.param(jnp.ones((dim,), param_dtype), ax.NORM)
        self.bias = ax.param(jnp.zeros((dim,), param_dtype), ax.NORM)

    def __call__(self, x: jax.Array) -> jax.Array:
        out_dtype = self.dtype or x.dtype
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(out_dtype)


def make_norm(kind: str, dim: int, *, eps: float, dtype=None, param_dtype=jnp.float32):
    """Build a norm by name: ``"rmsnorm"`` or ``"layernorm"``."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps, dtype=dtype, param_dtype=param_dtype)
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, dtype=dtype, param_dtype=param_dtype)
    raise ValueError(f"unknown norm kind {kind!r}; use 'rmsnorm' or 'layernorm'")
