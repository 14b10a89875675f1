"""Rotary position embeddings (RoPE) in the two layouts found in checkpoints.

Frequencies: ``theta_i = base ** (-2 i / J)`` for ``i in [0, J/2)``; a token at position
``p`` rotates pair ``i`` by the angle ``p * theta_i``.

* ``style="interleaved"``: pair ``i`` is head dims ``(2i, 2i+1)`` (Meta's original / GGUF
  layout).
* ``style="half"``: pair ``i`` is head dims ``(i, i + J/2)`` (``rotate_half``; HF Llama /
  GPT-NeoX layout).

The two agree under the permutation :func:`half_to_interleaved_perm`: if
``x_half = x_inter[..., perm]`` then ``apply_rope(x_half, style="half") ==
apply_rope(x_inter, style="interleaved")[..., perm]``.

No parameters. The rotation is computed in float32 and cast back to ``x``'s dtype.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RopeStyle", "rope_frequencies", "apply_rope", "half_to_interleaved_perm"]

RopeStyle = Literal["interleaved", "half"]


def rope_frequencies(head_dim: int, base: float) -> jax.Array:
    """``[J/2]`` float32 inverse frequencies ``base ** (-2i/J)``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}; pick an even head_dim")
    return 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def half_to_interleaved_perm(head_dim: int) -> np.ndarray:
    """Index array ``perm`` with ``x_half = x_interleaved[..., perm]`` (evens, then odds)."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def apply_rope(x_BTHJ: jax.Array, positions_BT: jax.Array, *, base: float,
               style: str) -> jax.Array:
    """Rotate ``x_BTHJ`` ([batch, time, heads, head_dim]) by token positions ``positions_BT``."""
    J = x_BTHJ.shape[-1]
    inv_freq = rope_frequencies(J, base)  # [J/2]
    angle = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, J/2]
    cos = jnp.cos(angle)[:, :, None, :]
    sin = jnp.sin(angle)[:, :, None, :]
    x = x_BTHJ.astype(jnp.float32)
    if style == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        r1 = x1 * cos - x2 * sin
        r2 = x1 * sin + x2 * cos
        out = jnp.stack([r1, r2], axis=-1).reshape(x.shape)
    elif style == "half":
        x1, x2 = x[..., : J // 2], x[..., J // 2:]
        r1 = x1 * cos - x2 * sin
        r2 = x1 * sin + x2 * cos
        out = jnp.concatenate([r1, r2], axis=-1)
    else:
        raise ValueError(f"unknown RoPE style {style!r}; use 'interleaved' or 'half'")
    return out.astype(x_BTHJ.dtype)
