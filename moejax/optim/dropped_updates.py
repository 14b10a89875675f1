"""DARE on optimiser updates (communication-efficient / federated deltas).

Each step, every update entry is dropped independently w.p. ``p`` and survivors are
rescaled by ``1/q`` (``q = 1 - p`` by default, unbiased; ``q > 1-p`` = DAREx-q)::

    u'_ij = m_ij u_ij / q,   m_ij ~ Bernoulli(1 - p)

The PRNG key lives in the state and is split every step, so the transformation is
pure and reproducible (same seed -> same masks). Masks come from the counter-based hash of
:mod:`moejax.delta.hash_mask` by default (``rng="hash"``: a few integer ops per entry, at
memory speed); ``rng="threefry"`` draws them with ``jax.random.bernoulli`` (slower on CPU, and
other masks for the same key).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moejax.delta.dare import rescale
from moejax.delta.hash_mask import hash_bits

__all__ = ["DareUpdatesState", "dare_updates"]


class DareUpdatesState(NamedTuple):
    """PRNG key for the next step's drop masks."""

    key: jax.Array


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _keep(key, p, shape, rng: str):
    if rng == "threefry":
        return jax.random.bernoulli(key, 1.0 - p, shape)
    # P(keep) = P(h >= p 2^32); the threshold is computed in float32 so p may be traced
    # (clamped below 2^32, the largest float32 that fits a uint32 is 2^32 - 256)
    thr = jnp.minimum(jnp.asarray(p, jnp.float32) * 4294967296.0, 4294967040.0)
    return hash_bits(key, shape) >= thr.astype(jnp.uint32)


def dare_updates(
    p: float, key: jax.Array | int, *, q: float | None = None,
    rng: Literal["hash", "threefry"] = "hash",
) -> optax.GradientTransformation:
    """Drop-and-rescale transformation; chain after the optimiser to sparsify its deltas.

    ``key``: a PRNG key or an integer seed (Python or numpy). ``p`` and ``q`` may be traced
    (``optax.inject_hyperparams(dare_updates, static_args="key")(p=schedule, key=0)``); they
    are range-checked when they are concrete.
    """
    if _is_concrete(p) and not (math.isfinite(float(p)) and 0.0 <= float(p) < 1.0):
        raise ValueError(f"dare_updates: p={p} must be in [0, 1).")
    q = 1.0 - p if q is None else q
    if _is_concrete(q) and not (math.isfinite(float(q)) and float(q) > 0):
        raise ValueError(f"dare_updates: q={q} must be finite and > 0.")
    if rng not in ("hash", "threefry"):
        raise ValueError(f"dare_updates: rng={rng!r}; use 'hash' or 'threefry'")
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        if not 0 <= int(key) < 2**32:  # a JAX key keeps the low 32 bits: 2**32 would be 0
            raise ValueError(f"dare_updates: seed key={key} must be in [0, 2**32)")
        key = jax.random.PRNGKey(int(key))
    key0 = key

    def init_fn(params):
        del params
        return DareUpdatesState(key0)

    def update_fn(updates, state, params=None):
        del params
        next_key, step_key = jax.random.split(state.key)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        out = []
        for i, u in enumerate(leaves):
            if not jnp.issubdtype(u.dtype, jnp.floating):
                raise ValueError(f"dare_updates: update leaf {i} is {u.dtype}; DARE rescales "
                                 "by 1/q and needs floating updates.")
            keep = _keep(jax.random.fold_in(step_key, i), p, u.shape, rng)
            out.append(jnp.where(keep, rescale(u, q), jnp.zeros((), u.dtype)))
        return jax.tree_util.tree_unflatten(treedef, out), DareUpdatesState(next_key)

    return optax.GradientTransformation(init_fn, update_fn)
