"""A real code corpus that every Python install ships: the CPython standard library source.

Files are read in sorted order (test suites and site-packages excluded), split into train,
validation and test by a stable hash of the relative path (no file appears in two;
:data:`moejax.data.raw_files.LM_SPLITS`), and encoded as UTF-8 bytes. The TFDS builder
(:mod:`moejax.data.builders_text`) reads the files through this module and splits them the
same way, so a model trained on either's train split never sees the other's validation or test
files.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from moejax.config import check_count
from moejax.data.raw_files import LM_SPLITS, split_of

__all__ = ["stdlib_root", "stdlib_files", "load_stdlib_bytes", "check_max_bytes"]

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").exists():
        raise FileNotFoundError(
            f"CPython standard library source not found at {root} (no os.py); "
            "this corpus needs a Python install that ships its .py sources"
        )
    return root


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                out.append(Path(dirpath) / f)
    return out


def check_max_bytes(max_bytes) -> None:
    """Refuse a byte budget that is not ``None`` or an integer >= 1 (0 and negative counts
    would read nothing, everything or all but the end, depending on the corpus)."""
    if max_bytes is not None:
        check_count("max_bytes", max_bytes, 1)


def load_stdlib_bytes(split: str, *, max_bytes: int | None = None) -> np.ndarray:
    """Concatenated UTF-8 bytes (uint8) of the split's files (``train``, ``validation`` or
    ``test``, as the TFDS builder splits them), each file followed by ``\\0``; the first
    ``max_bytes`` of them (``None``: all)."""
    check_max_bytes(max_bytes)
    if split not in LM_SPLITS:
        raise ValueError(f"split={split!r}; allowed: {', '.join(map(repr, LM_SPLITS))}")
    root = stdlib_root()
    chunks, total = [], 0
    for path in stdlib_files(root):
        rel = str(path.relative_to(root))
        if split_of(rel, LM_SPLITS) != split:
            continue
        data = path.read_bytes() + b"\0"
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    buf = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return buf[:max_bytes] if max_bytes is not None else buf
