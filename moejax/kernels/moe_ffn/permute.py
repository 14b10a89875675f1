"""Row permutations of dropless MoE dispatch whose gradients are gathers.

Dropless dispatch copies each token's row once per selected expert, in expert order
(``x_ND[order_A // k]``), and after the experts puts the rows back in token order
(``y_SD[inv_A]``). Differentiated as plain indexing, the first becomes a scatter-add of
``N k`` rows into ``N`` (atomics on a GPU, a serial loop on a CPU) and the second a scatter.
Both are permutations with a known inverse, so their transposes are gathers:

* :func:`sort_rows` ``x_ND[order_A // k]``; gradient: ``ct[inv_A]`` summed over each token's
  ``k`` rows;
* :func:`unsort_rows` ``y_SD[inv_A]``; gradient: ``ct[order_A]``.

``order_A`` must be a permutation of ``arange(N k)`` and ``inv_A`` its inverse
(:func:`inverse_permutation`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

__all__ = ["inverse_permutation", "sort_rows", "unsort_rows"]


def inverse_permutation(order_A: jax.Array) -> jax.Array:
    """``inv`` with ``inv[order_A[i]] = i``."""
    return jnp.zeros_like(order_A).at[order_A].set(
        jnp.arange(order_A.shape[0], dtype=order_A.dtype), unique_indices=True)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def sort_rows(x_ND: jax.Array, order_A: jax.Array, inv_A: jax.Array, k: int) -> jax.Array:
    """``x_ND[order_A // k]``: assignment ``a = n k + j`` (token ``n``'s ``j``-th expert) at
    its sorted position; ``[N k, D]``."""
    return x_ND[order_A // k]


def _sort_fwd(x_ND, order_A, inv_A, k):
    return x_ND[order_A // k], inv_A


def _sort_bwd(k, inv_A, ct_SD):
    n_assign, d = ct_SD.shape
    ct_ND = jnp.sum(ct_SD[inv_A].reshape(n_assign // k, k, d), axis=1, dtype=jnp.float32)
    return ct_ND.astype(ct_SD.dtype), None, None


sort_rows.defvjp(_sort_fwd, _sort_bwd)


@jax.custom_vjp
def unsort_rows(y_SD: jax.Array, order_A: jax.Array, inv_A: jax.Array) -> jax.Array:
    """``y_SD[inv_A]``: the sorted rows back in assignment order ``[N k, D]``."""
    return y_SD[inv_A]


def _unsort_fwd(y_SD, order_A, inv_A):
    return y_SD[inv_A], order_A


def _unsort_bwd(order_A, ct_AD):
    return ct_AD[order_A], None, None


unsort_rows.defvjp(_unsort_fwd, _unsort_bwd)
