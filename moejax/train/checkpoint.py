"""Checkpoints of a training run on orbax (``CheckpointManager``; no pickle anywhere).

Layout of ``<directory>/<step>/`` (written by orbax into a temporary directory and renamed
only once complete, with ``commit_success.txt`` written on finalisation):

* item ``state`` (orbax ``StandardSave``, tensorstore/OCDBT arrays + JSON metadata)::

      {"params":    nested dict of the model's nnx.Param arrays (fp32 master params),
       "opt_state": optax state (namedtuples stored as lists, dicts of arrays),
       "rest":      non-Param model variables (fixed buffers),
       "step":      int32 scalar,
       "key":       uint32 PRNG key data (jax.random.key_data of the run key)}

* item ``meta`` (orbax ``JsonSave``)::

      {"format": "moejax-checkpoint-v1", "step": int, "data_position": int,
       "config": <moejax.config.to_json text or null>}

Reading a checkpoint with plain orbax (no moejax import; this exact snippet is tested)::

    import os
    import jax
    import orbax.checkpoint as ocp
    ckdir = "RUN_DIR/checkpoints"
    mngr = ocp.CheckpointManager(ckdir)
    step = max(s for s in mngr.all_steps()  # complete steps only (see "latest" below)
               if os.path.exists(os.path.join(ckdir, str(s), "commit_success.txt")))
    ck = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    params = ck["state"]["params"]           # e.g. params["lm_head"]["kernel"] -> jax.Array
    position = ck["meta"]["data_position"]   # batches consumed
    key = jax.random.wrap_key_data(ck["state"]["key"])

(To restore onto another device layout, pass ``StandardRestore(abstract)`` with
``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves.)

"Latest" means the newest *complete* step: a directory named by an integer that holds
orbax's ``commit_success.txt``. orbax's own temporary directories
(``<step>.orbax-checkpoint-tmp-*``) and hand-made or half-copied step directories are ignored.

Multi-host: every process calls ``save``/``restore`` (orbax coordinates the writes);
``directory`` must be on a filesystem all hosts see (NFS, GCS via gcsfuse, ...).

Restoring into a template whose leaves differ from the saved ones (another model config)
raises :class:`CheckpointMismatchError` listing every differing leaf (path, saved shape/dtype
vs expected) before anything is loaded.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from moejax.config import Config, to_json
from moejax.train.step import TrainState

__all__ = [
    "FORMAT",
    "CheckpointMismatchError",
    "Checkpointer",
    "complete_steps",
    "latest_step",
    "to_saveable",
    "check_compatible",
]

FORMAT = "moejax-checkpoint-v1"
COMMIT_FILE = "commit_success.txt"


class CheckpointMismatchError(ValueError):
    """The saved checkpoint does not match the model/optimizer it is restored into."""


def _is_key_array(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_plain(x):
    if isinstance(x, nnx.Variable):
        x = x.get_value()
    return jax.random.key_data(x) if _is_key_array(x) else x


def to_saveable(state: TrainState) -> dict:
    """TrainState -> dict of plain arrays (nnx Variables unwrapped, typed keys as uint32)."""
    is_var = lambda x: isinstance(x, nnx.Variable)
    plain = lambda t: jax.tree.map(_to_plain, t, is_leaf=is_var)
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


class Checkpointer:
    """Save/restore :class:`TrainState` + data position + config under ``directory``.

    ``keep``: how many checkpoints to keep; ``async_save``: write in the background (call
    :meth:`wait` before reading them back; :meth:`close` waits too).
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    # -- writing -------------------------------------------------------------------------
    def save(
        self, state: TrainState, *, data_position: int, config: Config | str | None = None
    ) -> int:
        """Save ``state`` at step ``int(state.step)``; returns the step."""
        step = int(jax.device_get(state.step))
        cfg_json = to_json(config) if isinstance(config, Config) else config
        meta = {
            "format": FORMAT,
            "step": step,
            "data_position": int(data_position),
            "config": cfg_json,
        }
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(to_saveable(state)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        return step

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    # -- reading -------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return latest_step(self.directory)

    def all_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def read_meta(self, step: int | None = None) -> dict:
        step = self._resolve(step)
        return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

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

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Restore into ``template`` (same structure, shapes, dtypes and shardings).

        Returns ``(state, meta)``; ``meta["data_position"]`` is where the data resumes.
        Raises :class:`CheckpointMismatchError` when the leaves differ.
        """
        step = self._resolve(step)
        plain = to_saveable(template)
        saved_meta = self._mngr.item_metadata(step)["state"]
        saved_tree = getattr(saved_meta, "tree", saved_meta)
        check_compatible(saved_tree, plain, where=f"{self.directory}/{step}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, plain)
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        r = out["state"]
        rest_t = template.rest if template.rest is not None else {}

        def refill(tmpl, restored):
            leaves = jax.tree.leaves(restored)
            tleaves, treedef = jax.tree.flatten(tmpl)
            leaves = [
                jax.random.wrap_key_data(v, impl=jax.random.key_impl(t)) if _is_key_array(t) else v
                for t, v in zip(tleaves, leaves)
            ]
            return jax.tree.unflatten(treedef, leaves)

        state = TrainState(
            step=r["step"],
            params=refill(template.params, r["params"]),
            opt_state=refill(template.opt_state, r["opt_state"]),
            key=r["key"],
            rest=refill(rest_t, r["rest"]) if template.rest is not None else None,
        )
        return state, dict(out["meta"])
