"""k-bit quantisation of delta parameters, bits 1..8. Three schemes:

``"midrise"`` (per block, ``A = max |x|``, ``L = 2^b`` levels, none at 0): the range
``[-A, A]`` is cut into ``L`` equal cells and each entry is coded by its cell, reconstructed at
the cell's centre; at 1 bit the code is the sign and the scale the block's mean ``|x|`` (the
L2-optimal scale for a sign code, so the error is below that of dropping ``x``)::

    step = 2A / L  (b >= 2),   step = 2 mean|x|  (b = 1),
    code = clip(floor(x/step + L/2), 0, L-1),   x^ = (code - (L-1)/2) * step

``"symmetric"`` (round to nearest; ``L = 2^b - 1`` odd levels incl. 0 for b >= 2, ``L = 2``
levels ``{-A, +A}`` for b = 1; one level is spent on 0, so 2 bits give {-A, 0, A})::

    step = 2A / (L - 1),  code = clip(round(x/step + (L-1)/2), 0, L-1),
    x^ = (code - (L-1)/2) * step

``"asymmetric"`` (round to nearest, ``lo = min x``, ``hi = max x``, ``L = 2^b`` levels)::

    step = (hi - lo) / (L - 1),  code = clip(round((x - lo)/step), 0, L-1),
    x^ = lo + code * step

so ``|x - x^| <= step/2`` for every entry (also for ``"midrise"`` at b >= 2). Blocks
("granularity"): ``"tensor"`` (one scale per leaf), ``"channel"`` (one per output channel,
reducing over ``in_axis``), or ``"group"`` (contiguous groups of ``group_size`` entries along
``in_axis`` per output channel; a group longer than the column is the column). Codes are
uint8 in ``[0, L-1]``; see :mod:`moejax.delta.storage` for packing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from moejax.delta.tree import map_selected

__all__ = [
    "QuantizedLeaf",
    "quantize",
    "block_shape",
    "dequantize",
    "quantize_tree",
    "dequantize_tree",
    "num_levels",
]

Granularity = Literal["tensor", "channel", "group"]
Scheme = Literal["midrise", "symmetric", "asymmetric"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "step", "offset"],
    meta_fields=["bits", "symmetric", "granularity", "group_size", "in_axis", "dtype",
                 "levels"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
    """Codes ``[...]`` (uint8, original shape), block ``step`` and ``offset`` arrays
    (block shape, broadcastable after grouping), and the static settings.

    ``symmetric``: centred codes, ``x^ = (code - (L-1)/2) step`` (no offset stored);
    ``levels``: ``L`` (0 = :func:`num_levels` of the legacy schemes; ``2^b`` for midrise).

    A registered pytree: the three arrays are its children, the settings static metadata, so
    quantised trees pass through ``jax.tree`` functions and ``jax.jit``."""

    codes: np.ndarray
    step: np.ndarray
    offset: np.ndarray
    bits: int
    symmetric: bool
    granularity: str
    group_size: int
    in_axis: int
    dtype: str
    levels: int = 0

    @property
    def n_levels(self) -> int:
        return self.levels or num_levels(self.bits, self.symmetric)


def num_levels(bits: int, symmetric: bool) -> int:
    """Number of representable values: ``2^b`` (asymmetric), ``max(2, 2^b - 1)`` (symmetric)."""
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits={bits!r}: delta quantisation supports integer bits 1..8.")
    return 2**bits if not symmetric else max(2, 2**bits - 1)


def _blocked(x: np.ndarray, granularity: str, group_size: int, in_axis: int):
    """View ``x`` as ``[..., G, g, d_out]`` (reduce axis -2) or ``[1, n]`` for tensor; the
    blocks of :func:`block_shape`."""
    blocks = block_shape(x.shape, granularity, group_size, in_axis)
    if granularity == "tensor" or x.ndim < 2:
        return x.reshape(1, -1, 1)
    xm = np.moveaxis(x, in_axis, -2)  # [..., d_in, d_out]
    return xm.reshape(blocks[:-2] + (xm.shape[-2] // blocks[-3],) + blocks[-1:])


def block_shape(shape, granularity: str, group_size: int, in_axis: int) -> tuple[int, ...]:
    """The shape of a leaf's ``step`` (and ``offset``) array: one entry per block of
    :func:`_blocked`'s view of a leaf of ``shape``, the reduced axis kept as 1. Refuses what
    :func:`quantize` refuses (an unknown granularity, a group size that does not divide the
    input width, groups of a vector) and an ``in_axis`` outside the leaf."""
    shape = tuple(int(n) for n in shape)
    if granularity not in ("tensor", "channel", "group"):
        raise ValueError(f"granularity={granularity!r}; use 'tensor', 'channel' or 'group'.")
    if granularity == "tensor" or len(shape) < 2:
        if granularity == "group":
            raise ValueError(f"group quantisation needs a matrix leaf, got shape {shape}.")
        return (1, 1, 1)
    if not -len(shape) <= in_axis < len(shape):
        raise ValueError(f"in_axis={in_axis} is outside a leaf of shape {shape}")
    ax = in_axis % len(shape)
    rest = shape[:ax] + shape[ax + 1:]
    d_in, d_out = shape[ax], rest[-1]
    if d_in == 0:  # an empty matrix: one empty block per output channel
        return rest[:-1] + (1, 1, d_out)
    g = d_in if granularity == "channel" else min(group_size, d_in)
    if g <= 0 or d_in % g:
        raise ValueError(f"group_size={group_size} must divide d_in={d_in} (axis {in_axis}); "
                         "pick a divisor or use granularity='channel'.")
    return rest[:-1] + (d_in // g, 1, d_out)


def _block_stat(fn, xb: np.ndarray) -> np.ndarray:
    """``fn`` over each block (axis -2, kept); 0 for an empty block (an empty leaf, or a pruned
    matrix with no survivors), whose step is then 0 like a block of zeros."""
    if xb.shape[-2] == 0:
        return np.zeros(xb.shape[:-2] + (1,) + xb.shape[-1:])
    return fn(xb, axis=-2, keepdims=True)


def _unblocked(xb: np.ndarray, shape, granularity: str, in_axis: int):
    if granularity == "tensor" or len(shape) < 2:
        return xb.reshape(shape)
    moved = list(shape)
    ax = in_axis % len(shape)
    moved_shape = tuple(np.moveaxis(np.empty(shape, np.int8), ax, -2).shape)
    xm = xb.reshape(moved_shape)
    return np.moveaxis(xm, -2, ax).reshape(moved)


def quantize(
    x,
    bits: int,
    *,
    symmetric: bool = True,
    scheme: Scheme | None = None,
    granularity: Granularity = "channel",
    group_size: int = 64,
    in_axis: int = -2,
) -> QuantizedLeaf:
    """Quantise one finite array to ``bits`` bits (see module docstring for the equations).
    ``scheme`` None = ``"symmetric"`` or ``"asymmetric"`` by the ``symmetric`` flag."""
    scheme = scheme or ("symmetric" if symmetric else "asymmetric")
    if scheme not in ("midrise", "symmetric", "asymmetric"):
        raise ValueError(f"scheme={scheme!r}; use 'midrise', 'symmetric' or 'asymmetric'.")
    x = np.asarray(jax.device_get(x))
    x64 = x.astype(np.float64)
    if not np.isfinite(x64).all():  # a NaN or inf block has no step: every code would be junk
        raise ValueError(f"quantize: {int(np.size(x64) - np.isfinite(x64).sum())} NaN or inf "
                         f"values in an array of shape {x.shape}; quantise a finite delta "
                         "(NaN and inf come from a diverged run)")
    xb = _blocked(x64, granularity, group_size, in_axis)
    if scheme == "midrise":
        return _quantize_midrise(x, xb, bits, granularity, group_size, in_axis)
    symmetric = scheme == "symmetric"
    levels = num_levels(bits, symmetric)
    if symmetric:
        amax = _block_stat(np.max, np.abs(xb))
        step = 2.0 * amax / (levels - 1)
        offset = -(levels - 1) / 2.0 * step
    else:
        lo, hi = _block_stat(np.min, xb), _block_stat(np.max, xb)
        step, offset = (hi - lo) / (levels - 1), lo
    safe = np.where(step > 0, step, 1.0)
    codes = np.clip(np.rint((xb - offset) / safe), 0, levels - 1).astype(np.uint8)
    codes = _unblocked(codes, x.shape, granularity, in_axis)
    return QuantizedLeaf(
        codes,
        step.astype(np.float32),
        offset.astype(np.float32),
        bits,
        symmetric,
        granularity,
        group_size,
        in_axis,
        str(x.dtype),
    )


def _quantize_midrise(x, xb, bits, granularity, group_size, in_axis) -> QuantizedLeaf:
    num_levels(bits, True)  # validates bits
    levels = 2**bits
    if bits == 1:
        step = 2.0 * _block_stat(np.mean, np.abs(xb))
    else:
        step = 2.0 * _block_stat(np.max, np.abs(xb)) / levels
    safe = np.where(step > 0, step, 1.0)
    codes = np.clip(np.floor(xb / safe + levels / 2.0), 0, levels - 1).astype(np.uint8)
    codes = _unblocked(codes, x.shape, granularity, in_axis)
    offset = -(levels - 1) / 2.0 * step
    return QuantizedLeaf(codes, step.astype(np.float32), offset.astype(np.float32), bits, True,
                         granularity, group_size, in_axis, str(x.dtype), levels)


def dequantize(ql: QuantizedLeaf) -> np.ndarray:
    """``x^ = (code - (L-1)/2) step`` (centred: midrise, symmetric) or ``lo + code step``
    (asymmetric)."""
    cb = _blocked(np.asarray(ql.codes), ql.granularity, ql.group_size, ql.in_axis)
    step = ql.step.astype(np.float64)
    if ql.symmetric:  # centred form (symmetric b >= 2 keeps x^ = 0 exactly representable)
        xb = (cb.astype(np.float64) - (ql.n_levels - 1) / 2.0) * step
    else:
        xb = ql.offset.astype(np.float64) + cb.astype(np.float64) * step
    return _unblocked(xb, ql.codes.shape, ql.granularity, ql.in_axis).astype(ql.dtype)


def quantize_tree(delta_tree, bits: int, *, mask=None, **kw) -> Any:
    """:func:`quantize` every selected leaf (others unchanged); returns a mixed pytree."""
    return map_selected(lambda d: quantize(d, bits, **kw), delta_tree, mask)


def dequantize_tree(qtree) -> Any:
    """Inverse of :func:`quantize_tree` (quantised leaves -> arrays)."""
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(dequantize(x)) if isinstance(x, QuantizedLeaf) else x,
        qtree,
        is_leaf=lambda x: isinstance(x, QuantizedLeaf),
    )
