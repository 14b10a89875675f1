"""Compressed DeRS checkpoints on orbax: base weights + compact deltas + every other param.

Layout of ``<directory>/`` (orbax ``CompositeCheckpointHandler``; no pickle)::

    item "arrays" (StandardSave): {"base":   {layer: {w_*: [d_in, d_out]}},
                                   "rest":   the model's other parameters (str keys),
                                   "deltas": {"leaf{j}.{index|values|codes|step|offset}": ...}}
    item "meta"   (JsonSave):     {"format": "moejax-ders-compressed-v2",
                                   "ders": CompressedDeRS.meta,
                                   "storage": moejax.delta.storage meta (leaf paths, kinds),
                                   "model_config": moejax.config.to_json of the MoE decoder
                                                   config (or null),
                                   "checksums":    CRC-32 per array of "arrays"
                                                   (moejax.integrity), verified on load;
                                                   a record without them is refused,
                                   "meta_checksum": CRC-32 of the record itself (its other
                                                   keys), verified on load: the DeRS
                                                   settings decide how the deltas are
                                                   put back (v1 records have none)}

The delta arrays are exactly those of :mod:`moejax.delta.storage` (packed codes, smallest
index dtype), so ``compression_report`` byte counts are what is written (orbax may compress
further on disk). :func:`load_compressed` returns a :class:`CompressedDeRS` with integer
block keys, ready for :func:`moejax.ders_compress.synth.build_synth_model` or ``decompress``.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from moejax.config import Config, from_json, to_json
from moejax.delta.storage import StoredDelta, validate_stored
from moejax.ders_compress.compress import CompressedDeRS
from moejax.integrity import CorruptDataError, json_checksum, tree_checksums, verify_checksums

__all__ = ["FORMAT", "save_compressed", "load_compressed", "disk_bytes"]

FORMAT = "moejax-ders-compressed-v2"
_LEGACY_FORMATS = ("moejax-ders-compressed-v1",)  # written before meta had its own checksum


def _str_keys(tree):
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return np.asarray(jax.device_get(tree))


def _int_keys(tree):
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v)
                for k, v in tree.items()}
    return np.asarray(tree)


def save_compressed(directory, c: CompressedDeRS, model_config: Config | None = None) -> str:
    """Write ``c`` to ``directory`` (must not exist); returns the absolute path."""
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path):
        raise FileExistsError(f"save_compressed: {path} exists; pass a new directory")
    tree = {"base": _str_keys(c.base), "rest": _str_keys(c.rest),
            "deltas": {k: np.asarray(v) for k, v in c.stored.arrays.items()}}
    meta = {"format": FORMAT, "ders": c.meta, "storage": c.stored.meta,
            "model_config": to_json(model_config) if model_config is not None else None,
            "checksums": tree_checksums(tree)}
    meta["meta_checksum"] = json_checksum(meta, exclude="meta_checksum")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(path, args=ocp.args.Composite(arrays=ocp.args.StandardSave(tree),
                                                 meta=ocp.args.JsonSave(meta)))
    return path


def load_compressed(directory) -> tuple[CompressedDeRS, Config | None]:
    """Read a checkpoint written by :func:`save_compressed`: ``(compressed, model_config)``."""
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_compressed: no checkpoint directory {path}")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            out = ckptr.restore(path, args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types on damage
        raise CorruptDataError(f"load_compressed: {path} is corrupt or not a compressed DeRS "
                               f"checkpoint ({type(e).__name__}: {str(e)[:300]}). Fix: "
                               "re-run the compression that wrote it") from e
    meta = out["meta"]
    if meta.get("format") not in (FORMAT, *_LEGACY_FORMATS):
        raise ValueError(f"load_compressed: {path} has format {meta.get('format')!r}, expected "
                         f"{FORMAT!r}; was it written by "
                         "moejax.ders_compress.ckpt.save_compressed?")
    arr = out["arrays"]
    if not isinstance(meta.get("checksums"), dict):  # save_compressed always writes them
        raise CorruptDataError(f"load_compressed: {path} is corrupt: its meta record has no "
                               "array checksums, so its arrays cannot be verified. Fix: "
                               "re-run the compression that wrote it")
    if meta["format"] == FORMAT and meta.get("meta_checksum") != json_checksum(
            meta, exclude="meta_checksum"):
        raise CorruptDataError(f"load_compressed: {path} is corrupt: its meta record (the DeRS "
                               "settings, storage layout and model config) was changed after "
                               "it was saved (meta_checksum does not match). Fix: re-run the "
                               "compression that wrote it")
    verify_checksums(jax.tree.map(np.asarray, arr), meta["checksums"],
                     f"compressed DeRS checkpoint {path}")
    stored = StoredDelta({k: np.asarray(v) for k, v in arr["deltas"].items()}, meta["storage"])
    validate_stored(stored, path)
    c = CompressedDeRS(_int_keys(arr["base"]), _int_keys(arr["rest"]), stored, meta["ders"])
    cfg = from_json(meta["model_config"]) if meta.get("model_config") else None
    return c, cfg


def disk_bytes(directory) -> int:
    """Total size of the files under ``directory`` (orbax's on-disk footprint)."""
    total = 0
    for root, _, files in os.walk(directory):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total
