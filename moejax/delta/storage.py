"""Compact, pickle-free storage of (pruned / quantised) delta pytrees.

Per leaf one of three encodings, all plain numpy arrays + JSON metadata:

* ``dense``:  ``values`` (the leaf, original dtype);
* ``sparse``: ``index`` (flat positions of non-zeros, in the smallest unsigned dtype
  holding ``size - 1``) and ``values`` (the non-zeros, original dtype);
* ``quant``:  a :class:`~moejax.delta.quant.QuantizedLeaf` with its codes bit-packed
  (``ceil(size * bits / 8)`` bytes) plus float32 ``step`` per block (and ``offset`` for asymmetric).

``encode`` -> :class:`StoredDelta` (``arrays: dict[str, np.ndarray]``, ``meta: dict``);
``save``/``load`` write/read an ``.npz`` (``allow_pickle=False``) with the metadata as a
JSON byte array. Byte accounting is exact: ``sum(a.nbytes for a in arrays)``.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.delta.quant import QuantizedLeaf, block_shape, num_levels
from moejax.delta.tree import leaf_paths, per_leaf_values
from moejax.files import atomic_open

__all__ = [
    "index_dtype_for",
    "pack_bits",
    "unpack_bits",
    "StoredDelta",
    "encode",
    "decode",
    "save",
    "load",
    "validate_stored",
    "storage_report",
    "dense_bytes",
]

FORMAT = "moejax.delta.storage/1"
_is_q = lambda x: isinstance(x, QuantizedLeaf)  # noqa: E731


def index_dtype_for(size: int) -> np.dtype:
    """Smallest unsigned integer dtype that can hold every flat index ``0..size-1``."""
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"size {size} too large to index.")  # pragma: no cover


def pack_bits(codes, bits: int) -> np.ndarray:
    """Pack integer codes in ``[0, 2^bits)`` into ``ceil(n * bits / 8)`` bytes (LSB first)."""
    c = np.asarray(codes).reshape(-1)
    if c.size and int(c.max()) >= 2**bits:
        raise ValueError(f"pack_bits: code {int(c.max())} does not fit in {bits} bits.")
    b = np.unpackbits(c.astype(np.uint8)[:, None], axis=1, bitorder="little")[:, :bits]
    return np.packbits(b.reshape(-1), bitorder="little")


def unpack_bits(packed, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` uint8 codes."""
    b = np.unpackbits(np.asarray(packed, np.uint8), bitorder="little")[: count * bits]
    b = np.concatenate([b.reshape(count, bits), np.zeros((count, 8 - bits), np.uint8)], axis=1)
    return np.packbits(b, axis=1, bitorder="little").reshape(count)


def _storable(a: np.ndarray) -> tuple[np.ndarray, str]:
    """Non-native dtypes (bfloat16, float8 ...) are stored as same-width unsigned ints."""
    dt = str(a.dtype)
    if (
        a.dtype.kind == "V"
        or type(a.dtype).__module__.startswith("ml_dtypes")
        or "bfloat16" in dt
        or "float8" in dt
    ):
        return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}")), dt
    return a, dt


def _restore(a: np.ndarray, dtype: str) -> np.ndarray:
    if str(a.dtype) == dtype:
        return a
    return a.view(jnp.dtype(dtype))


class StoredDelta(NamedTuple):
    """Plain arrays (``"leaf{i}.{field}"`` keys) and JSON-able metadata."""

    arrays: dict
    meta: dict


def _sparse_nbytes(x: np.ndarray) -> int:
    nnz = int(np.count_nonzero(x))
    return nnz * (x.dtype.itemsize + index_dtype_for(x.size).itemsize)


def encode(tree, formats: str | dict | Any = "auto") -> StoredDelta:
    """Encode a delta pytree (leaves: arrays or ``QuantizedLeaf``) for storage.

    ``formats``: ``"auto"`` (sparse when strictly smaller than dense), ``"dense"``,
    ``"sparse"``, or a ``{path: format}`` dict / aligned pytree. ``QuantizedLeaf``
    leaves are always stored as ``quant``.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_q)[0]
    paths = leaf_paths(jax.tree_util.tree_map(lambda _: 0, tree, is_leaf=_is_q))
    fmts = per_leaf_values(
        formats, jax.tree_util.tree_map(lambda _: 0, tree, is_leaf=_is_q), "formats"
    )
    arrays, leaves_meta = {}, []
    for i, ((_, leaf), path, fmt) in enumerate(zip(flat, paths, fmts)):
        pre = f"leaf{i}."
        if _is_q(leaf):
            codes = np.asarray(leaf.codes)
            arrays[pre + "codes"] = pack_bits(codes, leaf.bits)
            arrays[pre + "step"] = np.asarray(leaf.step, np.float32)
            if not leaf.symmetric:  # symmetric blocks are centred: no offset to store
                arrays[pre + "offset"] = np.asarray(leaf.offset, np.float32)
            leaves_meta.append(
                dict(
                    path=path,
                    kind="quant",
                    shape=list(codes.shape),
                    dtype=leaf.dtype,
                    bits=leaf.bits,
                    symmetric=leaf.symmetric,
                    granularity=leaf.granularity,
                    group_size=leaf.group_size,
                    in_axis=leaf.in_axis,
                    levels=leaf.n_levels,
                )
            )
            continue
        x = np.asarray(jax.device_get(leaf))
        if fmt not in ("auto", "dense", "sparse"):
            raise ValueError(
                f"encode: format {fmt!r} for leaf {path!r}; use 'auto', 'dense' or 'sparse' "
                "(quantise with moejax.delta.quant.quantize_tree for 'quant')."
            )
        if fmt == "auto":
            fmt = "sparse" if _sparse_nbytes(x) < x.nbytes else "dense"
        xs, dt = _storable(x)
        if fmt == "sparse":
            idx = np.flatnonzero(x.reshape(-1))
            arrays[pre + "index"] = idx.astype(index_dtype_for(max(x.size, 1)))
            arrays[pre + "values"] = xs.reshape(-1)[idx]
        else:
            arrays[pre + "values"] = xs
        leaves_meta.append(dict(path=path, kind=fmt, shape=list(x.shape), dtype=dt))
    return StoredDelta(arrays, {"format": FORMAT, "leaves": leaves_meta})


def _decode_leaf(i: int, m: dict, arrays: dict):
    pre, shape = f"leaf{i}.", tuple(m["shape"])
    size = math.prod(shape)
    if m["kind"] == "quant":
        codes = unpack_bits(arrays[pre + "codes"], m["bits"], size).reshape(shape)
        step = arrays[pre + "step"]
        levels = m.get("levels") or num_levels(m["bits"], m["symmetric"])
        if size and int(codes.max()) >= levels:
            raise ValueError(f"decode: leaf {i} ({m['path']!r}): a code past the {levels} "
                             f"levels of {m['bits']}-bit codes")
        offset = (
            arrays[pre + "offset"]
            if not m["symmetric"]
            else -(levels - 1) / 2.0 * step
        )
        return QuantizedLeaf(
            codes,
            step,
            offset.astype(np.float32),
            m["bits"],
            m["symmetric"],
            m["granularity"],
            m["group_size"],
            m["in_axis"],
            m["dtype"],
            levels,
        )
    vals = arrays[pre + "values"]
    if m["kind"] == "sparse":
        flat = np.zeros(size, vals.dtype)
        flat[arrays[pre + "index"].astype(np.int64)] = vals
        vals = flat
    return jnp.asarray(_restore(vals.reshape(shape), m["dtype"]))


def decode(stored: StoredDelta, like=None):
    """Rebuild the tree. With ``like`` (any tree of the same structure, e.g. the
    pre-trained params) the exact original structure is restored; without it, a
    nested dict keyed by the path components is returned."""
    validate_stored(stored, "decode")
    metas = stored.meta["leaves"]
    leaves = [_decode_leaf(i, m, stored.arrays) for i, m in enumerate(metas)]
    if like is not None:
        like_paths = leaf_paths(like)
        if like_paths != [m["path"] for m in metas]:
            raise ValueError(
                "decode: `like` has different leaf paths than the stored delta "
                f"({like_paths[:5]} vs {[m['path'] for m in metas][:5]}); pass the matching tree."
            )
        bad = [f"{m['path']}: stored {tuple(m['shape'])} vs like {tuple(np.shape(x))}"
               for m, x in zip(metas, jax.tree_util.tree_leaves(like))
               if tuple(m["shape"]) != tuple(np.shape(x))]
        if bad:
            raise ValueError("decode: the stored delta's shapes differ from `like` ("
                             + "; ".join(bad[:6]) + "); pass the tree it was encoded from")
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
    out: dict = {}
    for m, leaf in zip(metas, leaves):
        node, parts = out, m["path"].split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    return out


def save(path: str, stored: StoredDelta) -> None:
    """Write an ``.npz`` (no pickle): the arrays plus ``__meta__`` (UTF-8 JSON bytes).
    Atomic: written to a temporary file in the same directory, fsynced, then renamed over
    ``path``, so a failed save leaves any previous file intact."""
    path = str(path)
    if not path.endswith(".npz"):
        raise ValueError(f"save: {path!r} must end with '.npz' (numpy would append it and the "
                         "file would not be where you asked); add the suffix")
    for k, a in stored.arrays.items():
        if np.asarray(a).dtype == object:
            raise ValueError(f"save: array {k!r} has dtype object (it would need pickle); "
                             "store numeric arrays only")
    meta = np.frombuffer(json.dumps(stored.meta).encode("utf-8"), np.uint8)
    with atomic_open(path, "wb") as f:
        np.savez(f, __meta__=meta, **stored.arrays)


def load(path: str, max_bytes: int | None = None) -> StoredDelta:
    """Read a file written by :func:`save` with ``allow_pickle=False``; damage (a bad zip
    member CRC, a truncated file, missing or inconsistent arrays) raises ``ValueError``
    naming the file and the problem (:func:`validate_stored`)."""
    path = str(path)
    if not path.endswith(".npz"):
        raise ValueError(f"load: {path!r} does not end with '.npz'; delta files are written "
                         "by moejax.delta.storage.save as .npz. Fix: pass the .npz path")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load: no delta file {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "__meta__" not in z.files:
                raise ValueError("it has no __meta__ entry (not written by "
                                 "moejax.delta.storage.save)")
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode("utf-8"))
        bad = sorted(k for k, v in arrays.items() if not isinstance(v, np.ndarray))
        if bad:
            raise ValueError(f"members {bad} are not .npy arrays")
    except MemoryError:  # a member's header declares more than this machine can hold
        raise ValueError(f"load: delta file {path} is corrupt or not a delta file (a member "
                         "declares an array larger than this machine's memory). Fix: "
                         "re-create it with moejax.delta.storage.save") from None
    except (zipfile.BadZipFile, OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"load: delta file {path} is corrupt or not a delta file ({e}). "
                         "Fix: re-create it with moejax.delta.storage.save") from None
    stored = StoredDelta(arrays, meta)
    validate_stored(stored, path, max_bytes)
    return stored


def default_max_bytes() -> int:
    """The decoded size a delta file may declare without ``max_bytes``: half this machine's
    physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound we can read
        return 1 << 62


def _leaf_dtype(name, where: str) -> np.dtype:
    """The numeric dtype a leaf's metadata declares (what it decodes to)."""
    try:
        dt = jnp.dtype(name)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: unknown dtype {name!r} in the metadata") from None
    if not (jnp.issubdtype(dt, jnp.number) or dt == jnp.bool_):
        raise ValueError(f"{where}: dtype {name!r} is not a numeric dtype; a delta file "
                         "holds numbers only")
    return dt


def validate_stored(stored: StoredDelta, source="delta", max_bytes: int | None = None) -> None:
    """Check that the metadata is well formed and every leaf's arrays exist and fit it
    (declared numeric dtype and the stored arrays' dtype, sizes, index range, packed code
    length), and that the decoded tree stays within ``max_bytes`` (default: half the
    machine's memory); raise ``ValueError`` naming ``source``, the leaf and the problem."""
    meta = stored.meta
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{source}: unknown delta format "
                         f"{meta.get('format') if isinstance(meta, dict) else meta!r}; "
                         f"expected {FORMAT!r}")
    if not isinstance(meta.get("leaves", []), list):
        raise ValueError(f"{source}: malformed metadata: 'leaves' must be a list")
    a = stored.arrays
    limit = default_max_bytes() if max_bytes is None else max_bytes
    total = 0
    for i, m in enumerate(meta.get("leaves", [])):
        pre = f"leaf{i}."
        if not isinstance(m, dict):
            raise ValueError(f"{source}: leaf {i}: malformed metadata {m!r} (not a record)")
        where = f"{source}: leaf {i} ({m.get('path', '?')!r})"
        try:
            shape = tuple(int(n) for n in m["shape"])
            kind = m["kind"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: malformed metadata {m!r}") from None
        if any(n < 0 for n in shape):
            raise ValueError(f"{where}: negative dimension in shape {shape}")
        dt = _leaf_dtype(m.get("dtype"), where)
        size = math.prod(shape)
        total += size * dt.itemsize
        if total > limit:
            raise ValueError(
                f"{source}: the leaves up to {i} decode to {total / 2**30:.2f} GiB, more than "
                f"the bound of {limit / 2**30:.2f} GiB (half this machine's memory by "
                "default); the metadata is corrupt, or pass max_bytes=... to allow it")
        if kind in ("dense", "sparse") and pre + "values" in a:
            want = np.dtype(_storable(np.zeros(0, dt))[0].dtype)
            if a[pre + "values"].dtype != want:
                raise ValueError(f"{where}: values stored as {a[pre + 'values'].dtype} but the "
                                 f"metadata declares {m.get('dtype')} (stored as {want})")
        need = {"dense": ("values",), "sparse": ("index", "values"),
                "quant": ("codes", "step")}.get(kind)
        if need is None:
            raise ValueError(f"{where}: unknown encoding {kind!r}")
        missing = [pre + n for n in need if pre + n not in a]
        if missing:
            raise ValueError(f"{where}: arrays {missing} are missing")
        if kind == "dense" and a[pre + "values"].size != size:
            raise ValueError(f"{where}: {a[pre + 'values'].size} values for shape {shape}")
        if kind == "sparse":
            idx, vals = a[pre + "index"], a[pre + "values"]
            if idx.dtype.kind not in "ui" or idx.shape != vals.shape or idx.size > size:
                raise ValueError(f"{where}: sparse index {idx.dtype} {idx.shape} does not fit "
                                 f"values {vals.shape} of a leaf of {size} entries")
            if idx.size and (int(idx.max()) >= size or int(idx.min()) < 0):
                raise ValueError(f"{where}: sparse index {int(idx.max())} out of range for "
                                 f"shape {shape}")
        if kind == "quant":
            keys = ("bits", "symmetric", "granularity", "group_size", "in_axis")
            if any(k not in m for k in keys) or not isinstance(m["bits"], int):
                raise ValueError(f"{where}: malformed quantised-leaf metadata (needs "
                                 f"{', '.join(keys)}; got {sorted(m)})")
            _check_quant(where, pre, m, shape, a)


def _check_quant(where: str, pre: str, m: dict, shape: tuple, a: dict) -> None:
    """A quantised leaf's settings, and its arrays against them: the packed code bytes (uint8)
    and a float32 ``step`` (and ``offset``, asymmetric codes) of the leaf's block shape; a
    wrong block array would broadcast into wrong values. (The codes themselves are checked
    where they are unpacked, :func:`_decode_leaf`.)"""
    try:
        if not isinstance(m["symmetric"], bool) or not all(
                isinstance(m[k], int) for k in ("group_size", "in_axis")):
            raise ValueError("symmetric must be a bool, group_size and in_axis ints")
        blocks = block_shape(shape, m["granularity"], m["group_size"], m["in_axis"])
        levels = num_levels(m["bits"], m["symmetric"])
        allowed = {0, levels} | ({2 ** m["bits"]} if m["symmetric"] else set())
        if m.get("levels", 0) not in allowed:
            raise ValueError(f"levels={m.get('levels')!r} at {m['bits']} bits, "
                             f"{'symmetric' if m['symmetric'] else 'asymmetric'}: one of "
                             f"{sorted(allowed)}")
    except ValueError as e:
        raise ValueError(f"{where}: malformed quantised-leaf metadata: {e}") from None
    size, bits = math.prod(shape), m["bits"]
    nbytes = math.ceil(size * bits / 8)
    if a[pre + "codes"].dtype != np.uint8 or a[pre + "codes"].size != nbytes:
        raise ValueError(f"{where}: {a[pre + 'codes'].size} code {a[pre + 'codes'].dtype} "
                         f"entries, shape {shape} at {bits} bits needs {nbytes} uint8 bytes")
    if not m["symmetric"] and pre + "offset" not in a:
        raise ValueError(f"{where}: asymmetric codes without their offset array")
    for name in ("step",) + (("offset",) if not m["symmetric"] else ()):
        x = a[pre + name]
        if x.dtype != np.float32 or x.shape != blocks:
            raise ValueError(f"{where}: {name} stored as {x.dtype} {x.shape}; the leaf's "
                             f"blocks need float32 {blocks}")


def storage_report(stored: StoredDelta) -> dict:
    """Exact counts: per leaf ``n_params`` (dense entries), ``n_stored`` (values or codes
    kept) and ``bytes``; totals ``params``, ``stored``, ``array_bytes``, ``meta_bytes``."""
    per_leaf = []
    for i, m in enumerate(stored.meta["leaves"]):
        pre = f"leaf{i}."
        nbytes = sum(a.nbytes for k, a in stored.arrays.items() if k.startswith(pre))
        n_params = math.prod(m["shape"])
        if m["kind"] == "sparse":
            n_stored = int(stored.arrays[pre + "values"].size)
        else:
            n_stored = n_params
        per_leaf.append(
            dict(path=m["path"], kind=m["kind"], n_params=n_params, n_stored=n_stored, bytes=nbytes)
        )
    return dict(
        leaves=per_leaf,
        params=sum(x["n_params"] for x in per_leaf),
        stored=sum(x["n_stored"] for x in per_leaf),
        array_bytes=sum(a.nbytes for a in stored.arrays.values()),
        meta_bytes=len(json.dumps(stored.meta).encode("utf-8")),
    )


def dense_bytes(tree) -> int:
    """Bytes of the uncompressed tree: ``sum(size * itemsize)``."""
    return int(
        sum(
            int(np.size(x)) * jnp.dtype(jnp.result_type(x)).itemsize
            for x in jax.tree_util.tree_leaves(tree)
        )
    )
