"""Cache of tokenised dataset splits (BPE tokenisation of a 10 MB corpus takes seconds).

``tokenized_docs(name, split, tokenizer, field)`` returns the token ids of every document of a
split, in the data source's order. For BPE tokenizers the result is stored once in
``<data dir>/tokens/<name>-<version>-<split>-<field>-<tokenizer fingerprint>.npz`` (flat ids +
offsets + a CRC-32 of both; written to a temp file, fsynced and renamed) and loaded on later
calls. A cache file that fails to load or verify (truncated, bit-flipped, inconsistent
offsets) is rebuilt from the dataset, with a warning. Byte-level tokenisation is
cheaper than reading a cache, so it is never cached.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import numpy as np

from moejax.data import datasets
from moejax.files import atomic_open
from moejax.integrity import array_checksum

log = logging.getLogger(__name__)

__all__ = ["tokenized_docs", "cache_path"]


def cache_path(name: str, split: str, field: str, tokenizer, builder) -> Path:
    """Where the tokenised split lives (next to the dataset, inside its data dir)."""
    root = Path(builder.data_dir_root) / "tokens"
    stem = f"{name.replace('/', '-')}-{builder.version}-{split}-{field}-{tokenizer.fingerprint}"
    return root / f"{stem}.npz"


def _checksum(flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    digest = array_checksum(flat) + array_checksum(offsets)
    return np.frombuffer(digest.encode(), np.uint8)


def _save(path: Path, flat: np.ndarray, offsets: np.ndarray) -> None:
    with atomic_open(path, "wb") as f:
        np.savez(f, flat=flat, offsets=offsets, checksum=_checksum(flat, offsets))


def _load(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """``(flat, offsets)`` of a cache file that verifies, else ``None`` (with a warning)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            flat, offsets, check = z["flat"], z["offsets"], z["checksum"]
        ok = (np.array_equal(check, _checksum(flat, offsets)) and offsets.ndim == 1
              and offsets.size >= 1 and offsets[0] == 0 and offsets[-1] == flat.size
              and bool(np.all(np.diff(offsets) >= 0)))
        problem = "checksum or offsets do not verify"
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
        ok, problem = False, f"{type(e).__name__}: {e}"
    if not ok:
        log.warning("token cache %s is corrupt (%s); rebuilding it", path, problem)
        return None
    return flat, offsets


def tokenized_docs(name: str, split: str, tokenizer, field: str, **ds_kwargs) -> list[np.ndarray]:
    """Token ids (int32) of the ``field`` of every example of ``name``/``split``."""
    builder = datasets.get_builder(name, **ds_kwargs)
    cacheable = str(tokenizer.fingerprint).startswith("bpe-")
    path = cache_path(name, split, field, tokenizer, builder) if cacheable else None
    cached = _load(path) if path is not None and path.exists() else None
    if cached is not None:
        flat, offsets = cached[0].astype(np.int32), cached[1]
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    examples = datasets.read_all(builder.as_data_source()[split])
    docs = tokenizer.encode_batch([datasets.decode_text(e[field]) for e in examples])
    if path is not None:
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
        flat = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
        _save(path, flat.astype(dtype), offsets)
    return docs
