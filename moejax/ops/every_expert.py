"""Every expert on every token, summed with per-(token, expert) weights: the dense form of an
MoE layer, ``y_N[n] = sum_e weights_NE[n, e] * E_e(x_N[n])`` with the stacked expert FFNs
``E_e(x) = act(x W_gate[e]) * (x W_up[e]) @ W_down[e]`` (gated) or ``act(x W_up[e]) @
W_down[e]``, weights ``[E, D, F]`` / ``[E, F, D]``.

It is the oracle of the sparse paths and the form that costs least where a few tokens meet
every expert (a decode step of a dense-path model). The product's layout follows the token
count: fewer tokens than an expert's width run one product per expert on the tokens copied
``E`` times (``[E, N, D]``, small), which reads the stacked weights as stored; more tokens
(training) run one product over ``[D, E F]``, for which XLA lays the up-projection's weights
out again: a copy of them per call, a small part of a training step, but as many bytes as the
product itself reads at decode.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["every_expert"]


def every_expert(x_ND, weights_NE, w_up_EDF, w_down_EFD, w_gate_EDF,
                 act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``y_ND`` (module docstring), in the dtype the products give (``x``'s with weights of
    that dtype); ``act`` is the activation function."""
    N, E, F = x_ND.shape[0], w_up_EDF.shape[0], w_up_EDF.shape[-1]
    if N < F:  # one product per expert: [E, N, D] x [E, D, F]
        x, spec, combine = jnp.broadcast_to(x_ND, (E, N, x_ND.shape[1])), "end,edf->enf", (
            "enf,efd,ne->nd")
    else:  # one product: [N, D] x [D, E F]
        x, spec, combine = x_ND, "nd,edf->nef", "nef,efd,ne->nd"
    up = jnp.einsum(spec, x, w_up_EDF)
    h = act(up) if w_gate_EDF is None else act(jnp.einsum(spec, x, w_gate_EDF)) * up
    return jnp.einsum(combine, h, w_down_EFD, weights_NE.astype(h.dtype))
