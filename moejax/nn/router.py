"""Top-k token routers for MoE layers (all router math in float32).

* :class:`SoftmaxRouter` (Switch / Mixtral / MoE-LLaVA): ``probs = softmax(x W_g)``,
  ``ids, w = TopK(probs, k)``, optionally renormalised so the k weights sum to 1.
* :class:`NoisyTopKRouter` (Shazeer et al. 2017; Llama-MoE):
  ``H = x W_g + eps * softplus(x W_noise)`` with ``eps ~ N(0, 1)`` drawn from the explicit
  ``key`` in training only, ``G = softmax(KeepTopK(H, k))`` (softmax over the k kept
  logits, i.e. always renormalised).

Both are called as ``router(x_ND, train=..., key=...)`` (any leading shape ``[..., D]``)
and return a :class:`RouterOutput`. Parameters: ``w_g [D, E]`` and, noisy only,
``w_noise [D, E]``.

The selection step is also exposed as the pure function :func:`top_k_gates` so that other
code (e.g. distillation variants that change k or sample experts) can reuse it on logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn import axes as ax

__all__ = ["RouterOutput", "top_k_gates", "SoftmaxRouter", "NoisyTopKRouter"]


class RouterOutput(NamedTuple):
    """ids_NK (int32) selected experts, best first; weights_NK (float32) combine weights;
    probs_NE (float32) full softmax over all experts of ``logits_NE``; logits_NE (float32)
    the logits the softmax was taken of (noisy ones in noisy training)."""

    ids_NK: jax.Array
    weights_NK: jax.Array
    probs_NE: jax.Array
    logits_NE: jax.Array


def top_k_gates(logits_NE, k: int, *, renormalize: bool) -> RouterOutput:
    """Pure top-k selection on float logits ``[..., E]``.

    ``probs = softmax(logits)``; the k largest are selected (ties -> lower index). With
    ``renormalize`` the weights are ``softmax`` over the k kept logits (= selected probs
    divided by their sum, = Shazeer's ``softmax(KeepTopK(H, k))``); otherwise the raw
    softmax probabilities of the selected experts."""
    n_experts = logits_NE.shape[-1]
    if not 1 <= k <= n_experts:
        raise ValueError(f"top_k={k} must be in [1, n_experts={n_experts}]")
    logits_NE = logits_NE.astype(jnp.float32)
    probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    top_logits_NK, ids_NK = jax.lax.top_k(logits_NE, k)
    if renormalize:
        weights_NK = jax.nn.softmax(top_logits_NK, axis=-1)
    else:
        weights_NK = jnp.take_along_axis(probs_NE, ids_NK, axis=-1)
    return RouterOutput(ids_NK.astype(jnp.int32), weights_NK, probs_NE, logits_NE)


def _init_w(rngs: nnx.Rngs, shape, param_dtype, scale: float):
    w = jax.random.normal(rngs.params(), shape, param_dtype)
    return ax.param(w * (scale * shape[0] ** -0.5), ax.EMBED, ax.SCORES)


class SoftmaxRouter(nnx.Module):
    """Softmax top-k router with parameter ``w_g [D, E]`` (init N(0, 1/D))."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, *, renormalize: bool,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.n_experts, self.top_k, self.renormalize = n_experts, top_k, renormalize
        self.w_g = _init_w(rngs, (d_model, n_experts), param_dtype, 1.0)

    def logits(self, x_ND, *, train: bool = False, key=None):
        """Clean router logits ``x W_g`` in float32 (train / key unused)."""
        del train, key
        return x_ND.astype(jnp.float32) @ self.w_g[...].astype(jnp.float32)

    def __call__(self, x_ND, *, train: bool = False, key=None,
                 top_k: int | None = None) -> RouterOutput:
        """Route ``x[..., D]``; ``top_k`` overrides the constructed k for this call."""
        logits = self.logits(x_ND, train=train, key=key)
        return top_k_gates(logits, top_k or self.top_k, renormalize=self.renormalize)


class NoisyTopKRouter(nnx.Module):
    """Noisy top-k gating (Shazeer 2017) with ``w_g [D, E]`` (init N(0, 1/D)) and
    ``w_noise [D, E]`` (init 0, so the initial noise std is ``softplus(0) = log 2``).
    Noise is added only when ``train=True``, from the explicit ``key``."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        self.n_experts, self.top_k = n_experts, top_k
        self.w_g = _init_w(rngs, (d_model, n_experts), param_dtype, 1.0)
        self.w_noise = ax.param(jnp.zeros((d_model, n_experts), param_dtype), ax.EMBED, ax.SCORES)

    def logits(self, x_ND, *, train: bool = False, key=None):
        """``H = x W_g + eps * softplus(x W_noise)`` (train) or ``x W_g`` (eval), float32."""
        x = x_ND.astype(jnp.float32)
        clean = x @ self.w_g[...].astype(jnp.float32)
        if not train:
            return clean
        if key is None:
            raise ValueError(
                "NoisyTopKRouter: train=True draws router noise and needs an explicit PRNG "
                "key; pass key=jax.random.key(...) (or call with train=False for eval)"
            )
        noise_std = jax.nn.softplus(x @ self.w_noise[...].astype(jnp.float32))
        eps = jax.random.normal(key, clean.shape, jnp.float32)
        return clean + eps * noise_std

    def __call__(self, x_ND, *, train: bool = False, key=None,
                 top_k: int | None = None) -> RouterOutput:
        """Route ``x[..., D]``; ``top_k`` overrides the constructed k for this call."""
        logits = self.logits(x_ND, train=train, key=key)
        return top_k_gates(logits, top_k or self.top_k, renormalize=True)
