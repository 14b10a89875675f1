"""DeRS step 2 (Replace): light forms of the expert deltas, with exact accounting.

For every decomposed layer, matrix ``w`` and expert ``i`` (one storage leaf each):

* ``"sparse"`` (paper Eq. 4, DARE): ``M_i ~ Bernoulli(p)``,
  ``F(Delta_i) = (1 - M_i) * Delta_i / (1 - p)``, stored as index + value vectors
  (:func:`moejax.delta.dare` + ``moejax.delta.storage`` ``"sparse"`` encoding);
* ``"quant"`` (Eq. 5): ``F(Delta_i) = Quant(Delta_i, k bits)``: ``k`` in 1..8 uses
  :func:`moejax.delta.quantize` (codes bit-packed, one float32 scale per block, counted in the
  bytes); ``k = 16`` stores the delta as float16. The paper does not name its quantiser; the
  default is ``QuantSpec()``: ``2^k`` midrise levels per group of 64 input entries of each
  output column, and at 1 bit the sign times the group's mean ``|Delta|``.
  ``QuantSpec(scheme="symmetric", granularity="channel")`` is the quantiser used before
  (``2^k - 1`` levels from the column's max ``|Delta|``: 1 bit = ``{-A, +A}``, 2 bits
  ``{-A, 0, A}``);
* ``"none"``: the delta as is (float32 = the vanilla model, decomposed).

Counts (all exact, per the whole model): ``base`` = ``sum d_in d_out`` over decomposed
layers / matrices; ``delta_values`` = stored values or codes; ``delta_index`` = stored index
entries; ``expert_params`` = ``base + delta_values`` (the paper's
``(1 + N(1-p)) d d_h`` for sparsification); ``expert_params_with_index`` adds the index;
bytes from the actual arrays (``storage_report``), base in its dtype.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import numpy as np

from moejax.delta.dare import dare
from moejax.delta.quant import dequantize_tree, quantize_tree
from moejax.delta.storage import StoredDelta, decode, encode, storage_report
from moejax.ders_compress.decompose import Decomposed, recompose

__all__ = ["CompressedDeRS", "QuantSpec", "compress", "decompress_deltas", "decompress",
           "compression_report", "delta_tree", "untree"]

Method = Literal["sparse", "quant", "none"]


class CompressedDeRS(NamedTuple):
    """``base`` / ``rest`` as in :class:`Decomposed`; ``stored`` the compact deltas
    (leaf paths ``"{layer}/{w}/e{j}"``); ``meta``: method, drop_rate, bits, extended, layers,
    ``n`` (deltas per layer)."""

    base: dict
    rest: dict
    stored: StoredDelta
    meta: dict


def delta_tree(deltas: dict) -> dict:
    """``{i: {w: [n, ...]}}`` -> ``{str(i): {w: {"e{j}": [...]}}}`` (one leaf per expert)."""
    return {str(i): {w: {f"e{j}": np.asarray(a[j]) for j in range(a.shape[0])}
                     for w, a in layer.items()} for i, layer in deltas.items()}


def untree(tree: dict, layer_keys) -> dict:
    """Inverse of :func:`delta_tree` (``layer_keys`` restores the original key types)."""
    out = {}
    for i in layer_keys:
        out[i] = {}
        for w, per in tree[str(i)].items():
            out[i][w] = np.stack([np.asarray(per[f"e{j}"]) for j in range(len(per))])
    return out


class QuantSpec(NamedTuple):
    """The k-bit quantiser of ``method="quant"`` (see :func:`moejax.delta.quantize`)."""

    scheme: str = "midrise"
    granularity: str = "group"
    group_size: int = 64


DEFAULT_QUANT = QuantSpec()


def compress(dec: Decomposed, method: Method, *, drop_rate: float = 0.0, bits: int = 8,
             key: jax.Array | None = None, quant: QuantSpec = DEFAULT_QUANT) -> CompressedDeRS:
    """Replace every delta by its light form (module docstring). ``key`` drives the DARE
    masks (required for ``"sparse"``; leaf ``j`` of the tree uses ``fold_in(key, j)``);
    ``quant`` is the k-bit quantiser. ``drop_rate`` is the sparse form's and is refused with
    another method (the metadata stores what ran: ``bits`` is 32, float32 values, but for
    ``"quant"``)."""
    if method != "sparse" and drop_rate:
        raise ValueError(f"compress: drop_rate={drop_rate} applies to method='sparse', not "
                         f"{method!r}; drop it or use method='sparse'")
    tree = delta_tree(dec.deltas)
    if method == "sparse":
        if key is None:
            raise ValueError("compress(method='sparse') draws DARE masks; pass "
                             "key=jax.random.key(0)")
        pruned = jax.tree.map(np.asarray, dare(key, tree, drop_rate))
        stored = encode(pruned, "sparse")
    elif method == "quant":
        if bits == 16:
            stored = encode(jax.tree.map(lambda a: a.astype(np.float16), tree), "dense")
        elif 1 <= bits <= 8:
            q = quantize_tree(tree, bits, scheme=quant.scheme, granularity=quant.granularity,
                              group_size=quant.group_size, in_axis=0)
            stored = encode(q)
        else:
            raise ValueError(f"compress: bits={bits}; use 1..8 or 16")
    elif method == "none":
        stored = encode(tree, "dense")
    else:
        raise ValueError(f"compress: method={method!r}; use 'sparse', 'quant' or 'none'")
    layers = list(dec.base)
    n = int(next(iter(dec.deltas[layers[0]].values())).shape[0])
    meta = {"method": method, "drop_rate": float(drop_rate),
            "bits": int(bits) if method == "quant" else 32,
            "quant": dict(quant._asdict()) if method == "quant" else None,
            "extended": bool(dec.extended), "layers": [int(i) for i in layers], "n": n}
    return CompressedDeRS(dec.base, dec.rest, stored, meta)


def decompress_deltas(c: CompressedDeRS) -> dict:
    """Dense ``{i: {w: [n, d_in, d_out]}}`` deltas ``F(Delta_i)`` (float32)."""
    tree = dequantize_tree(decode(c.stored))
    tree = jax.tree.map(lambda a: np.asarray(a, np.float32), tree)
    keys = list(c.base)
    return untree(tree, keys)


def decompress(c: CompressedDeRS) -> dict:
    """The full MoE parameter dict with ``W~_i = W_base + F(Delta_i)`` (all experts; for
    round-trip checks; inference should use :mod:`moejax.ders_compress.synth`)."""
    dec = Decomposed(c.base, None, c.rest, c.meta["extended"])
    return recompose(dec, decompress_deltas(c))


def _nbytes(tree) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def _nparams(tree) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def compression_report(c: CompressedDeRS) -> dict[str, int]:
    """Exact counts (module docstring) plus ``vanilla_expert_params`` / ``vanilla_expert_bytes``
    (the n dense copies in the base dtype), ``rest_params`` / ``rest_bytes`` (everything
    else), ``total_bytes`` = ``rest_bytes + expert_bytes``."""
    rep = storage_report(c.stored)
    index = sum(int(a.size) for k, a in c.stored.arrays.items() if k.endswith(".index"))
    base_p, base_b = _nparams(c.base), _nbytes(c.base)
    n = c.meta["n"]
    itemsize = next(iter(jax.tree.leaves(c.base))).dtype.itemsize
    expert_bytes = base_b + rep["array_bytes"]
    rest_b = _nbytes(c.rest)
    return {"base": base_p, "delta_values": rep["stored"], "delta_index": index,
            "expert_params": base_p + rep["stored"],
            "expert_params_with_index": base_p + rep["stored"] + index,
            "delta_bytes": rep["array_bytes"], "expert_bytes": expert_bytes,
            "vanilla_expert_params": n * base_p, "vanilla_expert_bytes": n * base_p * itemsize,
            "rest_params": _nparams(c.rest), "rest_bytes": rest_b,
            "total_bytes": rest_b + expert_bytes}
