"""Teacher routing modes for distillation from an MoE ("Every Expert Matters", Sec. 4),
applied to a copy of the teacher, never to the trained teacher itself.

:class:`RoutingMode` picks, per MoE layer and token, which experts mix and with which weights,
from the router's logits ``H`` (clean ``x W_g`` at eval; noisy ``x W_g + eps softplus(x
W_noise)`` when called with ``train=True``):

* ``"topk"``: the trained top-k (``top_k`` > 0 overrides k, e.g. for the teacher-k sweep);
* ``"all"`` (ALL): every expert active, weights ``softmax(H)`` over all N logits;
* ``"ka"`` (Knowledge Augmentation): with probability ``ka_lambda`` (per layer and token) N-1
  experts sampled from ``softmax(H)`` without replacement (Gumbel-top-k), otherwise the top
  N-1; weights ``softmax`` over the selected logits (``KA(H, E)`` then softmax, Eq. 3-5).
  Draws come from the layer's key, so M teacher passes with M keys give M augmentations.

:func:`route_with_mode` is the pure function on logits; :func:`with_routing` is the layer
surgery: it rebuilds the model from its graph and state (sharing every parameter array) and
wraps the router of every MoE slot in a :class:`ModeRouter`. The wrapped router keeps the
original as ``inner``, so its parameters (``.../router/inner/w_g``, ``w_noise``) are the
trained teacher's, which is what the Student-Aware Router trains.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import Config, config
from moejax.nn.moe import MoESkeleton
from moejax.nn.router import RouterOutput, top_k_gates

__all__ = ["RoutingMode", "route_with_mode", "ModeRouter", "with_routing", "moe_slots"]


@config
class RoutingMode(Config):
    mode: Literal["topk", "all", "ka"] = "topk"
    top_k: int = 0  # topk only: 0 = as trained
    ka_lambda: float = 0.05  # ka only: probability of sampling the N-1 experts

    def validate(self):
        self._require(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = as trained)")
        self._require(0.0 <= self.ka_lambda <= 1.0,
                      f"ka_lambda={self.ka_lambda} must be in [0, 1]")


def _gumbel_top_k(key, logits_NE, k: int):
    """``k`` indices sampled from ``softmax(logits)`` without replacement (Gumbel-top-k)."""
    g = jax.random.gumbel(key, logits_NE.shape, jnp.float32)
    return jax.lax.top_k(logits_NE + g, k)[1]


def route_with_mode(logits_NE, mode: RoutingMode, *, trained_k: int, renormalize: bool,
                    key=None) -> RouterOutput:
    """The :class:`RouterOutput` of ``mode`` on router logits ``[..., E]``."""
    logits_NE = logits_NE.astype(jnp.float32)
    n_experts = logits_NE.shape[-1]
    if mode.mode == "topk":
        return top_k_gates(logits_NE, mode.top_k or trained_k, renormalize=renormalize)
    if mode.mode == "all":
        return top_k_gates(logits_NE, n_experts, renormalize=True)
    if key is None:
        raise ValueError("routing mode 'ka' samples experts and needs a PRNG key; pass key= "
                         "to the teacher's forward")
    if n_experts < 2:
        raise ValueError("routing mode 'ka' keeps N-1 experts and needs N >= 2 experts")
    k_coin, k_draw = jax.random.split(key)
    top_ids = jax.lax.top_k(logits_NE, n_experts - 1)[1]
    drawn_ids = _gumbel_top_k(k_draw, logits_NE, n_experts - 1)
    coin = jax.random.bernoulli(k_coin, mode.ka_lambda, logits_NE.shape[:-1])
    ids_NK = jnp.where(coin[..., None], drawn_ids, top_ids).astype(jnp.int32)
    weights_NK = jax.nn.softmax(jnp.take_along_axis(logits_NE, ids_NK, axis=-1), axis=-1)
    return RouterOutput(ids_NK, weights_NK, jax.nn.softmax(logits_NE, axis=-1), logits_NE)


class ModeRouter(nnx.Module):
    """A router that computes ``inner``'s logits and selects experts by ``mode``."""

    def __init__(self, inner: nnx.Module, mode: RoutingMode):
        self.inner, self.mode = inner, mode
        self.top_k = inner.top_k
        self.renormalize = getattr(inner, "renormalize", True)

    def logits(self, x_ND, *, train: bool = False, key=None):
        return self.inner.logits(x_ND, train=train, key=key)

    def __call__(self, x_ND, *, train: bool = False, key=None,
                 top_k: int | None = None) -> RouterOutput:
        k_noise = k_mode = None
        if key is not None:
            k_noise, k_mode = jax.random.split(key)
        logits = self.inner.logits(x_ND, train=train, key=k_noise)
        return route_with_mode(logits, self.mode, trained_k=top_k or self.top_k,
                               renormalize=self.renormalize, key=k_mode)


def moe_slots(model: nnx.Module) -> list[MoESkeleton]:
    """Every top-k MoE slot of ``model`` in module order (BlockFFN / ReMoE slots excluded)."""
    return [m for _, m in nnx.iter_modules(model)
            if isinstance(m, MoESkeleton) and m.top_k_routing]


def with_routing(model: nnx.Module, mode: RoutingMode) -> nnx.Module:
    """A copy of ``model`` (same parameter arrays) whose MoE slots route by ``mode``; raises
    when the model has no MoE slot. ``model`` itself is left as it is."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state, copy=True)  # new Variables over the same arrays
    slots = moe_slots(out)
    if not slots:
        raise ValueError(f"{type(model).__name__} has no MoE slot to reroute; routing modes "
                         "apply to MoE teachers")
    for slot in slots:
        inner = slot.router.inner if isinstance(slot.router, ModeRouter) else slot.router
        slot.router = ModeRouter(inner, mode)
        if mode.mode != "topk":  # the dispatch sees the mode's k (N or N-1 experts)
            slot.top_k = inner.top_k
    return out
