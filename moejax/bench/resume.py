"""Measurements a benchmark keeps as it takes them, so that the same command again (after a
GPU command's time limit stopped it) measures only what is still missing.

    store = MeasurementStore(run.path / "measured.json", basis={"config": to_dict(cfg),
                             "device": device_basis(), "code": source_fingerprint(study),
                             "weights": weights_fingerprint(m)})
    row = store.get("AR dense")
    if row is None:
        row = store.put("AR dense", measure())

A stored measurement is reused only under the same ``basis``: what it was measured from and
on (the run's config, the device, jax, ``XLA_FLAGS``, the kernel table and moejax's source,
the benchmark's own source, the models' weights): a time taken before the code changed is
never reported as the changed code's. A file measured
under another basis, or one that cannot be read back as the store's JSON, is set aside
(:attr:`MeasurementStore.dropped` says why) and everything is measured again. Each
:meth:`~MeasurementStore.put` rewrites the file atomically, so a command killed mid-write
leaves the measurements before it. A run's stores are named ``measured*.json``, which
``overwrite=true`` deletes with the run's other results
(:func:`moejax.harness.run_record.clear_results`).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
from flax import nnx

import moejax
from moejax.files import atomic_write_text
from moejax.integrity import array_checksum, json_checksum
from moejax.kernels.tuning import table_files
from moejax.pytree import named_leaves

__all__ = ["MeasurementStore", "device_basis", "source_fingerprint", "weights_fingerprint",
           "jsonable"]

_FORMAT = 1


def jsonable(value: Any) -> Any:
    """``value`` with numpy and jax scalars and arrays as plain Python numbers and lists
    (tuples as lists), so it reads back from JSON as it was written."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.asarray(value).tolist()
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a measurement holds a {type(value).__name__}, which JSON cannot keep")


def _files_checksum(named_files) -> str:
    """One CRC-32 of ``(name, path)`` pairs: each name, then its file's bytes, in order."""
    crc = 0
    for name, path in named_files:
        crc = zlib.crc32(path.read_bytes(), zlib.crc32(name.encode(), crc))
    return f"{crc & 0xFFFFFFFF:08x}"


def source_fingerprint(*modules: ModuleType) -> str:
    """One checksum of the Python source of ``modules``: a package's every ``.py`` file under
    its folder (by path within it), a module's own file."""
    named = []
    for module in modules:
        path = Path(module.__file__)
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
        named += [(f"{module.__name__}/{f.relative_to(path.parent).as_posix()}", f)
                  for f in files]
    return _files_checksum(named)


def device_basis() -> dict:
    """The device and software a measurement was taken on: platform, device kind and count,
    jax version, ``XLA_FLAGS``, the kernel tables the lowerings read
    (:func:`moejax.kernels.tuning.table_files`, by one checksum of their names and bytes) and
    moejax's source (:func:`source_fingerprint`)."""
    devs = jax.devices()
    tables = [p for p in table_files() if p.is_file()]
    return {"platform": devs[0].platform, "device_kind": devs[0].device_kind,
            "devices": len(devs), "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "kernel_table": _files_checksum((p.name, p) for p in tables) if tables else "none",
            "moejax": source_fingerprint(moejax)}


def weights_fingerprint(tree) -> str:
    """One checksum of every array leaf of ``tree`` (a module: its variables), by path."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    # one leaf on the host at a time: a 2B-parameter target is not copied whole
    sums = {name: array_checksum(x) for name, x in named_leaves(tree)
            if isinstance(x, (np.ndarray, jax.Array))}
    return json_checksum(sums)


class MeasurementStore:
    """Measurements by key, kept in one JSON file under a ``basis`` (module docstring)."""

    def __init__(self, path: str | os.PathLike, basis: Mapping):
        self.path = Path(path)
        self.basis = jsonable(basis)
        self.entries: dict[str, Any] = {}
        self.dropped = ""  # why the file's measurements were not reused ("" if they were)
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            ok = (isinstance(data, dict) and data.get("format") == _FORMAT
                  and isinstance(data.get("entries"), dict)
                  and data.get("checksum") == json_checksum(data))
        except (OSError, ValueError) as e:
            self.dropped = (f"{self.path} cannot be read back ({e}): moved to "
                            f"{self._set_aside()}; measuring again")
            return
        if not ok:
            self.dropped = (f"{self.path} is not a measurement store it wrote: moved to "
                            f"{self._set_aside()}; measuring again")
        elif data.get("basis") != self.basis:
            self.dropped = (f"{self.path} was measured under another config, device, code or "
                            "weights: measuring again")
        else:
            self.entries = data["entries"]

    def _set_aside(self) -> Path:
        """Move a file this store did not write out of the way (never overwrite it): to
        ``<name>.foreign``, ``<name>.foreign.1``, ... beside it."""
        dest, i = self.path.with_name(self.path.name + ".foreign"), 0
        while dest.exists():
            i += 1
            dest = self.path.with_name(f"{self.path.name}.foreign.{i}")
        os.replace(self.path, dest)
        return dest

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str, default=None):
        return self.entries.get(key, default)

    def put(self, key: str, value: Any) -> Any:
        """Keep ``value`` (JSON-able: :func:`jsonable`) under ``key`` and rewrite the file;
        returns the value as it will read back."""
        self.entries[key] = jsonable(value)
        record = {"format": _FORMAT, "basis": self.basis, "entries": self.entries}
        record["checksum"] = json_checksum(record)
        atomic_write_text(self.path, json.dumps(record, allow_nan=True) + "\n")
        return self.entries[key]
