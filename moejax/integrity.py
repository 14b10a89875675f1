"""Checksums of arrays and flat array dicts: detect silent corruption of saved state.

``array_checksum(a)`` is the CRC-32 (``zlib``, ~GB/s) of the array's bytes in C order, salted
with its dtype and shape, as 8 hex digits. ``tree_checksums(flat)`` maps every entry of a
``{"path": array}`` dict to its checksum; :func:`verify_checksums` compares a restored dict
with the stored checksums and raises :class:`CorruptDataError` listing every entry that
differs (or is missing / unexpected). Used by the training checkpoints, the compressed DeRS
checkpoints and the token cache; it imports nothing from the rest of moejax.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping

import numpy as np

__all__ = ["CorruptDataError", "array_checksum", "tree_checksums", "verify_checksums",
           "flatten_dict", "json_checksum", "shard_checksums", "verify_shard_checksums"]


class CorruptDataError(ValueError):
    """Saved data does not match the checksums stored with it (bit rot, a torn copy, a
    hand-edited file). The message names the file/step and every corrupt entry."""


def array_checksum(a) -> str:
    """CRC-32 of ``a``'s bytes (C order), salted with dtype and shape; 8 hex digits. The
    dtypes numpy does not know natively (``ml_dtypes``' bfloat16, float8) are named in the
    salt (their ``dtype.str`` is a bare void of their size)."""
    x = np.ascontiguousarray(np.asarray(a))
    dtype = x.dtype.name if x.dtype.kind == "V" else x.dtype.str
    salt = f"{dtype}{x.shape}".encode()
    return f"{zlib.crc32(x.reshape(-1).view(np.uint8), zlib.crc32(salt)) & 0xFFFFFFFF:08x}"


def json_checksum(record: Mapping, exclude: str = "checksum") -> str:
    """CRC-32 of a JSON record in canonical form (sorted keys, no spaces), ``exclude`` left
    out (the key the checksum itself is stored under); 8 hex digits."""
    text = json.dumps({k: v for k, v in record.items() if k != exclude}, sort_keys=True,
                      separators=(",", ":"), allow_nan=True)
    return f"{zlib.crc32(text.encode()) & 0xFFFFFFFF:08x}"


def flatten_dict(tree, prefix: str = "") -> dict:
    """Nested dicts/lists/tuples -> ``{"a/b/0": leaf}`` (``None`` leaves dropped)."""
    out = {}
    if isinstance(tree, Mapping):
        items = ((str(k), v) for k, v in tree.items())
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree} if tree is not None else {}
    for k, v in items:
        out.update(flatten_dict(v, f"{prefix}/{k}" if prefix else k))
    return out


def tree_checksums(tree) -> dict[str, str]:
    """``{"a/b": checksum}`` of every array leaf of a nested dict/list tree."""
    return {k: array_checksum(v) for k, v in sorted(flatten_dict(tree).items())}


def verify_checksums(tree, expected: Mapping[str, str], where: str) -> None:
    """Raise :class:`CorruptDataError` (naming ``where`` and each bad entry) unless every
    leaf of ``tree`` has the checksum in ``expected`` and no entry is missing or extra."""
    got = tree_checksums(tree)
    bad = [k for k in sorted(set(got) & set(expected)) if got[k] != expected[k]]
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if bad or missing or extra:
        parts = []
        if bad:
            parts.append(f"{len(bad)} arrays differ from their saved checksums ("
                         + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else "") + ")")
        if missing:
            parts.append(f"missing arrays {missing[:8]}")
        if extra:
            parts.append(f"arrays without a checksum {extra[:8]}")
        raise CorruptDataError(f"{where} is corrupt: " + "; ".join(parts))


def _region(index, shape) -> str:
    """A shard's region of its array as ``"0:4,0:8"`` (every slice resolved)."""
    return ",".join(f"{sl.indices(n)[0]}:{sl.indices(n)[1]}" for sl, n in zip(index, shape))


def _index(region: str) -> tuple:
    return tuple(slice(*map(int, r.split(":"))) for r in region.split(",") if r)


def _leaf_shards(path: str, x):
    """``(key, checksum)`` of each shard of leaf ``x`` this process holds (replica 0)."""
    shards = getattr(x, "addressable_shards", None)
    if shards is None:  # a host array: one region, the whole of it
        a = np.asarray(x)
        yield f"{path}@{_region(tuple(slice(None) for _ in a.shape), a.shape)}", array_checksum(a)
        return
    for sh in shards:
        if sh.replica_id == 0:
            yield f"{path}@{_region(sh.index, x.shape)}", array_checksum(sh.data)


def shard_checksums(tree) -> dict[str, str]:
    """``{"a/b@0:4,0:8": checksum}`` of every shard of every array leaf that this process
    holds (one replica each): what a process of a multi-host run can checksum alone."""
    return {k: v for path, x in sorted(flatten_dict(tree).items())
            for k, v in _leaf_shards(path, x)}


def verify_shard_checksums(tree, expected: Mapping[str, str], where: str) -> int:
    """Check this process's shards of ``tree`` against ``expected`` (:func:`shard_checksums`
    of every process); an array held whole here is checked region by region. Raise
    :class:`CorruptDataError` naming ``where`` and the bad regions; return how many regions
    were checked (a region another process holds is that process's to check)."""
    leaves = flatten_dict(tree)
    by_path: dict[str, list[str]] = {}
    for key in expected:
        by_path.setdefault(key.rsplit("@", 1)[0], []).append(key)
    missing = sorted(set(by_path) - set(leaves))
    bad, checked = [], 0
    for path, x in sorted(leaves.items()):
        if getattr(x, "is_fully_addressable", True):  # the whole array: slice each region
            a = np.asarray(x)
            got = {k: array_checksum(a[_index(k.rsplit("@", 1)[1])])
                   for k in by_path.get(path, [])}
        else:  # each saved region inside a shard held here (the layouts may differ)
            got = {}
            held = [(_index(_region(sh.index, x.shape)), sh.data)
                    for sh in x.addressable_shards if sh.replica_id == 0]
            for k in by_path.get(path, []):
                want = _index(k.rsplit("@", 1)[1])
                for have, data in held:
                    if all(h.start <= w.start and w.stop <= h.stop for h, w in zip(have, want)):
                        local = tuple(slice(w.start - h.start, w.stop - h.start)
                                      for h, w in zip(have, want))
                        got[k] = array_checksum(np.asarray(data)[local])
                        break
        checked += len(got)
        bad += [k for k, v in got.items() if v != expected[k]]
    if bad or missing:
        parts = ([f"{len(bad)} shards differ from their saved checksums ({', '.join(bad[:8])})"]
                 if bad else []) + ([f"missing arrays {missing[:8]}"] if missing else [])
        raise CorruptDataError(f"{where} is corrupt: " + "; ".join(parts))
    return checked
