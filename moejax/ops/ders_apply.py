"""DeRS experts applied without synthesising their weights (DeRS, Huang et al. 2025, Sec. 3.4:
``W_i = W_shared + F_pre(Delta_i)``).

Since ``x W_i = x W_shared + x F_pre(Delta_i)``, a token's shared product is computed once
and each of its ``k`` selected experts adds only its increment's product:

* DeRS-SM (``F_pre(Delta_e) = scatter(I_e, V_e)``): ``(x F_pre(Delta_e))[o] = sum of
  x[i] v`` over the ``K`` kept positions ``(i, o)`` of expert ``e`` (a gather and a segment
  sum, ``K`` multiply-adds);
* DeRS-LM (``F_pre(Delta_e) = A_e B_e``): ``(x A_e) B_e``, grouped over the experts
  (:func:`jax.lax.ragged_dot` on the pairs sorted by expert).

The down projection's shared part is applied once to the gate-weighted sum of a token's
hidden vectors. Weights read per token: ``W_shared`` once plus ``k`` increments, instead of
``k`` full expert matrices (vanilla upcycling) or the ``N`` synthesised copies.

For training at capacity, :func:`ders_streamed` runs the experts one at a time over their
``[C, D]`` buffers, each expert's ``W_e`` synthesised inside its scan step and synthesised
again in the backward (``jax.checkpoint``): one expert's weights exist at a time, instead of
all ``N`` copies kept from the forward for the backward.

``y = ders_experts(x_ND, ids_NK, weights_NK, base, deltas, form=..., activation=...)`` with
``base = {"up": W [D, F], "down": [F, D], "gate": [D, F] (gated)}`` and ``deltas[name]`` =
``{"idx": [E, K] flat positions, "v": [E, K]}`` (SM) or ``{"a": [E, d_in, r], "b": [E, r,
d_out]}`` (LM): the same numbers as synthesising every expert and dispatching.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.ops.activations import activation_fn

__all__ = ["ders_experts", "delta_product", "synthesize_one", "ders_streamed"]


def delta_product(form: str, x_PI, e_P, delta: dict, d_out: int):
    """``[P, d_out]``: ``x_p F_pre(Delta_{e_p})`` for every pair ``p`` (row ``x_p``, expert
    ``e_p``)."""
    if form == "sm":
        idx_EK, v_EK = delta["idx"], delta["v"].astype(x_PI.dtype)
        rows_PK, cols_PK = idx_EK[e_P] // d_out, idx_EK[e_P] % d_out
        vals_PK = jnp.take_along_axis(x_PI, rows_PK, axis=1) * v_EK[e_P]
        p = jnp.arange(x_PI.shape[0])[:, None]
        return jnp.zeros((x_PI.shape[0], d_out), x_PI.dtype).at[p, cols_PK].add(vals_PK)
    a, b = delta["a"].astype(x_PI.dtype), delta["b"].astype(x_PI.dtype)
    order = jnp.argsort(e_P, stable=True)
    sizes = jnp.zeros((a.shape[0],), jnp.int32).at[e_P].add(1)
    out = jax.lax.ragged_dot(jax.lax.ragged_dot(x_PI[order], a, sizes), b, sizes)
    return jnp.zeros_like(out).at[order].set(out)


def ders_experts(x_ND, ids_NK, weights_NK, base: dict, deltas: dict, *, form: str,
                 activation: str):
    """``y [N, D] = sum_k w_nk FFN_{e_nk}(x_n)`` with DeRS experts, never materialising an
    expert's weights (module docstring)."""
    N, K = ids_NK.shape
    dt = x_ND.dtype
    act = activation_fn(activation)
    e_P = ids_NK.reshape(-1).astype(jnp.int32)
    tok_P = jnp.repeat(jnp.arange(N), K)
    x_PD = x_ND[tok_P]

    def project(name):
        w = base[name].astype(dt)
        return (x_ND @ w)[tok_P] + delta_product(form, x_PD, e_P, deltas[name], w.shape[1])

    up = project("up")
    h_PF = act(project("gate")) * up if "gate" in base else act(up)
    g_P = weights_NK.reshape(-1).astype(dt)[:, None]
    hw_PF = h_PF * g_P
    w_down = base["down"].astype(dt)
    shared = jax.ops.segment_sum(hw_PF, tok_P, num_segments=N) @ w_down
    inc = delta_product(form, hw_PF, e_P, deltas["down"], w_down.shape[1])
    return shared + jax.ops.segment_sum(inc, tok_P, num_segments=N)


def synthesize_one(form: str, base_IO, delta: dict, e):
    """``W_e = W_shared + F_pre(Delta_e)`` ``[d_in, d_out]`` for one expert ``e`` (may be
    traced)."""
    if form == "sm":
        v_K = delta["v"][e].astype(base_IO.dtype)
        flat = base_IO.reshape(-1).at[delta["idx"][e]].add(v_K, unique_indices=True)
        return flat.reshape(base_IO.shape)
    a, b = delta["a"][e].astype(base_IO.dtype), delta["b"][e].astype(base_IO.dtype)
    return base_IO + a @ b


def ders_streamed(x_ECD, base: dict, deltas: dict, *, form: str, activation: str):
    """``y [E, C, D]``: expert ``e``'s FFN on its buffer ``x_ECD[e]``, the experts one at a
    time with their weights synthesised in the step (and again in the backward)."""
    act = activation_fn(activation)
    dt = x_ECD.dtype

    @jax.checkpoint
    def one(x_CD, e):
        w = {n: synthesize_one(form, base[n], deltas[n], e).astype(dt) for n in base}
        up = x_CD @ w["up"]
        h = act(x_CD @ w["gate"]) * up if "gate" in w else act(up)
        return h @ w["down"]

    _, y_ECD = jax.lax.scan(lambda c, xs: (c, one(*xs)), None,
                            (x_ECD, jnp.arange(x_ECD.shape[0])))
    return y_ECD
