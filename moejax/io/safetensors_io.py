"""Safetensors in and out: a validating reader, and export/import of moejax params.

* :func:`read_safetensors` checks the header (length, JSON, dtypes, shapes, offsets inside the
  file) before reading, so a truncated or malformed file raises
  :class:`~moejax.io._common.WeightFileError` naming the file and the broken tensor, instead
  of a bare library error. Read with ``safetensors.numpy`` (no torch, nothing unpickled).
* :func:`export_params` writes a module's (or a flat dict's) parameters to one ``.safetensors``
  file in moejax naming (``blocks/0/attn/w_q``, ``[in, out]``), with string metadata (e.g. the
  model config as JSON under ``"moejax_config"``). A module's other variables that are part of
  the model (its buffers: DeRS's indices and frozen weights, an extracted FFN's expert masks)
  go with them, named ``buffer:<path>``; RNG state does not.
* :func:`import_params` reads such a file back into a model built by a factory (shapes and
  names are checked; see :func:`moejax.io._common.build_with_params`), buffers included: a
  model whose buffers the file does not hold is refused, since it would keep the factory's.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from moejax.extras import missing_extra

try:
    import safetensors.numpy
except ImportError as _e:
    raise missing_extra(_e, "moejax.io.safetensors_io (safetensors weights)") from None

from moejax.config import to_json
from moejax.files import atomic_write_bytes
from moejax.io._common import (
    BUFFER,
    WeightFileError,
    build_with_params,
    existing_file,
    flat_buffers,
    flat_params,
)

__all__ = ["read_safetensors", "read_safetensors_metadata", "export_params", "import_params"]

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
_MAX_HEADER = 100 * 1024 * 1024


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object that names a key twice is refused (which tensor would be meant?)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the header names {key!r} twice")
        out[key] = value
    return out


def _header(path: Path, fix: str) -> tuple[dict, int, int]:
    """``(header dict, data start, file size)`` after validating every entry."""
    existing_file(path, fix)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise WeightFileError(path, f"truncated: {size} bytes, shorter than the 8-byte "
                                  "safetensors header length", fix)
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise WeightFileError(path, f"malformed or truncated safetensors file: header "
                                  f"length {n} does not fit in the file ({size} bytes)", fix)
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise WeightFileError(path, f"malformed safetensors header (not valid JSON: {e})",
                              fix) from None
    except RecursionError:
        raise WeightFileError(path, "malformed safetensors header (nested too deeply to be "
                              "a tensor table)", fix) from None
    start = 8 + n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WeightFileError(path, "malformed header: __metadata__ must map names to strings",
                              fix)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightFileError(path, f"malformed header entry for tensor {name!r}: {info!r}",
                                  fix) from None
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if (not isinstance(dtype, str) or not all(is_int(d) and d >= 0 for d in shape)
                or not (is_int(a) and is_int(b))):
            raise WeightFileError(path, f"malformed header entry for tensor {name!r}: dtype "
                                  "must be a string, shape and data_offsets non-negative "
                                  f"integers (got {info!r})", fix)
        if dtype not in _DTYPE_BYTES:
            raise WeightFileError(path, f"tensor {name!r} has unsupported dtype {dtype!r}", fix)
        want = _DTYPE_BYTES[dtype] * math.prod(shape)  # exact: a crafted shape cannot wrap
        if b - a != want or a < 0:
            raise WeightFileError(path, f"tensor {name!r}: data_offsets [{a}, {b}] hold "
                                  f"{b - a} bytes but {dtype} {shape} needs {want}", fix)
        if start + b > size:
            raise WeightFileError(path, f"truncated: tensor {name!r} needs bytes up to "
                                  f"{start + b} but the file has {size}", fix)
    return header, start, size


def read_safetensors_metadata(path, *, fix: str = "re-export or reinstall the file") -> dict:
    """The ``__metadata__`` string dict of a (validated) safetensors file."""
    header, _, _ = _header(Path(path), fix)
    return dict(header.get("__metadata__") or {})


def read_safetensors(path, *, fix: str = "re-export or reinstall the file"
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file, validated first (see module doc).

    ``fix`` is appended to error messages (e.g. the pip command of the weight package).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    header, _, _ = _header(path, fix)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise WeightFileError(path, f"cannot read safetensors data: {e}", fix) from None
    return tensors, dict(header.get("__metadata__") or {})


def export_params(model_or_params, path, *, metadata: Mapping[str, str] | None = None,
                  config=None) -> Path:
    """Write parameters to ``path`` (atomically: temp file then rename).

    ``model_or_params``: an ``nnx.Module`` or a flat ``{"a/b": array}`` dict. ``config``: a
    moejax :class:`~moejax.config.Config` stored as JSON under metadata ``"moejax_config"``.
    bfloat16 arrays are written as BF16.
    """
    if isinstance(model_or_params, nnx.Module):
        flat = flat_params(model_or_params)
        flat.update({BUFFER + k: v for k, v in flat_buffers(model_or_params).items()})
    else:
        flat = dict(model_or_params)
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in flat.items()}
    meta = {"format": "moejax"}
    if config is not None:
        meta["moejax_config"] = to_json(config)
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    return atomic_write_bytes(path, safetensors.numpy.save(arrays, metadata=meta))


def import_params(path, make_model: Callable[[], nnx.Module]) -> nnx.Module:
    """A model from ``make_model`` filled with the parameters and buffers exported to
    ``path``."""
    tensors, _ = read_safetensors(path)
    buffers = {k[len(BUFFER):]: tensors.pop(k) for k in list(tensors) if k.startswith(BUFFER)}
    return build_with_params(make_model, tensors, path, buffers=buffers)
