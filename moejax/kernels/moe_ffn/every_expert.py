"""Every expert on every token, summed with per-(token, expert) weights: the dense form of an
MoE layer, ``y_N[n] = sum_e weights_NE[n, e] * E_e(x_N[n])`` with the stacked expert FFNs
``E_e(x) = act(x W_gate[e]) * (x W_up[e]) @ W_down[e]`` (gated) or ``act(x W_up[e]) @
W_down[e]``, weights ``[E, D, F]`` / ``[E, F, D]``.

It is the oracle of the sparse paths and the form that costs least where a few tokens meet
every expert (a decode step of a dense-path model). The product's layout follows the token
count: fewer tokens than an expert's width run one product per expert on the tokens copied
``E`` times (``[E, N, D]``, small), which reads the stacked weights as stored, and weight the
experts' outputs ``[E, N, D]`` after the down product; more tokens
(training) run one product over ``[D, E F]``, for which XLA lays the up-projection's weights
out again: a copy of them per call, a small part of a training step, but as many bytes as the
product itself reads at decode.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["every_expert", "expert_hidden"]


def expert_hidden(x, w_up, w_gate, act: Callable[[jax.Array], jax.Array], spec: str):
    """The experts' hidden activations, ``act(x W_up)`` or (gated) ``act(x W_gate) * (x
    W_up)``, each product ``jnp.einsum(spec, x, w)``."""
    up = jnp.einsum(spec, x, w_up)
    return act(up) if w_gate is None else act(jnp.einsum(spec, x, w_gate)) * up


def every_expert(x_ND, weights_NE, w_up_EDF, w_down_EFD, w_gate_EDF,
                 act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``y_ND`` (module docstring), in the dtype the products give (``x``'s with weights of
    that dtype); ``act`` is the activation function."""
    if x_ND.shape[0] < w_up_EDF.shape[-1]:  # one product per expert: [E, N, D] x [E, D, F]
        x_END = jnp.broadcast_to(x_ND, (w_up_EDF.shape[0], *x_ND.shape))
        h_ENF = expert_hidden(x_END, w_up_EDF, w_gate_EDF, act, "end,edf->enf")
        # the down product as two einsums, the activations on the left: one einsum of three
        # operands puts the weights on the left ([E, D, N] out), which XLA:CPU ran 1.3-1.9x
        # slower for 2-16 tokens on 64 experts of 128 x 1408 (alike on small experts)
        y_END = jnp.einsum("enf,efd->end", h_ENF, w_down_EFD)
        return jnp.einsum("end,ne->nd", y_END, weights_NE.astype(y_END.dtype))
    h_NEF = expert_hidden(x_ND, w_up_EDF, w_gate_EDF, act, "nd,edf->nef")  # [N, D] x [D, E F]
    return jnp.einsum("nef,efd,ne->nd", h_NEF, w_down_EFD, weights_NE.astype(h_NEF.dtype))
