"""k-bit quantisation in jnp: the same three schemes and blockings as
:mod:`moejax.delta.quant` (whose numpy float64 functions are the oracle), computed in one
jitted pass over each leaf, so it runs on any device, under ``jit`` and on sharded arrays.

* :func:`fake_quantize` -> ``x^`` (quantise then dequantise; what a compressed model computes
  with), in the leaf's dtype;
* :func:`quantize_codes` -> ``(codes uint8, step, offset)`` with the shapes of
  :class:`~moejax.delta.quant.QuantizedLeaf`'s fields, for storage.

Arithmetic is float32 (the oracle's is float64): codes agree except for entries that sit
within float32 rounding of a cell boundary (tested: at most a few per million).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.delta.quant import num_levels

__all__ = ["fake_quantize", "quantize_codes", "fake_quantize_tree"]


def _blocked(x, granularity: str, group_size: int, in_axis: int):
    if granularity == "tensor" or x.ndim < 2:
        if granularity == "group" and x.ndim < 2:
            raise ValueError(f"group quantisation needs a matrix leaf, got shape {x.shape}.")
        return x.reshape(1, -1, 1)
    if granularity not in ("channel", "group"):
        raise ValueError(f"granularity={granularity!r}; use 'tensor', 'channel' or 'group'.")
    xm = jnp.moveaxis(x, in_axis, -2)
    d_in = xm.shape[-2]
    g = d_in if granularity == "channel" else min(group_size, d_in)
    if d_in == 0:  # an empty matrix: one empty block per output channel
        return xm.reshape(xm.shape[:-2] + (1, 0, xm.shape[-1]))
    if g <= 0 or d_in % g:
        raise ValueError(f"group_size={group_size} must divide d_in={d_in} (axis {in_axis}); "
                         "pick a divisor or use granularity='channel'.")
    return xm.reshape(xm.shape[:-2] + (d_in // g, g, xm.shape[-1]))


def _unblocked(xb, shape, granularity: str, in_axis: int):
    if granularity == "tensor" or len(shape) < 2:
        return xb.reshape(shape)
    ax = in_axis % len(shape)
    moved = list(shape)
    moved.insert(len(shape) - 2, moved.pop(ax))  # the moveaxis(x, ax, -2) shape
    return jnp.moveaxis(xb.reshape(moved), -2, ax)


def _block_stat(fn, xb):
    """``fn`` over each block (axis -2, kept); 0 for an empty block (an empty leaf)."""
    if xb.shape[-2] == 0:
        return jnp.zeros(xb.shape[:-2] + (1,) + xb.shape[-1:], xb.dtype)
    return fn(xb, axis=-2, keepdims=True)


@functools.partial(jax.jit, static_argnames=("bits", "scheme", "granularity", "group_size",
                                             "in_axis"))
def quantize_codes(x, bits: int, *, scheme: str = "midrise", granularity: str = "group",
                   group_size: int = 64, in_axis: int = -2):
    """``(codes, step, offset)``: uint8 codes of ``x``'s shape, float32 per-block step and
    offset (block shape, as in :class:`~moejax.delta.quant.QuantizedLeaf`)."""
    if scheme not in ("midrise", "symmetric", "asymmetric"):
        raise ValueError(f"scheme={scheme!r}; use 'midrise', 'symmetric' or 'asymmetric'.")
    xb = _blocked(jnp.asarray(x).astype(jnp.float32), granularity, group_size, in_axis)
    if scheme == "midrise":
        num_levels(bits, True)
        levels = 2**bits
        if bits == 1:
            step = 2.0 * _block_stat(jnp.mean, jnp.abs(xb))
        else:
            step = 2.0 * _block_stat(jnp.max, jnp.abs(xb)) / levels
        safe = jnp.where(step > 0, step, 1.0)
        codes = jnp.clip(jnp.floor(xb / safe + levels / 2.0), 0, levels - 1)
        offset = -(levels - 1) / 2.0 * step
    else:
        levels = num_levels(bits, scheme == "symmetric")
        if scheme == "symmetric":
            step = 2.0 * _block_stat(jnp.max, jnp.abs(xb)) / (levels - 1)
            offset = -(levels - 1) / 2.0 * step
        else:
            lo, hi = _block_stat(jnp.min, xb), _block_stat(jnp.max, xb)
            step, offset = (hi - lo) / (levels - 1), lo
        safe = jnp.where(step > 0, step, 1.0)
        codes = jnp.clip(jnp.rint((xb - offset) / safe), 0, levels - 1)
    codes = _unblocked(codes.astype(jnp.uint8), jnp.shape(x), granularity, in_axis)
    return codes, step, offset


@functools.partial(jax.jit, static_argnames=("bits", "scheme", "granularity", "group_size",
                                             "in_axis"))
def fake_quantize(x, bits: int, *, scheme: str = "midrise", granularity: str = "group",
                  group_size: int = 64, in_axis: int = -2):
    """``x^`` = dequantise(quantise(``x``)) in one pass, in ``x``'s dtype."""
    codes, step, offset = quantize_codes(x, bits, scheme=scheme, granularity=granularity,
                                         group_size=group_size, in_axis=in_axis)
    cb = _blocked(codes.astype(jnp.float32), granularity, group_size, in_axis)
    xb = offset + cb * step
    return _unblocked(xb, jnp.shape(x), granularity, in_axis).astype(jnp.asarray(x).dtype)


def fake_quantize_tree(tree, bits: int, *, mask=None, **kw):
    """:func:`fake_quantize` every selected leaf (``mask``: aligned bools; others unchanged)."""
    sel = jax.tree_util.tree_map(lambda _: True, tree) if mask is None else mask
    return jax.tree_util.tree_map(lambda x, s: fake_quantize(x, bits, **kw) if s else x,
                                  tree, sel)
