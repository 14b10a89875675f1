"""What the training loop takes besides the model, the data and the ``TrainConfig``
(:class:`LoopOptions`), and what it returns (:class:`History`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import optax
from flax import nnx

from moejax.config import Config
from moejax.train.step import lm_loss_fn

__all__ = ["History", "LoopOptions", "options_of"]


class History(list):
    """Per-step metric dicts; ``memory`` holds ``{"peak_bytes", "argument_bytes"}`` of the
    compiled step when the loop was asked to measure it (else ``None``)."""

    memory: dict | None = None
    best: dict | None = None  # {"step", "value", "mode"} of the kept evaluation (keep_best)
    # parameters without logical axis names, replicated on a mesh of more than one device
    replicated_unnamed: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """Everything :func:`train` and :func:`train_params` take besides the model, the data and
    the :class:`TrainConfig` (pass them as keywords, or as one ``options=`` object).

    loss_fn: ``loss_fn(model_or_params, batch, key) -> loss`` or ``(loss, metrics)``
        (default :func:`moejax.train.step.lm_loss_fn`; :func:`train_params` needs its own).
    tx: any optax transform, or an ``nnx.Optimizer`` over the model (:func:`train` only: its
        transform continues from its state, and the optimizer holds the state the run ends
        with); default: the optimizer and schedule of the ``TrainConfig``.
    run_dir: where logs and checkpoints go; ``None`` writes nothing to disk.
    eval_fn: ``eval_fn(model_or_params, step) -> dict`` every ``eval_every`` steps.
    config: the full experiment config stored with every checkpoint and in
        ``run_dir/config.json`` (default: the ``TrainConfig``).
    mesh: a mesh to use instead of the one built from ``mesh_data`` x ``mesh_expert``, with
        axes ``"data"`` and ``"expert"`` (:func:`moejax.train.mesh.loop_mesh`).
    progress / desc: the progress bar and its label.
    measure_memory: compile the step once more for XLA's memory analysis
        (``History.memory``).
    check_memory: refuse, before the first step, a step whose compiled peak memory exceeds
        the device's (:mod:`moejax.train.budget`).
    keep_best: a key of ``eval_fn``'s result; the model ends with the parameters of the
        evaluation where it was highest (checkpoint selection on validation;
        ``History.best`` says which step), not those of the last step. Only this run's
        evaluations compete (not those of an ``init_from`` run); in a ``run_dir`` the best is
        checkpointed beside the run (:mod:`moejax.train.best`), so a resumed run, or a
        finished one called again, ends with the best of all its evaluations.
    keep_best_mode: ``"min"`` keeps the lowest evaluation instead, ``"max"`` the highest;
        a key that reads as lower-is-better (``loss``, ``ppl``, ``bpb``, ``kl``, ...) is
        refused without it (:func:`moejax.train.best.check_keep_best`).
    init_from: a moejax run directory (or its ``checkpoints/``) whose newest verified
        parameters start this run (its optimizer state and data position are not taken;
        AdamR's anchor is these parameters); a checkpoint in ``run_dir`` still takes
        precedence when this run resumes.
    """

    loss_fn: Callable = lm_loss_fn
    tx: optax.GradientTransformation | None = None
    run_dir: str | os.PathLike | None = None
    eval_fn: Callable | None = None
    config: Config | None = None
    mesh: Any = None
    progress: bool = True
    measure_memory: bool = False
    check_memory: bool = True
    desc: str = "train"
    keep_best: str = ""
    keep_best_mode: str | None = None
    init_from: str | os.PathLike | None = None

    def __post_init__(self):
        """Each option of the wrong kind refused here, before any compute or write (a string
        ``tx`` would fail in the step's set-up, a number ``eval_fn`` only at the first
        evaluation, after the steps before it)."""
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise TypeError(f"{name}={getattr(self, name)!r}: give {what}")

        need(callable(self.loss_fn), "loss_fn", "a function loss_fn(model, batch, key)")
        need(self.tx is None or isinstance(self.tx, nnx.Optimizer)
             or (callable(getattr(self.tx, "init", None))
                 and callable(getattr(self.tx, "update", None))),
             "tx", "an optax transform (e.g. optax.adamw(3e-4)), an nnx.Optimizer or None")
        need(self.eval_fn is None or callable(self.eval_fn), "eval_fn",
             "a function eval_fn(model, step) -> dict, or None")
        for name in ("run_dir", "init_from"):
            need(getattr(self, name) is None or isinstance(getattr(self, name),
                                                           (str, os.PathLike)),
                 name, "a directory path or None")
        need(self.config is None or isinstance(self.config, Config), "config",
             "a moejax Config or None")
        need(isinstance(self.keep_best, str), "keep_best", "an evaluation key (a string)")
        for name in ("progress", "measure_memory", "check_memory"):
            need(isinstance(getattr(self, name), bool), name, "True or False")


def options_of(options: LoopOptions | None, kw: dict) -> LoopOptions:
    if options is not None and kw:
        raise TypeError(f"pass either options= or keywords, not both (got {sorted(kw)})")
    return options if options is not None else LoopOptions(**kw)
