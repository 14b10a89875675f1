"""A DARE-pruned (and quantised) delta as a checkpoint, and back: what a pruned delta costs to
store (DAREx paper, Sec. 5's storage argument).

Each matrix of the delta (a flat ``{path: array}``, pruned with rate ``p``) is kept, per
``mask``, as the flat positions of its survivors (the smallest unsigned index dtype) and their
values at ``bits`` (32 float32, 16 bfloat16, at most 8: symmetric codes with one scale for the
matrix); with ``p = 0`` the matrix itself (16 / 32 bits, or per-channel codes). The leaves off
the mask stay dense float32. :func:`encode_pruned` returns a
:class:`~moejax.delta.storage.StoredDelta` (its bytes exact; ``save`` / ``load`` write and
read it); :func:`decode_pruned` gives the float32 delta back.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moejax.delta.quant import QuantizedLeaf, dequantize, quantize
from moejax.delta.storage import StoredDelta, decode, encode, index_dtype_for

__all__ = ["encode_pruned", "decode_pruned"]


def _at_bits(values, bits: int, granularity: str):
    if bits == 16:
        return values.astype(jnp.bfloat16)
    return values if bits == 32 else quantize(values, bits, granularity=granularity)


def encode_pruned(delta: dict, mask: dict, p: float, bits: int) -> StoredDelta:
    """One pruned delta (flat ``{path: array}``) stored at ``bits`` (module docstring)."""
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
    return encode(out, formats="dense")


def decode_pruned(stored: StoredDelta, shapes: dict) -> dict:
    """Inverse of :func:`encode_pruned`: flat ``{path: float32 array}`` of ``shapes``."""
    tree = decode(stored)
    out = {}
    for path, shape in shapes.items():
        node = tree
        for part in path.split("/"):
            node = node[part]
        if isinstance(node, dict):  # survivors: index + values
            vals = node["values"]
            vals = dequantize(vals) if isinstance(vals, QuantizedLeaf) else np.asarray(vals)
            flat = np.zeros(int(np.prod(shape)), np.float32)
            flat[np.asarray(node["index"], np.int64)] = np.asarray(vals, np.float32)
            out[path] = jnp.asarray(flat.reshape(shape))
        else:
            node = dequantize(node) if isinstance(node, QuantizedLeaf) else node
            out[path] = jnp.asarray(node, jnp.float32)
    return out
