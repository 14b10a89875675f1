"""Every FFN activation in its three forms, in one table, tested against each other:

* ``jax``: :func:`moejax.ops.activations.activation_fn` (``jax.nn``), for XLA's paths;
* ``kernel``: the same function in primitives every kernel backend lowers (no ``custom_jvp``
  as in ``jax.nn``; exact GELU through an ``erf`` of ``exp`` and a polynomial, Abramowitz &
  Stegun 7.1.26, ``|error| <= 1.5e-7``, float32's own resolution), for the Pallas kernels;
* ``host``: the pointwise base the numpy host kernels evaluate with its derivative into
  caller-owned buffers (:func:`moejax.kernels.moe_ffn.host_act.act_into`; swiglu -> swish,
  geglu -> gelu);

and whether the FFN is gated (``act(x W_gate) * (x W_up)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

from moejax.kernels.moe_ffn.host_act import base_activation
from moejax.ops.activations import ACTIVATIONS, activation_fn

__all__ = ["ActivationForms", "ACTIVATION_FORMS", "kernel_activation"]

_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x):
    """erf from exp and a polynomial: Mosaic lowers these (not ``erf`` itself)."""
    t = 1.0 / (1.0 + _ERF_P * jnp.abs(x))
    poly = t * (_ERF_A[0] + t * (_ERF_A[1] + t * (_ERF_A[2] + t * (_ERF_A[3] + t * _ERF_A[4]))))
    y = 1.0 - poly * jnp.exp(-x * x)
    return jnp.where(x < 0, -y, y)


def _erf_gelu(x):
    return 0.5 * x * (1.0 + _erf(x * 0.7071067811865476))


def _tanh_gelu_formula(x):
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _exp_silu(x):
    return x / (1.0 + jnp.exp(-x))


def _max_relu(x):
    return jnp.maximum(x, 0.0)


_KERNEL = {"relu": _max_relu, "swish": _exp_silu, "swiglu": _exp_silu, "gelu": _erf_gelu,
           "geglu": _erf_gelu, "gelu_tanh": _tanh_gelu_formula}


class ActivationForms(NamedTuple):
    """One activation's forms (module docstring)."""

    jax: Callable
    kernel: Callable
    host: str
    gated: bool


ACTIVATION_FORMS = {name: ActivationForms(activation_fn(name), _KERNEL[name],
                                          base_activation(name), gated)
                    for name, (_, gated) in ACTIVATIONS.items()}


def kernel_activation(name: str) -> Callable:
    """The activation as a kernel computes it (the table's ``kernel`` column)."""
    activation_fn(name)  # an unknown name fails here, naming the allowed ones
    return ACTIVATION_FORMS[name].kernel
