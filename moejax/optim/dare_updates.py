"""DARE on optimiser updates (communication-efficient / federated deltas).

Each step, every update entry is dropped independently w.p. ``p`` and survivors are
rescaled by ``1/q`` (``q = 1 - p`` by default, unbiased; ``q > 1-p`` = DAREx-q)::

    u'_ij = m_ij u_ij / q,   m_ij ~ Bernoulli(1 - p)

The PRNG key lives in the state and is split every step, so the transformation is
pure and reproducible (same seed -> same masks).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["DareUpdatesState", "dare_updates"]


class DareUpdatesState(NamedTuple):
    """PRNG key for the next step's drop masks."""

    key: jax.Array


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def dare_updates(
    p: float, key: jax.Array | int, *, q: float | None = None
) -> optax.GradientTransformation:
    """Drop-and-rescale transformation; chain after the optimiser to sparsify its deltas.

    ``p`` and ``q`` may be traced (``optax.inject_hyperparams(dare_updates,
    static_args="key")(p=schedule, key=0)``); they are range-checked when they are concrete.
    """
    if _is_concrete(p) and not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dare_updates: p={p} must be in [0, 1).")
    q = 1.0 - p if q is None else q
    if _is_concrete(q) and float(q) <= 0:
        raise ValueError(f"dare_updates: q={q} must be > 0.")
    key0 = jax.random.PRNGKey(key) if isinstance(key, int) else key

    def init_fn(params):
        del params
        return DareUpdatesState(key0)

    def update_fn(updates, state, params=None):
        del params
        next_key, step_key = jax.random.split(state.key)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        out = []
        for i, u in enumerate(leaves):
            keep = jax.random.bernoulli(jax.random.fold_in(step_key, i), 1.0 - p, u.shape)
            out.append(jnp.where(keep, u / jnp.asarray(q, u.dtype), jnp.zeros((), u.dtype)))
        return jax.tree_util.tree_unflatten(treedef, out), DareUpdatesState(next_key)

    return optax.GradientTransformation(init_fn, update_fn)
