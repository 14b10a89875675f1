"""FFN activation functions shared by dense FFNs, MoE experts and BlockFFN experts.

``ACTIVATIONS`` maps a name to ``(fn, gated)``: a gated FFN computes
``act(x W_gate) * (x W_up)`` (SwiGLU = gated swish, GeGLU = gated gelu), a non-gated one
``act(x W_up)``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["ActivationName", "ACTIVATIONS", "activation_fn", "is_gated"]

ActivationName = Literal["swiglu", "geglu", "gelu", "gelu_tanh", "relu", "swish"]


def _gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {
    "swiglu": (jax.nn.silu, True),
    "geglu": (_gelu_exact, True),
    "gelu": (_gelu_exact, False),
    "gelu_tanh": (_gelu_tanh, False),
    "relu": (jax.nn.relu, False),
    "swish": (jax.nn.silu, False),
}


def activation_fn(name: str):
    try:
        return ACTIVATIONS[name][0]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; allowed: {sorted(ACTIVATIONS)}") from None


def is_gated(name: str) -> bool:
    try:
        return ACTIVATIONS[name][1]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; allowed: {sorted(ACTIVATIONS)}") from None


def relu(x):  # convenience re-export used by routers
    return jnp.maximum(x, 0)
