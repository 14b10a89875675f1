"""The on-disk format of a moejax checkpoint, apart from the :class:`~moejax.train.checkpoint.
Checkpointer` that writes and reads it: the format tag and commit marker, the errors, the
plain-array form of a train state, the complete steps of a directory, the checks of what is
read back (array layout against the model, the meta record's own checksum and step), the
gathering of every process's shard checksums, and the release of orbax's save threads that a
failed save leaves waiting.

Layout of ``<directory>/<step>/`` (written by orbax into a temporary directory and renamed
only once complete, with ``commit_success.txt`` written on finalisation):

* item ``state`` (orbax ``StandardSave``, tensorstore/OCDBT arrays + JSON metadata)::

      {"params":    nested dict of the model's nnx.Param arrays (fp32 master params),
       "opt_state": optax state (namedtuples stored as lists, dicts of arrays),
       "rest":      non-Param model variables (fixed buffers),
       "step":      int32 scalar,
       "key":       uint32 PRNG key data (jax.random.key_data of the run key)}

* item ``meta`` (orbax ``JsonSave``)::

      {"format": "moejax-checkpoint-v2", "step": int, "data_position": int,
       "data": <the source's fingerprint (moejax.data's sources have one) or null>,
       "config": <moejax.config.to_json text or null>, "checksums": {path: crc32},
       "meta_checksum": crc32 of the rest of this record}

Reading a checkpoint with plain orbax (no moejax import; this exact snippet is tested, on 1
and 4 devices for a checkpoint saved on 8)::

    import os
    import jax
    import orbax.checkpoint as ocp
    ckdir = "RUN_DIR/checkpoints"
    mngr = ocp.CheckpointManager(ckdir, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    step = max(s for s in mngr.all_steps()  # complete steps: orbax's commit marker
               if os.path.exists(os.path.join(ckdir, str(s), "commit_success.txt")))
    here = jax.sharding.make_single_device_sharding(jax.devices()[0])  # any device count
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here),
                          mngr.item_metadata(step)["state"])
    ck = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    params = ck["state"]["params"]           # e.g. params["lm_head"]["kernel"] -> jax.Array
    position = ck["meta"]["data_position"]   # batches consumed
    key = jax.random.wrap_key_data(ck["state"]["key"])

The target places every array on this process's first device; a checkpoint saved on any
mesh restores so (orbax refuses a target-less restore onto another topology). For a
sharded restore, give the leaves the ``NamedSharding`` of a mesh of this machine instead.
``moejax.train.restore_params`` does the same for a model: the parameters of a run's
newest verified step, into a model of the same structure (``init_from=`` of a new run).

"Latest" means the newest *complete* step: a directory named by an integer that holds
orbax's ``commit_success.txt``. orbax's own temporary directories
(``<step>.orbax-checkpoint-tmp-*``) and hand-made or half-copied step directories are ignored.

Integrity: ``meta["checksums"]`` holds a CRC-32 per array of ``state``
(:mod:`moejax.integrity`), or, when the arrays span processes (multi-host),
``meta["shard_checksums"]`` one per shard region, each process checksumming its own shards
and the records gathered to every process (each process verifies its shards on restore);
``meta["meta_checksum"]`` holds one of the meta record itself (so an edited data position
or config is caught too); and the step stored in ``meta`` and ``state``
must be the step its directory is named for (a renamed step directory is caught), all
verified on restore.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from moejax.integrity import CorruptDataError, json_checksum
from moejax.train.step import TrainState

__all__ = ["FORMAT", "COMMIT_FILE", "CheckpointMismatchError", "CorruptCheckpointError",
           "CheckpointWriteError", "disk_full", "release_orbax_threads", "to_saveable",
           "complete_steps", "latest_step", "check_compatible", "verify_meta", "gather_dicts",
           "host_tree", "is_key_array", "to_plain", "refill"]

FORMAT = "moejax-checkpoint-v2"
_LEGACY_FORMATS = ("moejax-checkpoint-v1",)  # written before meta had its own checksum
COMMIT_FILE = "commit_success.txt"


class CheckpointMismatchError(ValueError):
    """The saved checkpoint does not match the model/optimizer it is restored into."""


class CorruptCheckpointError(CorruptDataError):
    """A committed step cannot be read back intact (checksum mismatch, missing or damaged
    files)."""


class CheckpointWriteError(OSError):
    """The checkpoint directory cannot be written (read-only, no permission, disk full)."""


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk is full: an ``OSError`` with ``ENOSPC``, or tensorstore's
    ``RESOURCE_EXHAUSTED ... No space left on device`` (a ``ValueError`` through orbax)."""
    return ((isinstance(e, OSError) and e.errno == errno.ENOSPC)
            or "No space left on device" in str(e))


def release_orbax_threads(timeout_s: float = 30.0) -> int:
    """Unblock orbax's background save threads still waiting for signals that a failed or
    interrupted save will never send (they are non-daemon: left alone they hang the
    interpreter at exit). Returns how many were released. Threads already writing finish
    their work.

    orbax has no public call for this (``CheckpointManager.close()`` waits on the same
    signals), so this reads its ``_src.futures.future`` module: the signalling threads and
    ``set_signals``. If a newer orbax moves them, a ``RuntimeWarning`` says so and nothing is
    released; ``tests/test_faults.py`` (a failing and an interrupted save must exit within a
    time limit) fails then, instead of a user's run hanging at exit."""
    try:
        from orbax.checkpoint._src.futures import future as ofuture
        thread_type, set_signals = ofuture._SignalingThread, ofuture.set_signals
    except (ImportError, AttributeError) as e:
        warnings.warn(f"cannot release orbax's waiting save threads ({e}): this orbax "
                      "version moved them; a failed save may hang the interpreter at exit",
                      RuntimeWarning, stacklevel=2)
        return 0
    threads = [t for t in threading.enumerate() if isinstance(t, thread_type) and t.is_alive()]
    for t in threads:
        t.cancel()
        set_signals(t._receive_signals, operation_id=t._operation_id)
    for t in threads:
        try:
            t.join(timeout_s)  # bounded; a cancelled thread's join raises CancelledError
        except concurrent.futures.CancelledError:
            pass
    return len(threads)


def is_key_array(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_plain(x):
    if isinstance(x, nnx.Variable):
        x = x.get_value()
    return jax.random.key_data(x) if is_key_array(x) else x


def refill(tmpl, restored):
    """``restored``'s leaves in ``tmpl``'s structure, typed keys where ``tmpl`` has them
    (checkpoints hold a key's uint32 data)."""
    leaves = jax.tree.leaves(restored)
    tleaves, treedef = jax.tree.flatten(tmpl)
    leaves = [
        jax.random.wrap_key_data(v, impl=jax.random.key_impl(t)) if is_key_array(t) else v
        for t, v in zip(tleaves, leaves)
    ]
    return jax.tree.unflatten(treedef, leaves)


def to_saveable(state: TrainState) -> dict:
    """TrainState -> dict of plain arrays (nnx Variables unwrapped, typed keys as uint32)."""
    is_var = lambda x: isinstance(x, nnx.Variable)
    plain = lambda t: jax.tree.map(to_plain, t, is_leaf=is_var)
    return {
        "params": plain(state.params),
        "opt_state": plain(state.opt_state),
        "rest": plain(state.rest) if state.rest is not None else {},
        "step": state.step,
        "key": state.key,
    }


def complete_steps(directory) -> list[int]:
    """Sorted steps under ``directory`` whose save was finalised (``commit_success.txt``)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        if name.isdigit() and os.path.isfile(os.path.join(directory, name, COMMIT_FILE)):
            steps.append(int(name))
    return sorted(steps)


def latest_step(directory) -> int | None:
    """Newest complete step under ``directory`` (``None`` if there is none)."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def _leaf_desc(x) -> str:
    return f"{tuple(x.shape)} {np.dtype(x.dtype).name}"


def check_compatible(saved_meta_tree, template_tree, where: str = "") -> None:
    """Compare saved array metadata with a template; raise listing every differing leaf."""
    saved = {
        "/".join(k): v for k, v in ocp.tree.to_flat_dict(saved_meta_tree).items() if v is not None
    }
    want = {
        "/".join(k): v for k, v in ocp.tree.to_flat_dict(template_tree).items() if v is not None
    }
    problems = []
    for k in sorted(set(saved) | set(want)):
        if k not in want:
            problems.append(f"  {k}: in checkpoint ({_leaf_desc(saved[k])}) but not in the model")
        elif k not in saved:
            problems.append(f"  {k}: expected {_leaf_desc(want[k])} but missing from checkpoint")
        elif tuple(saved[k].shape) != tuple(want[k].shape) or np.dtype(saved[k].dtype) != np.dtype(
            want[k].dtype
        ):
            problems.append(
                f"  {k}: saved {_leaf_desc(saved[k])} vs expected {_leaf_desc(want[k])}"
            )
    if problems:
        shown = problems[:40] + (
            [f"  ... and {len(problems) - 40} more"] if len(problems) > 40 else []
        )
        raise CheckpointMismatchError(
            f"checkpoint {where} does not match the model/optimizer being restored "
            f"({len(problems)} differing leaves):\n" + "\n".join(shown) + "\nFix: rebuild the "
            "model and optimizer from the config stored with the checkpoint (meta['config'] / "
            "config.json in the run directory), or start a fresh run directory."
        )


def verify_meta(meta: dict, step: int, state_step: int, where: str) -> None:
    """The meta record is intact (its own checksum) and describes this step: the directory's
    name, the record's step and the saved state's step agree."""
    fmt = meta.get("format")
    if fmt == FORMAT:
        want = meta.get("meta_checksum")
        if want != json_checksum(meta, exclude="meta_checksum"):
            raise CorruptCheckpointError(
                f"{where} is corrupt: its meta record (data position, config, checksums) was "
                "changed after it was saved (meta_checksum does not match)")
    elif fmt not in _LEGACY_FORMATS:
        raise CorruptCheckpointError(f"{where} is corrupt: unknown meta format {fmt!r}")
    if meta.get("step") != step or state_step != step:
        raise CorruptCheckpointError(
            f"{where} holds the state of step {state_step} (meta says {meta.get('step')}): "
            "the step directory was renamed or copied over another")


def gather_dicts(local: dict) -> dict:
    """The union of every process's ``local`` string dict, on every process (a collective:
    all processes call it)."""
    data = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size]))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    merged: dict = {}
    for row, n in zip(rows, sizes):
        merged.update(json.loads(bytes(row[:n]).decode()))
    return merged


def host_tree(tree):
    """Host copies of a tree's arrays, or ``None`` when some array spans other processes
    (multi-host: each process holds only its shards, which it checksums itself)."""
    leaves = jax.tree.leaves(tree)
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        return None
    return jax.device_get(tree)
