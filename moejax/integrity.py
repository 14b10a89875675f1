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
           "flatten_dict", "json_checksum"]


class CorruptDataError(ValueError):
    """Saved data does not match the checksums stored with it (bit rot, a torn copy, a
    hand-edited file). The message names the file/step and every corrupt entry."""


def array_checksum(a) -> str:
    """CRC-32 of ``a``'s bytes (C order), salted with dtype and shape; 8 hex digits."""
    x = np.ascontiguousarray(np.asarray(a))
    salt = f"{x.dtype.str}{x.shape}".encode()
    return f"{zlib.crc32(memoryview(x).cast('B'), zlib.crc32(salt)) & 0xFFFFFFFF:08x}"


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
