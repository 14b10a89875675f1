"""What a training run's directory holds between runs: opening it to start or resume
(:func:`open_run_dir`: stale saves moved aside, the newest verifying checkpoint restored, its
config compared with this run's, before anything is written), the settings that may change
across a resumption (:func:`config_differences`), and the signal guard that turns Ctrl-C or
SIGTERM into a stop at the end of a step (:class:`CtrlC`), the one that turns SIGTERM into
Ctrl-C's ``KeyboardInterrupt`` outside a loop (:func:`sigterm_as_interrupt`), and the one that
holds both back while a step must not be cut in two (:func:`stops_deferred`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading

from moejax.config import to_json
from moejax.files import atomic_write_text
from moejax.integrity import flatten_dict
from moejax.train.checkpoint import Checkpointer, CorruptCheckpointError, latest_step
from moejax.train.logs import read_csv

__all__ = ["CtrlC", "ResumeError", "check_resume", "config_differences", "data_differences",
           "open_run_dir", "evaluation_pending", "sigterm_as_interrupt", "stops_deferred"]

log = logging.getLogger("moejax.train.loop")  # the loop's messages, one logger


class CtrlC:
    """While the loop runs (main thread only), the first Ctrl-C or SIGTERM (the usual
    preemption signal of a cluster) is recorded and raised as ``KeyboardInterrupt`` at the end
    of the current step, after its checkpoint if one is due and once the save in flight has
    finished (a signal in the middle of an orbax save could otherwise be swallowed by orbax's
    asyncio machinery, or tear the save); a second signal raises at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.pressed, self.signal_name, self._prev = False, "", {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._prev[s] = signal.signal(s, self._handler) or signal.SIG_DFL

    def _handler(self, signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.pressed:
            raise KeyboardInterrupt(f"second {name}: stopping at once")
        self.pressed, self.signal_name = True, name
        log.warning("%s: stopping after this step (again to stop at once)", name)

    def restore(self) -> None:
        for s, prev in self._prev.items():
            signal.signal(s, prev or signal.SIG_DFL)
        self._prev = {}


@contextlib.contextmanager
def sigterm_as_interrupt(message: str):
    """SIGTERM (a cluster's preemption, ``kill``) raised as ``KeyboardInterrupt(message)``
    while the block runs (main thread only), as Ctrl-C is: a study stopped between its
    trainings then ends as an interrupted run, in one line, instead of dying unmarked. A
    training loop inside takes both signals over while it runs (:class:`CtrlC`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(message)

    prev = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev or signal.SIG_DFL)


@contextlib.contextmanager
def stops_deferred():
    """Ctrl-C and SIGTERM held back while the block runs (main thread only) and delivered to
    their handlers as it ends: the first one that came, once. For a step that must not be cut
    in two, such as starting a process and keeping its handle, so that the handler that ends
    the process always has it. A signal that is ignored, or has no Python handler, is left
    as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending, prev = [], {}

    def hold(signum, frame):
        pending.append((signum, frame))

    for s in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(s)):
            prev[s] = signal.signal(s, hold)
    try:
        yield
    finally:
        for s, handler in prev.items():
            signal.signal(s, handler)
        if pending:
            signum, frame = pending[0]
            prev[signum](signum, frame)


class ResumeError(ValueError):
    """The checkpoint in the run directory cannot continue this run exactly."""


# Settings that may change between a run and its resumption without changing its results.
# Settings used only after training (a study's sample prompt) are free too.
_RESUME_FREE = {"log_every", "eval_every", "ckpt_every", "keep_checkpoints", "tensorboard",
                "resume", "prompt", "sample_tokens"}


def config_differences(saved_json: str, current_json: str) -> list[str]:
    """``"key: checkpoint X vs now Y"`` for every setting that differs between two configs'
    JSON (logging/eval/checkpoint cadence and ``resume`` excluded)."""
    a, b = flatten_dict(json.loads(saved_json)), flatten_dict(json.loads(current_json))
    out = []
    for k in sorted(set(a) | set(b)):
        if k.split("/")[-1] in _RESUME_FREE:
            continue
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if va != vb:
            out.append(f"{k}: checkpoint {va!r} vs now {vb!r}")
    return out


def data_differences(saved: str | None, current: str | None) -> list[str]:
    """``["data: checkpoint X vs now Y"]`` when both data streams are known (a source's
    ``fingerprint``) and differ; a source that names none is not compared."""
    if saved and current and saved != current:
        return [f"data: checkpoint {saved!r} vs now {current!r}"]
    return []


def _refuse_resume(run_dir, saved_step: int, meta: dict, cfg, config,
                   data: str | None = None) -> list[str]:
    """Raise :class:`ResumeError` when the checkpoint at ``saved_step`` (its ``meta``) cannot
    continue this run: a later step, another config, another data stream (``data``, this
    run's source's fingerprint); return the differences ``resume=force`` lets through."""
    if saved_step > cfg.steps:
        raise ResumeError(
            f"{run_dir} holds a checkpoint at step {saved_step}, past this run's "
            f"steps={cfg.steps}; resuming would return a longer-trained model. Fix: "
            f"use a new run directory (out=...), or ask for steps >= {saved_step}")
    diffs = (config_differences(meta["config"], to_json(config))
             if meta.get("config") else []) + data_differences(meta.get("data"), data)
    if diffs and cfg.resume != "force":
        raise ResumeError(
            f"{run_dir} holds a checkpoint (step {saved_step}) of a run with another "
            "config or data; resuming would not reproduce either run:\n  "
            + "\n  ".join(diffs[:20]) + "\nFix: restore the old values, use a new "
            "run directory (out=...), or resume anyway with train.resume=force")
    return diffs


def check_resume(run_dir, cfg, config=None, data: str | None = None) -> int | None:
    """Refuse, before any compute, a run directory whose newest checkpoint cannot continue
    this run (a later step, another config); return that step, or ``None`` when the
    directory holds no checkpoint. Reads only the checkpoint's metadata, so a study calls it
    before its first evaluation; :func:`open_run_dir` checks the same again on restore."""
    directory = os.path.join(os.fspath(run_dir), "checkpoints")
    step = latest_step(directory) if os.path.isdir(directory) else None
    if step is None:
        return None
    ckpt = Checkpointer(directory, keep=cfg.keep_checkpoints)
    try:
        meta = ckpt.read_meta(step)
    except CorruptCheckpointError:
        return step  # restore_latest sets it aside and falls back, with a warning
    finally:
        ckpt.close()
    _refuse_resume(run_dir, int(meta["step"]), meta, cfg,
                   config if config is not None else cfg, data)
    return step


def describe_transform(tx) -> str:
    """What ``config.json`` says of an optax transform the caller gave the loop."""
    init = getattr(getattr(tx, "init", None), "__qualname__", "?")
    return (f"given by the caller ({type(tx).__name__}, init {init}); the config's optimizer, "
            "lr, schedule, warmup_steps, weight_decay, b1, b2, eps and grad_clip were not used")


def run_config_json(config, tx=None) -> str:
    """``config.json`` of a training run: the config, and where the caller gave its own optax
    transform, a ``transform`` entry saying so (the config's optimizer keys did not run)."""
    if tx is None:
        return to_json(config)
    return json.dumps({**json.loads(to_json(config)), "transform": describe_transform(tx)},
                      indent=2)


def open_run_dir(run_dir, cfg, config, state, main, tx=None, data: str | None = None):
    """Checkpointer of ``run_dir`` and the state/data position to start from. Everything is
    validated (stale saves moved aside, the newest verifying step restored, its config and
    data stream compared with this run's: ``data``, the source's fingerprint) before
    anything is written; ``tx``: the caller's optax transform, recorded in ``config.json``
    (:func:`run_config_json`)."""
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.keep_checkpoints)
    position = 0
    try:
        if main:
            ckpt.clean_stale()
        found = ckpt.restore_latest(state, quarantine=main)
        if found is not None:
            restored, meta = found
            saved_step = int(meta["step"])
            diffs = _refuse_resume(run_dir, saved_step, meta, cfg, config, data)
            if diffs:
                log.warning("resuming %s with a changed config or data (resume=force):\n  %s",
                            run_dir, "\n  ".join(diffs))
            state, position = restored, int(meta["data_position"])
        if main:
            atomic_write_text(os.path.join(run_dir, "config.json"), run_config_json(config, tx))
    except BaseException:
        ckpt.close(abort=True)
        raise
    return ckpt, state, position


def evaluation_pending(run_dir, step: int, eval_every: int) -> bool:
    """Whether the run in ``run_dir``, resumed at ``step``, owes that step its evaluation: the
    step is one of the evaluation cadence but ``eval.csv`` has no row for it (its evaluation
    failed after the loop saved the step's checkpoint, so that the steps before it were not
    lost). The resumed run evaluates it first, and so ends as an uninterrupted run would."""
    if run_dir is None or step <= 0 or not eval_every or step % eval_every:
        return False
    path = os.path.join(os.fspath(run_dir), "eval.csv")
    rows = read_csv(path) if os.path.exists(path) else []
    return not any(int(float(r["step"])) == step for r in rows)
