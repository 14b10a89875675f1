"""A DARE-pruned (and quantised) delta as a checkpoint, and back: what a pruned delta costs to
store (DAREx paper, Sec. 5's storage argument).

Each matrix of the delta (a flat ``{path: array}``, pruned with rate ``p``) is kept, per
``mask``, as the flat positions of its survivors (the smallest unsigned index dtype) and their
values at ``bits`` (32 float32, 16 bfloat16, at most 8: symmetric codes with one scale for the
matrix); with ``p = 0`` the matrix itself (16 / 32 bits, or per-channel codes). The leaves off
the mask stay dense float32. :func:`encode_pruned` returns a
:class:`~moejax.delta.storage.StoredDelta` (its bytes exact; ``save`` / ``load`` write and
read it) whose metadata records every matrix's shape (``"shapes"``); :func:`decode_pruned`
gives the float32 delta back in those shapes, and refuses shapes passed for it that differ.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from moejax.config import is_real
from moejax.delta.quant import QuantizedLeaf, dequantize, quantize
from moejax.delta.storage import StoredDelta, decode, encode, index_dtype_for

__all__ = ["encode_pruned", "decode_pruned"]


def _at_bits(values, bits: int, granularity: str):
    if bits == 16:
        return values.astype(jnp.bfloat16)
    return values if bits == 32 else quantize(values, bits, granularity=granularity)


def encode_pruned(delta: dict, mask: dict, p: float, bits: int) -> StoredDelta:
    """One pruned delta (flat ``{path: array}``) stored at ``bits`` (module docstring);
    ``mask`` names every path of ``delta`` (``True``: stored by its survivors) and ``p`` is the
    rate it was pruned with, in ``[0, 1)``."""
    if sorted(mask) != sorted(delta):
        raise ValueError(f"encode_pruned: mask has paths {sorted(mask)[:6]} but the delta "
                         f"{sorted(delta)[:6]}; give one flag per path of the delta")
    if not is_real(p) or not 0.0 <= p < 1.0:
        raise ValueError(f"encode_pruned: p={p!r}; the drop rate is a number in [0, 1)")
    out = {}
    for path, d in delta.items():
        if not mask[path]:
            out[path] = d
        elif p == 0.0:
            out[path] = _at_bits(d, bits, "channel")
        else:
            flat = np.asarray(d).reshape(-1)
            idx = np.flatnonzero(flat)
            out[path] = {"index": idx.astype(index_dtype_for(max(flat.size, 1))),
                         "values": _at_bits(flat[idx], bits, "tensor")}
    stored = encode(out, formats="dense")
    shapes = {path: [int(n) for n in np.shape(d)] for path, d in delta.items()}
    return StoredDelta(stored.arrays, {**stored.meta, "shapes": shapes})


def _stored_shapes(stored: StoredDelta, shapes: dict | None) -> dict:
    """The matrices' shapes: as recorded (checked against ``shapes`` where both are given)."""
    recorded = stored.meta.get("shapes")
    if recorded is None:
        if shapes is None:
            raise ValueError("decode_pruned: this delta records no shapes (it predates them); "
                             "pass shapes={path: shape} of the delta it was encoded from")
        return {path: tuple(shape) for path, shape in shapes.items()}
    recorded = {path: tuple(shape) for path, shape in recorded.items()}
    if shapes is not None:
        given = {path: tuple(int(n) for n in shape) for path, shape in shapes.items()}
        bad = [f"{path}: stored {recorded.get(path)} vs given {given.get(path)}"
               for path in sorted(set(recorded) | set(given))
               if recorded.get(path) != given.get(path)]
        if bad:
            raise ValueError("decode_pruned: the shapes passed differ from the stored delta's ("
                             + "; ".join(bad[:6]) + "); pass the shapes it was encoded from, "
                             "or none")
    return recorded


def decode_pruned(stored: StoredDelta, shapes: dict | None = None) -> dict:
    """Inverse of :func:`encode_pruned`: flat ``{path: float32 array}`` in the stored shapes
    (``shapes``, optional, must equal them; a delta stored without them needs it)."""
    tree = decode(stored)
    out = {}
    for path, shape in _stored_shapes(stored, shapes).items():
        node = tree
        for part in path.split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise ValueError(f"decode_pruned: the stored delta has no matrix {path!r}")
        size = math.prod(shape)
        if isinstance(node, dict):  # survivors: index + values
            vals = node["values"]
            vals = dequantize(vals) if isinstance(vals, QuantizedLeaf) else np.asarray(vals)
            index = np.asarray(node["index"], np.int64)
            if index.size and int(index.max()) >= size:
                raise ValueError(f"decode_pruned: {path!r} has a survivor at {int(index.max())}, "
                                 f"past the {size} entries of shape {tuple(shape)}")
            flat = np.zeros(size, np.float32)
            flat[index] = np.asarray(vals, np.float32)
            out[path] = jnp.asarray(flat.reshape(shape))
        else:
            node = dequantize(node) if isinstance(node, QuantizedLeaf) else node
            if tuple(np.shape(node)) != tuple(shape):
                raise ValueError(f"decode_pruned: {path!r} is stored as {np.shape(node)}, "
                                 f"not {tuple(shape)}")
            out[path] = jnp.asarray(node, jnp.float32)
    return out
