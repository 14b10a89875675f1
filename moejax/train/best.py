"""The training loop's best evaluation (``keep_best``): the parameters of the evaluation where
the kept metric was best (highest, or lowest with ``keep_best_mode="min"``), and, in a run
directory, their checkpoints beside the run's.

A metric whose name reads as lower-is-better (a loss, a perplexity, a divergence, an error:
:func:`check_keep_best`) is refused without an explicit mode: the default would keep its
worst evaluation.

A run that stops and resumes, or a finished run called again, then ends with the same best
model as one uninterrupted call: the best before the resumed step is read back from
``run_dir/best`` (its newest step at or before the resumed one, verified like every
checkpoint; the metric's value rides in the step's meta record), and the evaluations after it
are run again. The best is written just before each of the run's own checkpoints (parameters
and non-trainable state only, no optimizer state), so every resumable step has the best up to
it on disk.
"""

from __future__ import annotations

import json
import logging
import math
import os

import jax
import jax.numpy as jnp

from moejax.train.checkpoint import Checkpointer, CorruptCheckpointError
from moejax.train.run_state import ResumeError
from moejax.train.step import TrainState

__all__ = ["BestKeeper", "check_keep_best", "MODES"]

log = logging.getLogger(__name__)

MODES = ("max", "min")
# names of metrics where lower is better: whole names, and the endings of longer ones
_LOWER_NAMES = ("loss", "ppl", "perplexity", "kl", "nll", "ce", "bpb", "error", "err", "mse",
                "mae")
_LOWER_ENDINGS = tuple(f"_{n}" for n in _LOWER_NAMES)


def check_keep_best(key: str, mode: str | None) -> str:
    """The mode ``keep_best=key`` runs with: ``mode`` itself (``"max"`` or ``"min"``), or, for
    ``None``, ``"max"``; a ``key`` that reads as lower-is-better (``loss``, ``ppl``, ``kl``,
    ``bpb``, ``error``, ... or a name ending in ``_loss``, ``_ce``, ...: the evaluators'
    ``loss``, ``bpb``, ``val_ce`` and ``val_ppl`` among them) needs its mode said, since the
    default would keep the worst evaluation."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"keep_best_mode={mode!r}; use 'max' (higher is better) or 'min'")
    name = key.lower()
    if mode is None and (name in _LOWER_NAMES or name.endswith(_LOWER_ENDINGS)):
        raise ValueError(f"keep_best={key!r} reads as a metric where lower is better, and "
                         "keep_best keeps the highest by default: pass keep_best_mode='min' "
                         "(or 'max' if higher really is better)")
    return mode or "max"


class BestKeeper:
    """The best of a run's evaluations by ``key`` (``mode``: ``"max"``, higher is better, or
    ``"min"``); ``run_dir``: where its checkpoints go (``None``: in memory only); ``keep``:
    how many best steps stay on disk."""

    def __init__(self, key: str, run_dir=None, *, keep: int = 3, mode: str = "max"):
        if mode not in MODES:
            raise ValueError(f"BestKeeper: mode={mode!r}; use one of {MODES}")
        self.key, self.mode = key, mode
        self.value: float | None = None
        self.step: int | None = None
        self.params = self.rest = None
        self._saved_step: int | None = None
        self.ckpt = (None if run_dir is None else
                     Checkpointer(os.path.join(os.fspath(run_dir), "best"), keep=max(2, keep),
                                  async_save=False))

    def consider(self, ev: dict, step: int, params, rest) -> None:
        """Keep copies of ``params`` / ``rest`` when ``ev[key]`` beats the best so far (in the
        keeper's mode; a NaN evaluation never does, a tie keeps the earlier)."""
        if self.key not in ev:
            raise KeyError(f"keep_best={self.key!r} is not among the evaluation metrics "
                           f"{sorted(ev)}")
        if math.isnan(ev[self.key]):
            return
        value = float(ev[self.key])
        if self.value is None or (value > self.value if self.mode == "max"
                                  else value < self.value):
            self.value, self.step = value, step
            self.params, self.rest = jax.tree.map(jnp.copy, (params, rest))

    def save(self, like: TrainState) -> None:
        """Write the best to ``run_dir/best`` unless it is there already (``like``: the run's
        state, whose key the saved step carries)."""
        if self.ckpt is None or self.step is None or self._saved_step == self.step:
            return
        state = TrainState(step=jnp.asarray(self.step, jnp.int32), params=self.params,
                           opt_state={}, key=like.key, rest=self.rest)
        self.ckpt.save(state, data_position=self.step,
                       config=json.dumps({"keep_best": self.key, "mode": self.mode,
                                          "value": self.value}))
        self._saved_step = self.step

    def resume(self, like: TrainState, start: int, *, main: bool = True) -> None:
        """Take the newest verified best at or before step ``start`` from ``run_dir/best``
        (``like``: a state of the run's structure and placement). Best steps after ``start``
        (written before a crash, and evaluated again by this run) are moved to
        ``run_dir/best/.after-resume/`` by the ``main`` process."""
        if self.ckpt is None:
            return
        if main:
            self.ckpt.clean_stale()
            later = [s for s in self.ckpt.all_steps() if s > start]
            if later:
                log.warning("%s: best steps %s are past the resumed step %d; moved to "
                            ".after-resume/", self.ckpt.directory, later, start)
                self.ckpt.set_aside(later, "after-resume")
        template = like._replace(opt_state={})
        for step in reversed([s for s in self.ckpt.all_steps() if s <= start]):
            try:
                state, meta = self.ckpt.restore(template, step)
            except CorruptCheckpointError as e:
                log.warning("%s; falling back to an earlier best step", e)
                continue
            saved = json.loads(meta["config"])
            by = (saved.get("keep_best"), saved.get("mode", "max"))
            if by != (self.key, self.mode):
                raise ResumeError(
                    f"{self.ckpt.directory} keeps the best by {by[0]!r} ({by[1]}), this run "
                    f"by {self.key!r} ({self.mode}). Fix: resume with keep_best={by[0]!r} "
                    f"and keep_best_mode={by[1]!r}, or start a fresh run directory")
            self.value, self.step = float(saved["value"]), step
            self.params, self.rest = state.params, state.rest
            self._saved_step = step
            return

    def close(self, *, abort: bool = False) -> None:
        """Close the best's checkpointer, if it has one (:meth:`Checkpointer.close`)."""
        if self.ckpt is not None:
            self.ckpt.close(abort=abort)

    @property
    def summary(self) -> dict | None:
        """``{"step", "value", "mode"}`` of the best, or ``None`` before any evaluation."""
        return None if self.step is None else {"step": self.step, "value": self.value,
                                               "mode": self.mode}
