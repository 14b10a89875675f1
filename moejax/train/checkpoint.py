"""A training run's checkpoints on orbax (``CheckpointManager``; no pickle anywhere): the
:class:`Checkpointer`, which saves a train state with its data position, config and
checksums and restores it verified, and :func:`restore_params`, the weights of one run's
newest verified step in another model.

The layout of a step, how to read one with plain orbax (no moejax import) and what is
checksummed are the format's: :mod:`moejax.train.checkpoint_format`.

Multi-host: every process calls ``save``/``restore`` (orbax coordinates the writes);
``directory`` must be on a filesystem all hosts see (NFS, GCS via gcsfuse, ...).

Restoring into a template whose leaves differ from the saved ones (another model config)
raises :class:`CheckpointMismatchError` listing every differing leaf (path, saved shape/dtype
vs expected) before anything is loaded.

Everything read back is verified (the format's checksums, the meta record's own and the
step); a step whose arrays, files or record are damaged raises
:class:`CorruptCheckpointError`, and :meth:`Checkpointer.restore_latest` falls back to
the newest earlier step that verifies, saying so. Saves check first that the directory is
writable, and a save that fails (or is interrupted by Ctrl-C) releases orbax's background
threads, so no failure path hangs the process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from moejax.config import Config, to_json
from moejax.files import unused_name
from moejax.integrity import (
    CorruptDataError,
    json_checksum,
    shard_checksums,
    tree_checksums,
    verify_checksums,
    verify_shard_checksums,
)
from moejax.pytree import count_bytes
from moejax.train.checkpoint_format import (
    COMMIT_FILE,
    FORMAT,
    CheckpointMismatchError,
    CheckpointWriteError,
    CorruptCheckpointError,
    check_compatible,
    complete_steps,
    disk_full,
    gather_dicts,
    host_tree,
    latest_step,
    refill,
    release_orbax_threads,
    to_plain,
    to_saveable,
    verify_meta,
)
from moejax.train.step import TrainState

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "CheckpointMismatchError",
    "ForeignCheckpointError",
    "restore_params",
    "CorruptCheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "complete_steps",
    "latest_step",
    "to_saveable",
    "check_compatible",
]

class ForeignCheckpointError(ValueError):
    """A run directory holds a checkpoint moejax did not write; nothing is moved."""


def restore_params(source, model: nnx.Module | None = None, *, params=None):
    """The parameters of the newest complete step of a moejax run (``source``: its run
    directory or its ``checkpoints/``), verified, into ``model`` (in place; returned) or
    onto the pytree ``params`` (returned): the start of a new run from another one's
    weights (``TrainConfig.init_from``). Into a model, its other variables come with them
    (buffers that give the parameters their meaning, such as DeRS-SM's indices and frozen
    shared weights, a norm's statistics, an rng stream's state). Shapes must match
    (:class:`CheckpointMismatchError` names every differing leaf); the optimizer state and
    data position are not taken."""
    if (model is None) == (params is None):
        raise TypeError("restore_params(source, model) or restore_params(source, params=...)")
    source = os.path.abspath(os.fspath(source))
    directory = (os.path.join(source, "checkpoints")
                 if os.path.isdir(os.path.join(source, "checkpoints")) else source)
    if not complete_steps(directory):
        raise FileNotFoundError(f"init_from={source}: no complete moejax checkpoint under "
                                f"{directory}. Fix: name a run directory that finished a "
                                "checkpoint (its checkpoints/ folder holds numbered steps)")
    ckpt = Checkpointer(directory)
    try:
        if model is not None:
            is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
            state, rest = nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))
            plain, rest_plain = (jax.tree.map(to_plain, t, is_leaf=is_var) for t in (state, rest))
            new_params, new_rest = ckpt.restore_params(plain, rest=rest_plain)
            nnx.update(model, new_params, refill(rest, new_rest))  # keys typed again
            return model
        return ckpt.restore_params(params)
    finally:
        ckpt.close()


class Checkpointer:
    """Save/restore :class:`TrainState` + data position + config under ``directory``.

    ``keep``: how many checkpoints to keep; ``async_save``: write in the background (call
    :meth:`wait` before reading them back; :meth:`close` waits too).
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=False
        )
        if not os.path.isdir(self.directory):
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as e:
                raise CheckpointWriteError(
                    e.errno, f"cannot create the checkpoint directory {self.directory}: "
                    f"{e.strerror}. Fix: choose a writable run directory (out=...)") from None
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    # -- writing -------------------------------------------------------------------------
    def _check_writable(self) -> None:
        probe = os.path.join(self.directory, f".write-probe-{os.getpid()}")
        try:
            with open(probe, "wb") as f:
                f.write(b"ok")
                f.flush()
                os.fsync(f.fileno())
            os.unlink(probe)
        except OSError as e:
            raise CheckpointWriteError(
                e.errno, f"cannot write a checkpoint under {self.directory}: {e.strerror}. "
                "Nothing was saved; the previous checkpoints are intact. Fix: free disk space "
                "or make the directory writable, or choose another run directory") from None

    def save(
        self, state: TrainState, *, data_position: int, config: Config | str | None = None,
        data: str | None = None,
    ) -> int:
        """Save ``state`` at step ``int(state.step)``; returns the step. ``data``: the
        identity of the data stream (a source's ``fingerprint``), which a resumed run must
        match."""
        step = int(jax.device_get(state.step))
        cfg_json = to_json(config) if isinstance(config, Config) else config
        plain = to_saveable(state)
        host = host_tree(plain)
        meta = {
            "format": FORMAT,
            "step": step,
            "data_position": int(data_position),
            "data": None if data is None else str(data),
            "config": cfg_json,
            "checksums": tree_checksums(host) if host is not None else None,
        }
        if host is None:  # multi-host: every process checksums its shards, all gathered
            meta["shard_checksums"] = gather_dicts(shard_checksums(plain))
        meta["meta_checksum"] = json_checksum(meta, exclude="meta_checksum")
        self._step_bytes = count_bytes(plain)
        self._check_writable()
        try:
            self._mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(plain), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        except BaseException as e:
            release_orbax_threads()
            if disk_full(e):
                raise self._disk_full_error(step) from None
            if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
                raise CheckpointWriteError(
                    e.errno, f"a checkpoint save under {self.directory} failed (reported while "
                    f"saving step {step}): {e}. Earlier complete steps are intact") from e
            raise
        return step

    def _disk_full_error(self, step=None) -> CheckpointWriteError:
        """The disk filled during a save: the partial step is removed (it must never look like
        a checkpoint) and one line names the directory and the space a step needs."""
        for name in os.listdir(self.directory):
            full = os.path.join(self.directory, name)
            partial = name.isdigit() and not os.path.isfile(os.path.join(full, COMMIT_FILE))
            if os.path.isdir(full) and (partial or ".orbax-checkpoint-tmp" in name):
                shutil.rmtree(full, ignore_errors=True)
        need = getattr(self, "_step_bytes", None)
        return CheckpointWriteError(
            errno.ENOSPC, f"disk full: a checkpoint{'' if step is None else f' of step {step}'}"
            f" did not fit under {self.directory}"
            + (f" (a step needs about {need / 1e6:.1f} MB)" if need else "")
            + ". The partial step was removed; earlier complete steps are intact. Fix: free "
            "disk space or choose another run directory (out=...), then run the same command "
            "to resume")

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self, *, abort: bool = False, grace_s: float = 120.0) -> None:
        """Wait for pending saves and close.

        ``abort=True`` (a failure path: an exception or Ctrl-C is on its way out): give a save
        in flight up to ``grace_s`` seconds to finish (a good save is not thrown away), then
        release orbax's threads that still wait (a second Ctrl-C releases them at once), so
        closing never hangs; an abandoned step stays uncommitted and is never resumed from.
        Errors of the abandoned save are not raised over the one already propagating."""
        if not abort:
            try:
                self._mngr.wait_until_finished()
            except BaseException as e:
                release_orbax_threads()
                try:
                    self._mngr.close()
                except BaseException:  # noqa: BLE001 - the first error is the one to report
                    pass
                if disk_full(e):
                    raise self._disk_full_error() from None
                if isinstance(e, OSError):
                    raise CheckpointWriteError(
                        e.errno, f"a checkpoint save under {self.directory} failed in the "
                        f"background: {e}. Earlier complete steps are intact. Fix: free disk "
                        "space or make the directory writable") from e
                raise
            self._mngr.close()
            return
        done = threading.Event()

        def waiter():
            try:
                self._mngr.wait_until_finished()
            except BaseException:  # noqa: BLE001 - reported by the propagating error
                pass
            finally:
                done.set()

        threading.Thread(target=waiter, daemon=True, name="moejax-ckpt-wait").start()
        try:
            finished = done.wait(grace_s)
        except BaseException:  # noqa: BLE001 - Ctrl-C while waiting: stop waiting
            finished = False
        if not finished:
            log.warning("checkpoints: abandoning an unfinished save under %s", self.directory)
            release_orbax_threads()
            done.wait(30.0)
        try:
            self._mngr.close()
        except BaseException:  # noqa: BLE001
            pass

    def clean_stale(self) -> list[str]:
        """Move aside step directories without a commit marker (``<step>`` without
        ``commit_success.txt``, orbax ``*.orbax-checkpoint-tmp*``), left by an interrupted
        save or a half copy: they are never resumed from, but a new save of the same step
        would fail on them. They go to ``<directory>/.stale/<name>-<time>``; returns the
        names moved. Call only when no other process writes to the directory."""
        moved = []
        if not os.path.isdir(self.directory):
            return moved
        for name in sorted(os.listdir(self.directory)):
            full = os.path.join(self.directory, name)
            stale_step = name.isdigit() and not os.path.isfile(os.path.join(full, COMMIT_FILE))
            if os.path.isdir(full) and (stale_step or ".orbax-checkpoint-tmp" in name):
                self._quarantine(name, "stale")
                moved.append(name)
        if moved:
            log.warning("checkpoints: moved uncommitted step directories %s of %s to .stale/ "
                        "(interrupted saves; never resumed from)", moved, self.directory)
            self._mngr.reload()
        return moved

    def set_aside(self, steps, kind: str) -> list[str]:
        """Move the complete ``steps`` to ``<directory>/.<kind>/<step>-<time>`` (kept, never
        read again by a run); returns where they went. Call only when no other process writes
        to the directory."""
        moved = [self._quarantine(str(step), kind) for step in steps]
        if moved:
            self._mngr.reload()
        return moved

    def _quarantine(self, name: str, kind: str) -> str:
        dest_dir = os.path.join(self.directory, f".{kind}")
        os.makedirs(dest_dir, exist_ok=True)
        dest = unused_name(os.path.join(dest_dir, name))
        os.replace(os.path.join(self.directory, name), dest)
        return dest

    # -- reading -------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return latest_step(self.directory)

    def all_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def read_meta(self, step: int | None = None) -> dict:
        step = self._resolve(step)
        return self._read(step, lambda: self._mngr.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def _resolve(self, step):
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint under {self.directory}")
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"step {step} is not a complete checkpoint under {self.directory}; "
                f"complete steps: {self.all_steps()}"
            )
        return step

    def _read(self, step: int, fn):
        """Run an orbax read of ``step``; damage (missing ``_METADATA``, unreadable array
        files, bad JSON) becomes :class:`CorruptCheckpointError` naming the step."""
        where = f"checkpoint step {step} under {self.directory}"
        try:
            return fn()
        except (CheckpointMismatchError, CorruptDataError):
            raise
        except FileNotFoundError as e:
            missing = os.path.basename(getattr(e, "filename", None) or str(e).split(":")[-1])
            raise CorruptCheckpointError(
                f"{where} is corrupt: a file it needs is missing ({missing.strip()!s}: {e})"
            ) from e
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types on damage
            raise CorruptCheckpointError(
                f"{where} is corrupt or unreadable ({type(e).__name__}: {str(e)[:300]})"
            ) from e

    def _verified_read(self, step: int, abstract_src, check=None, *, parts: tuple = ()):
        """The ``state`` item of ``step`` restored onto ``abstract_src``'s shapes, dtypes and
        shardings (arrays or ``ShapeDtypeStruct`` leaves) and its ``meta``, both verified
        (files present, leaves compatible with ``check``, record and checksums). With
        ``parts`` (subtrees of the state, ``check`` a dict of their templates), those
        subtrees alone are checked."""
        self.check_ours(step)
        where = f"checkpoint step {step} under {self.directory}"
        for name in ("_CHECKPOINT_METADATA", "state", "meta"):
            if not os.path.exists(os.path.join(self.directory, str(step), name)):
                raise CorruptCheckpointError(f"{where} is corrupt: {name} is missing")
        if not os.path.exists(os.path.join(self.directory, str(step), "state", "_METADATA")):
            raise CorruptCheckpointError(f"{where} is corrupt: state/_METADATA (orbax's index "
                                         "of the saved arrays) is missing")
        saved_meta = self._read(step, lambda: self._mngr.item_metadata(step)["state"])
        saved_tree = getattr(saved_meta, "tree", saved_meta)
        if check is not None:
            for part in parts or ("",):
                check_compatible(saved_tree[part] if part else saved_tree,
                                 check[part] if part else check,
                                 where=f"{self.directory}/{step}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_src)
        out = self._read(step, lambda: self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        ))
        r, meta = out["state"], dict(out["meta"])
        verify_meta(meta, step, int(np.asarray(jax.device_get(r["step"]))), where)
        # with ``parts``, those subtrees' arrays alone are compared (the rest was read onto a
        # structure from orbax's metadata, whose paths differ from the saved state's)
        checked = {part: r[part] for part in parts} if parts else r

        def keep(k: str) -> bool:
            return not parts or any(k.startswith(f"{part}/") for part in parts)
        try:
            if meta.get("checksums"):
                host = host_tree(checked)
                # (saved by one process and restored across several, the whole arrays
                # are on no one process: nothing to compare them with)
                if host is not None:
                    verify_checksums(host, {k: v for k, v in meta["checksums"].items()
                                            if keep(k)}, where)
            elif meta.get("shard_checksums"):
                verify_shard_checksums(checked, {k: v for k, v in
                                                 meta["shard_checksums"].items() if keep(k)},
                                       where)
        except CorruptDataError as e:
            raise CorruptCheckpointError(str(e)) from None
        return r, meta

    def check_ours(self, step: int) -> None:
        """Refuse (:class:`ForeignCheckpointError`), without touching it, a complete step
        that moejax did not write: orbax's record of its items names no ``meta`` item (a
        plain orbax save). A step of ours whose ``meta`` files were lost is damage instead."""
        where = os.path.join(self.directory, str(step))
        try:  # orbax's record of the step's items (a damaged step without it is ours to judge)
            with open(os.path.join(where, "_CHECKPOINT_METADATA")) as f:
                items = set(json.load(f).get("item_handlers") or {})
        except (OSError, ValueError, AttributeError):
            return
        if items and "meta" not in items:
            raise ForeignCheckpointError(
                f"{where} is a checkpoint moejax did not write (no meta item: a plain orbax "
                "save?); it is left as it is. Fix: give the run another directory (out=... / "
                "run_dir=...), and restore those weights with plain orbax (the snippet in "
                "moejax.train.checkpoint) or start from a moejax run with init_from=")

    def restore_params(self, params, step: int | None = None, *, rest=None):
        """The parameters of ``step`` (default: the newest complete one) alone, verified
        like :meth:`restore`, placed as ``params`` (a pytree of the model's parameter arrays,
        e.g. ``nnx.state(model, nnx.Param)`` as a pure dict) is; with ``rest`` (the model's
        other variables, plain arrays), ``(params, rest)``, both verified. The optimizer
        state, key and data position of the run are not read into anything."""
        step = self._resolve(step)
        saved = self._read(step, lambda: self._mngr.item_metadata(step)["state"])
        saved = getattr(saved, "tree", saved)
        here = jax.sharding.make_single_device_sharding(jax.devices()[0])
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), saved)
        abstract["params"] = params
        check = {"params": params}
        if rest is not None:
            abstract["rest"] = check["rest"] = rest
        r, _ = self._verified_read(step, abstract, check=check, parts=tuple(check))
        return r["params"] if rest is None else (r["params"], r["rest"])

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Restore into ``template`` (same structure, shapes, dtypes and shardings).

        Returns ``(state, meta)``; ``meta["data_position"]`` is where the data resumes.
        Raises :class:`CheckpointMismatchError` when the leaves differ and
        :class:`CorruptCheckpointError` when the step's files or checksums are damaged.
        """
        step = self._resolve(step)
        plain = to_saveable(template)
        r, meta = self._verified_read(step, plain, check=plain)
        rest_t = template.rest if template.rest is not None else {}

        state = TrainState(
            step=r["step"],
            params=refill(template.params, r["params"]),
            opt_state=refill(template.opt_state, r["opt_state"]),
            key=r["key"],
            rest=refill(rest_t, r["rest"]) if template.rest is not None else None,
        )
        return state, meta

    def restore_latest(self, template: TrainState, *, quarantine: bool = False
                       ) -> tuple[TrainState, dict] | None:
        """Restore the newest complete step that verifies; ``None`` if there is no step.

        A corrupt step is skipped with a warning naming it and the problem (and, with
        ``quarantine``, moved to ``<directory>/.corrupt/`` so the run can save that step
        again). Raises :class:`CorruptCheckpointError` when steps exist but none verifies,
        :class:`CheckpointMismatchError` when the model does not fit (no fallback: an earlier
        step would not fit either)."""
        problems = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self.restore(template, step)
            except CorruptCheckpointError as e:
                problems.append(str(e))
                log.warning("%s; falling back to an earlier step", e)
                if quarantine:
                    self._quarantine(str(step), "corrupt")
                continue
            if problems:
                log.warning("resumed from step %d, the newest step that verifies", step)
                meta["skipped_corrupt"] = problems
            if quarantine and problems:
                self._mngr.reload()
            return state, meta
        if problems:
            fix = ("the damaged steps were moved to .corrupt/; start a fresh run directory or "
                   "retrain" if quarantine else "start a fresh run directory or retrain")
            raise CorruptCheckpointError(
                f"no checkpoint under {self.directory} verifies:\n  " + "\n  ".join(problems)
                + f"\nFix: {fix}")
        return None
