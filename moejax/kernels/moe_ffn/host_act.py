"""FFN activations and their derivatives in numpy, written into caller-owned buffers.

The host expert kernels (:mod:`moejax.kernels.moe_ffn.host`) evaluate ``act`` and ``act'`` on one
expert's ``[rows, F]`` block at a time. Every step writes into a buffer the caller owns
(``out=``): a fresh array per step would cost a page fault per 4 KiB touched, which costs more
than the arithmetic on those floats. The functions match :mod:`jax.nn`'s (``silu``, exact and
tanh ``gelu``, ``relu`` with derivative 0 at 0) to float32 rounding; tested against
``jax.grad``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["HOST_ACTIVATIONS", "base_activation", "act_into"]

HOST_ACTIVATIONS = ("swiglu", "geglu", "gelu", "gelu_tanh", "relu", "swish")
_GATED_BASE = {"swiglu": "swish", "geglu": "gelu"}
_C = np.float32(math.sqrt(2 / math.pi))
_A = np.float32(0.044715)


# Abramowitz & Stegun 7.1.26: erfc(z) = poly(t) exp(-z^2), t = 1 / (1 + p z), z >= 0, with
# |error| <= 1.5e-7 (float32's own rounding is 6e-8): seven times faster than scipy's erf here,
# which evaluates it in double precision.
_AS_P = np.float32(0.3275911)
_AS_POLY = tuple(np.float32(c) for c in (1.061405429, -1.453152027, 1.421413741, -0.284496736,
                                         0.254829592))


def _normal_cdf_into(g: np.ndarray, out: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> None:
    """``out = Phi(g) = (1 + erf(g / sqrt 2)) / 2``; ``s1``, ``s2`` scratch; ``g`` not written.
    With ``c = erfc(|g| / sqrt 2) / 2``: ``Phi = 1/2 + sign(g) (1/2 - c)``."""
    np.multiply(np.abs(g, out=s1), np.float32(1 / math.sqrt(2)), out=s1)   # z = |g| / sqrt 2
    np.multiply(s1, _AS_P, out=s2)
    s2 += 1
    np.reciprocal(s2, out=s2)                                               # t
    np.square(s1, out=s1)
    np.negative(s1, out=s1)
    np.exp(s1, out=s1)                                                      # exp(-z^2)
    np.multiply(s2, _AS_POLY[0], out=out)
    for c in _AS_POLY[1:]:                                                  # Horner in t
        out += c
        out *= s2
    out *= s1
    out *= 0.5                                                              # c
    np.subtract(np.float32(0.5), out, out=out)
    np.copysign(out, g, out=out)
    out += np.float32(0.5)


def base_activation(activation: str) -> str:
    """The pointwise function of an FFN activation: swiglu -> swish, geglu -> gelu."""
    if activation not in HOST_ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; allowed: {HOST_ACTIVATIONS}")
    return _GATED_BASE.get(activation, activation)


def act_into(name: str, g: np.ndarray, a: np.ndarray, d: np.ndarray | None,
             tmp: np.ndarray, tmp2: np.ndarray) -> None:
    """``a = act(g)`` and, when ``d`` is given, ``d = act'(g)``; ``name`` is a base activation
    (:func:`base_activation`). All arrays float32 of ``g``'s shape; ``tmp`` and ``tmp2`` are
    scratch; ``g`` is not written."""
    with np.errstate(over="ignore"):
        if name == "swish":
            np.negative(g, out=tmp)
            np.exp(tmp, out=tmp)                   # inf for g < -88: sigmoid -> 0, as it should
            tmp += 1
            np.reciprocal(tmp, out=tmp)            # sigmoid(g)
            np.multiply(g, tmp, out=a)
            if d is not None:                      # silu' = sig + silu (1 - sig)
                np.subtract(1, tmp, out=d)
                d *= a
                d += tmp
        elif name == "relu":
            np.maximum(g, 0, out=a)
            if d is not None:
                np.greater(g, 0, out=d, casting="unsafe")
        elif name == "gelu":
            _normal_cdf_into(g, tmp, a, tmp2)      # Phi(g)
            np.multiply(g, tmp, out=a)
            if d is not None:                      # Phi(g) + g phi(g)
                np.square(g, out=d)
                d *= -0.5
                np.exp(d, out=d)
                d *= g
                d *= np.float32(1 / math.sqrt(2 * math.pi))
                d += tmp
        elif name == "gelu_tanh":
            np.square(g, out=tmp2)
            np.multiply(tmp2, _A, out=tmp)
            tmp += 1
            tmp *= g
            tmp *= _C
            np.tanh(tmp, out=tmp)                  # t = tanh(c (g + 0.044715 g^3))
            np.add(tmp, 1, out=a)
            a *= g
            a *= 0.5                               # 0.5 g (1 + t)
            if d is not None:                      # 0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 A g^2)
                np.square(tmp, out=d)
                np.subtract(1, d, out=d)
                d *= g
                tmp2 *= 3 * _A
                tmp2 += 1
                d *= tmp2
                d *= 0.5 * _C
                tmp += 1
                tmp *= 0.5
                d += tmp
        else:
            raise ValueError(f"act_into: unknown base activation {name!r}")
