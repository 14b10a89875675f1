"""LoRA on selected matrices of any parameter pytree (init, apply, merge).

For a selected matrix ``W: [..., d_in, d_out]`` (``y = x @ W``)::

    W' = W + s * A @ B,   A: [..., d_in, r] ~ N(0, 1/d_in),  B: [..., r, d_out] = 0,
    s = alpha / r

so ``Delta_LoRA = s A B``. LoRA + DAREx-q as in the paper prunes the LoRA parameters
themselves: DARE on the entries of ``A`` and ``B`` at rate ``p`` with rescaling ``1/q``
(:func:`lora_dare`; :func:`lora_factor_pruner` for the q searches of
:mod:`moejax.delta.dare`). Pruning the merged delta instead,
``dare(key, lora_delta(params, lora), p, q=...)``, stays an option. Unselected leaves carry
``None``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from moejax.config import check_count
from moejax.delta.dare import dare
from moejax.delta.tree import apply_delta, per_leaf_keys

__all__ = ["LoraFactors", "lora_init", "lora_delta", "lora_apply", "lora_merge", "lora_num_params",
           "lora_dare", "lora_factor_pruner"]

PyTree = Any
_is_lora = lambda x: x is None or isinstance(x, LoraFactors)  # noqa: E731


class LoraFactors(NamedTuple):
    """Low-rank factors ``a: [..., d_in, r]`` and ``b: [..., r, d_out]``."""

    a: jax.Array
    b: jax.Array


def lora_init(key: jax.Array, params: PyTree, mask: PyTree, rank: int, *, dtype=None) -> PyTree:
    """LoRA factors for every selected matrix leaf (``None`` elsewhere).

    ``A ~ N(0, 1/d_in)`` (key ``fold_in(key, leaf_index)``), ``B = 0`` so the initial
    delta is exactly zero.
    """
    check_count("lora_init: rank", rank, 1)
    keys = per_leaf_keys(key, params)

    def make(w, m, k):
        if not m:
            return None
        if jnp.ndim(w) < 2:
            raise ValueError(
                f"LoRA needs matrix leaves, got shape {jnp.shape(w)}; deselect it in mask."
            )
        *lead, d_in, d_out = jnp.shape(w)
        dt = dtype or jnp.result_type(w)
        a = (jax.random.normal(k, (*lead, d_in, rank), jnp.float32) / jnp.sqrt(d_in)).astype(dt)
        return LoraFactors(a, jnp.zeros((*lead, rank, d_out), dt))

    return jax.tree_util.tree_map(make, params, mask, keys)


def lora_delta(params: PyTree, lora: PyTree, alpha: float | None = None) -> PyTree:
    """Full-shape delta tree ``Delta = (alpha/r) A @ B`` (zeros where ``lora`` is None).

    ``alpha=None`` means ``alpha = r`` (scale 1).
    """

    def one(w, f):
        if f is None:
            return jnp.zeros(jnp.shape(w), jnp.result_type(w))
        r = f.a.shape[-1]
        s = 1.0 if alpha is None else alpha / r
        return (s * jnp.matmul(f.a, f.b)).astype(jnp.result_type(w))

    return jax.tree_util.tree_map(one, params, lora, is_leaf=_is_lora)


def lora_apply(params: PyTree, lora: PyTree, alpha: float | None = None) -> PyTree:
    """Effective weights ``W + s A B`` (differentiable in ``lora``; use inside the loss)."""
    return apply_delta(params, lora_delta(params, lora, alpha))


def lora_merge(params: PyTree, lora: PyTree, alpha: float | None = None) -> tuple[PyTree, PyTree]:
    """Merge for deployment: returns ``(merged_params, delta)`` with ``merged = W + delta``."""
    d = lora_delta(params, lora, alpha)
    return apply_delta(params, d), d


def lora_num_params(lora: PyTree) -> int:
    """Trainable LoRA entries ``sum r (d_in + d_out)`` (times any leading stack axes)."""
    return int(sum(x.size for x in jax.tree_util.tree_leaves(lora)))


def lora_dare(key: jax.Array, lora: PyTree, p: float, *, q: float | None = None) -> PyTree:
    """DARE on the LoRA parameters: every entry of every ``A`` and ``B`` is dropped with
    probability ``p``, survivors divided by ``q`` (default ``1 - p``; DAREx-q tunes it)."""
    return dare(key, lora, p, q=q)


def lora_factor_pruner(params: PyTree, p: float, alpha: float | None = None):
    """``pruner(key, lora, q) -> full-shape delta`` of the factor-pruned LoRA, for
    ``search_q_v`` / ``search_q_e`` (pass the LoRA factors as their ``delta_tree``)."""
    return lambda key, lora, q: lora_delta(params, lora_dare(key, lora, p, q=q), alpha)
