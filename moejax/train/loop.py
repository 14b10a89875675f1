"""The training loop: data -> sharded step -> logs, evaluation, checkpoints, resume.

One loop for every study. ``train(model, source, cfg, ...)`` trains an ``nnx.Module`` in place;
``train_params(params, source, cfg, loss_fn, ...)`` trains a plain pytree of arrays (a
functional model) and returns the new pytree. Both:
* take any ``optax.GradientTransformation`` as ``tx`` (``optax.chain(clip,
  moejax.optim.adamr(...))``, ``dare_updates``, ``optax.multi_transform`` with frozen parts,
  ``optax.MultiSteps`` ...); without one the optimizer and its optax schedule come from
  ``cfg`` (:func:`moejax.train.hparams.make_optimizer`);
* take any loss ``loss_fn(model_or_params, batch, key) -> loss`` or ``(loss, metrics)``
  (metrics: a flat dict of scalars), default :func:`moejax.train.step.lm_loss_fn`;
* build the mesh (``cfg.mesh_data`` x ``cfg.mesh_expert``) and the jitted sharded step;
* resume automatically from the newest complete checkpoint in ``run_dir/checkpoints``
  (params, optimizer state, step, PRNG key, data position), so a restarted run continues with
  exactly the batches and random draws of an uninterrupted one;
* per step: fetch ``source.batch(position)`` (this process's rows only in multi-process runs;
  ``source`` may also be a plain ``position -> batch`` callable) and run the step without
  waiting for it. Every ``cfg.log_every`` steps (and before an evaluation, a checkpoint or the
  end) the pending metrics are fetched from the device in one transfer, checked (a non-finite
  loss or gradient norm raises :class:`NonFiniteError`; that step's update was not applied),
  and written as a batch of rows to ``run_dir/metrics.csv`` (``step, loss, lr, grad_norm,
  tokens_per_s`` + the loss_fn's metrics) and, with ``cfg.tensorboard``, to TensorBoard event
  files in ``run_dir/tb`` (tensorboardX);
* every ``cfg.eval_every`` steps call ``eval_fn(model_or_params, step) -> dict`` (rows in
  ``run_dir/eval.csv``, merged into the history with an ``eval/`` prefix);
* checkpoint every ``cfg.ckpt_every`` steps and at the end, only after checking with one fused
  reduction that every parameter is finite (non-finite state is never saved).

A setting the call would ignore is refused before any step: ``cfg.eval_every`` without an
``eval_fn``, the checkpoint, TensorBoard and resume settings (``ckpt_every``,
``keep_checkpoints``, ``tensorboard``, ``resume``) without a ``run_dir``.

The result is a :class:`History`: the list of per-step metric dicts of the steps run by this
call, with ``.memory`` (XLA's compiled memory analysis of the step, when ``measure_memory``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import moejax.train.mesh as mesh_lib
from moejax.capture import active_capture, record_step
from moejax.extras import progress
from moejax.files import atomic_write_text
from moejax.train.batch_checks import (
    FnSource,
    batch_tokens,
    check_batch_rows,
    check_token_ids,
    id_limits,
    record_scale,
)
from moejax.train.best import BestKeeper, check_keep_best
from moejax.train.budget import check_fits, compiled_memory
from moejax.train.checkpoint import restore_params
from moejax.train.distributed import (
    PeerLostError,
    assemble,
    is_main_process,
    is_peer_failure,
    local_batch,
)
from moejax.train.hparams import LOOP_READERS, TrainConfig
from moejax.train.logs import CsvLog, TensorBoardLog, eval_numbers, read_csv
from moejax.train.loop_options import History, LoopOptions, options_of
from moejax.train.run_lock import RunLock
from moejax.train.run_state import (
    CtrlC,
    ResumeError,
    config_differences,
    evaluation_pending,
    log,
    open_run_dir,
)
from moejax.train.step import (
    NonFiniteError,
    check_finite,
    check_loss_fn,
    init_state,
    tree_all_finite,
)
from moejax.train.step_cache import loop_step, loss_name, release_memory

__all__ = ["train", "train_params", "LoopOptions", "History", "read_csv", "FnSource",
           "compiled_memory", "ResumeError", "config_differences"]


def train(model: nnx.Module, source, cfg: TrainConfig, *, options: LoopOptions | None = None,
          **kw) -> History:
    """Train ``model`` in place for ``cfg.steps`` optimizer steps (see the module docstring);
    the keywords are the fields of :class:`LoopOptions`."""
    opts = options_of(options, kw)
    if opts.init_from is not None:
        restore_params(opts.init_from, model)
    optimizer = opts.tx if isinstance(opts.tx, nnx.Optimizer) else None
    if optimizer is not None:  # its transform, continuing from its state
        opts = dataclasses.replace(opts, tx=optimizer.tx)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    run = _Run(graphdef, params, rest, source, cfg, opts, id_limits(model),
               opt_state=None if optimizer is None else _variables(optimizer.opt_state))
    params, rest, history = run.run()
    nnx.update(model, params, rest)
    if optimizer is not None:  # the optimizer as the loop left it, for the caller's loop
        for var, value in zip(_variable_leaves(optimizer.opt_state),
                              jax.tree.leaves(run.state.opt_state)):
            var[...] = value
        # every update the run's state has seen, a resumed call's earlier ones included (the
        # state restored from its checkpoint began from this optimizer's state too)
        optimizer.step[...] = optimizer.step[...] + int(jax.device_get(run.state.step))
    return history


def _variable_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _variables(tree) -> list:
    """The arrays of an ``nnx.Optimizer``'s state, in leaf order."""
    return [v[...] for v in _variable_leaves(tree)]


def train_params(params, source, cfg: TrainConfig, loss_fn: Callable, *,
                 options: LoopOptions | None = None, **kw) -> tuple[Any, History]:
    """Train a plain pytree of arrays with ``loss_fn(params, batch, key)``; returns
    ``(params, history)``. Same loop, checkpoints and resume as :func:`train`."""
    opts = dataclasses.replace(options_of(options, kw), loss_fn=loss_fn)
    if opts.init_from is not None:
        params = restore_params(opts.init_from, params=params)
    params, _, history = _Run(None, params, None, source, cfg, opts).run()
    return params, history


def _compiled_for(batch, compiled, jitted) -> Callable:
    """The step as ``compiled`` (``jitted`` compiled ahead of time for ``batch``'s shapes,
    not paid for twice) on batches of those shapes, and as ``jitted`` on others (a source
    whose sequence lengths vary: the executable alone refuses them)."""
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), batch)

    def step(state, batch):
        same = jax.tree.map(lambda x: (x.shape, x.dtype), batch) == shapes
        return (compiled if same else jitted)(state, batch)

    return step


def _check_read(cfg: TrainConfig, opts: LoopOptions) -> None:
    """Refuse the settings this call would ignore: the evaluation cadence without an
    ``eval_fn``, the checkpoint and resume settings without a ``run_dir``."""
    unread = cfg.unread_by_loop(eval_fn=opts.eval_fn is not None,
                                run_dir=opts.run_dir is not None)
    if unread:
        needs = [arg for arg, fields, _ in LOOP_READERS if set(unread) & set(fields)]
        raise ValueError(
            f"TrainConfig {', '.join(f'{f}={getattr(cfg, f)!r}' for f in unread)} is read only "
            f"with {' and '.join(needs)}, which this call was not given (the loop would ignore "
            f"it); pass {' and '.join(f'{n}=' for n in needs)} or leave "
            + ", ".join(f"{f} at its default, {cfg._default(f)!r}" for f in unread))


class _Run:
    """One call of the loop: its state, logs, checkpointer and lock, opened in that order and
    closed in reverse whatever happens."""

    def __init__(self, graphdef, params, rest, source, cfg: TrainConfig, opts: LoopOptions,
                 limits: dict[str, int] | None = None, opt_state: list | None = None):
        if opts.keep_best and not (opts.eval_fn is not None and cfg.eval_every):
            raise ValueError(f"keep_best={opts.keep_best!r} selects among evaluations; pass "
                             "eval_fn and set TrainConfig.eval_every > 0")
        _check_read(cfg, opts)
        self.best_mode = (check_keep_best(opts.keep_best, opts.keep_best_mode)
                          if opts.keep_best else None)
        if not opts.keep_best and opts.keep_best_mode is not None:
            raise ValueError(f"keep_best_mode={opts.keep_best_mode!r} without keep_best: name "
                             "the evaluation metric to keep the best of")
        if callable(source) and not hasattr(source, "batch"):
            source = FnSource(source)
        if not callable(getattr(source, "batch", None)):
            raise TypeError(f"source is a {type(source).__name__}; give an object with "
                            ".batch(position) -> dict of arrays (moejax.data's sources) or a "
                            "callable position -> batch")
        check_loss_fn(opts.loss_fn)
        if (getattr(source, "batch_size", None) or cfg.batch_size) != cfg.batch_size:
            raise ValueError(
                f"source.batch_size={source.batch_size} != TrainConfig.batch_size="
                f"{cfg.batch_size}; build the source with the training batch size")
        self.graphdef, self.source, self.cfg, self.opts = graphdef, source, cfg, opts
        self.id_limits = limits or {}  # the bound of each batch key's ids (id_limits)
        self.config = cfg if opts.config is None else opts.config
        self.mesh = (mesh_lib.make_mesh(cfg.mesh_data, cfg.mesh_expert,
                                         tensor=cfg.mesh_tensor) if opts.mesh is None
                     else mesh_lib.loop_mesh(opts.mesh))
        self.unnamed = mesh_lib.replicated_unnamed(graphdef, params, rest, self.mesh.size)
        tx, self.step_fn = loop_step(graphdef, opts.loss_fn, opts.tx, cfg, self.mesh)
        # Own copies: the step donates its input state, and neither the caller's arrays nor
        # aliases inside the optimizer state (e.g. AdamR's anchor is the initial params) may
        # be donated with it.
        state = jax.tree.map(jnp.array, init_state(params, rest, tx, cfg.seed))
        if opt_state is not None:  # a caller's nnx.Optimizer: its state, leaf for leaf
            structure = jax.tree.structure(state.opt_state)
            if structure.num_leaves != len(opt_state):
                raise ValueError(
                    f"the nnx.Optimizer's state has {len(opt_state)} arrays but its transform "
                    f"gives this model {structure.num_leaves}; build it over this model's "
                    "parameters (nnx.Optimizer(model, tx, wrt=nnx.Param))")
            state = state._replace(opt_state=jax.tree.unflatten(
                structure, [jnp.array(v) for v in opt_state]))
        self.state = mesh_lib.shard_tree(state, self.mesh, cfg.fsdp)
        self.main = is_main_process()
        self.single = jax.process_count() == 1  # one process: no peers to wait on
        self.history, self.pending = History(), []
        self.best: BestKeeper | None = None  # with keep_best: made by _open
        if self.mesh.size > 1:
            self.history.replicated_unnamed = tuple(self.unnamed)
        self.ckpt = self.lock = self.csv_log = self.eval_log = self.tb = self.data = None
        self.position = 0
        self.rows: int | None = None  # rows of each batch to execute (a captured run's cut)

    # -- opening and closing ---------------------------------------------------------------
    def _open(self) -> None:
        run_dir, cfg = self.opts.run_dir, self.cfg
        self._compile_and_check()
        if run_dir is not None:
            run_dir = os.fspath(run_dir)
            self.lock = RunLock(run_dir).acquire() if self.main else None
            fingerprint = getattr(self.source, "fingerprint", None)  # a resume's must match
            self.data = str(fingerprint) if fingerprint else None
            self.ckpt, self.state, self.position = open_run_dir(
                run_dir, cfg, self.config, self.state, self.main, tx=self.opts.tx,
                data=self.data)
        self.start = int(jax.device_get(self.state.step))
        if self.opts.keep_best:
            self.best = BestKeeper(self.opts.keep_best, run_dir, keep=cfg.keep_checkpoints,
                                   mode=self.best_mode)
            self.best.resume(self.state, self.start, main=self.main)
        if run_dir is not None and self.main and self.mesh.size > 1:
            atomic_write_text(os.path.join(run_dir, "sharding.json"), json.dumps(
                mesh_lib.sharding_summary(self.state.params, self.mesh, cfg.fsdp, self.unnamed),
                indent=1))
        if run_dir is not None and self.main:
            self.csv_log = CsvLog(os.path.join(run_dir, "metrics.csv"), self.start)
            self.eval_log = CsvLog(os.path.join(run_dir, "eval.csv"), self.start)
            if cfg.tensorboard:
                self.tb = TensorBoardLog(os.path.join(run_dir, "tb"),
                                         purge_step=self.start + 1 if self.start else None)

    def _compile_and_check(self) -> None:
        """Compile the step for the first batch's shapes (jit reuses it) and refuse a step
        that cannot fit the device (:mod:`moejax.train.budget`) before anything is written
        or run; ``measure_memory`` keeps XLA's numbers. A captured run
        (:mod:`moejax.capture`) is recorded at shapes it does not execute: skipped."""
        captured = active_capture() is not None
        if not (self.opts.measure_memory or (self.opts.check_memory and not captured)):
            return
        batch = assemble(local_batch(self.source, self.position), self.mesh)
        compiled = self.step_fn.lower(self.state, batch).compile()
        memory = compiled_memory(compiled)
        if self.opts.check_memory and not captured:
            check_fits(memory["peak_bytes"], self.cfg, self.mesh.devices.flat[0])
        if self.opts.measure_memory:
            self.history.memory = memory
            if not captured:
                self.step_fn = _compiled_for(batch, compiled, self.step_fn)

    def _peer_lost(self, step: int, error: BaseException) -> PeerLostError:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        where = (f"the newest complete checkpoint (step {self.last_saved} in "
                 f"{self.ckpt.directory}) resumes the run exactly"
                 if self.ckpt is not None and self.last_saved is not None
                 else "no checkpoint was written yet, so the run starts over")
        return PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()} lost another process "
            f"during step {step + 1} ({type(error).__name__}: {first}); {where}: start the "
            "same command on every process again")

    def _close(self, failed: bool | str) -> None:
        """Close the checkpointer (``failed``: abort its pending save; ``"peer"``: leave it,
        since closing waits on the processes that are gone) and the logs; release the lock."""
        try:
            if self.ckpt is not None and failed != "peer":
                self.ckpt.close(abort=bool(failed))
            if self.best is not None and failed != "peer":
                self.best.close(abort=bool(failed))
            if self.tb is not None:
                self.tb.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    # -- the loop --------------------------------------------------------------------------
    def run(self):
        try:  # a failure while opening must not leave the run directory locked
            self._open()
            end, self.rows = self._capture()
            if self.rows is not None and self.ckpt is not None:  # steps on a few rows are
                self.ckpt.close()  # not the configured run's: no checkpoint (or best) of them
                self.ckpt = None
        except BaseException:
            self._close(failed=True)
            raise
        failed, ctrl_c, step, self.bar = True, None, self.start, None
        try:  # from here every way out closes what was opened, a stop in the next lines too
            ctrl_c = CtrlC()
            cfg = self.cfg
            self.bar = progress(total=cfg.steps, initial=self.start, desc=self.opts.desc,
                                disable=not (self.opts.progress and self.main), mininterval=1.0)
            self.t_flush = time.perf_counter()
            self.last_saved = (self.start if self.ckpt is not None
                               and self.ckpt.latest_step() == self.start else None)
            if (self.opts.eval_fn is not None and self.rows is None and self.single
                    and evaluation_pending(self.opts.run_dir, self.start, cfg.eval_every)):
                self._evaluate(self.start)  # its evaluation failed after its checkpoint
                if self.best is not None:  # on disk before eval.csv says it ran
                    self.best.save(self.state)
            if self.start == cfg.steps > 0:  # restored finished: its size, as when it ran
                record_scale(self.state.params, local_batch(self.source, 0), cfg.steps)
            for step in range(self.start, end):
                self._step(step)
                if ctrl_c.pressed:
                    raise KeyboardInterrupt(
                        f"interrupted by {ctrl_c.signal_name} after step {step + 1}; " + (
                            f"the newest complete checkpoint (step {self.last_saved}) resumes "
                            "the run exactly: run the same command again"
                            if self.last_saved is not None else
                            "no checkpoint was written (ckpt_every=0 or none due yet): the "
                            "same command starts the run again"))
            self._flush()
            if (self.ckpt is not None and self.last_saved != cfg.steps
                    and int(jax.device_get(self.state.step)) == cfg.steps):
                self._save()
            failed = False
        except Exception as e:
            if not is_peer_failure(e):
                raise
            failed = "peer"
            raise self._peer_lost(step, e) from e
        finally:
            if ctrl_c is not None:
                ctrl_c.restore()
            if self.bar is not None:
                self.bar.close()
            self._close(failed)
            release_memory()  # a study's many runs in one process do not add up
        if self.best is not None and self.best.step is not None:
            self.history.best = self.best.summary
            return self.best.params, self.best.rest, self.history
        return self.state.params, self.state.rest, self.history

    def _capture(self) -> tuple[int, int | None]:
        """``(end step, rows per batch)`` to execute; inside
        :func:`moejax.capture.capture_steps` this run's step is recorded at its real
        shapes first and the run cut (module docstring of :mod:`moejax.capture`)."""
        capture = active_capture()
        if capture is None:
            return self.cfg.steps, None
        batch = assemble(local_batch(self.source, self.position), self.mesh)
        record_step(self.opts.desc, self.step_fn, self.state, batch, self.cfg, mesh=self.mesh,
                    program=loss_name(self.opts.loss_fn))
        end = (self.cfg.steps if capture.steps is None
               else min(self.cfg.steps, self.start + capture.steps))
        return end, capture.rows

    def _step(self, step: int) -> None:
        cfg = self.cfg
        local = local_batch(self.source, self.position)
        if self.rows is not None:  # a captured run executes on a few rows
            local = jax.tree.map(lambda x: x[:self.rows], local)
        if step == self.start:
            if self.rows is None:
                check_batch_rows(local, cfg)
            check_token_ids(local, self.id_limits)
            record_scale(self.state.params, local, cfg.steps)
        self.state, metrics = self.step_fn(self.state, assemble(local, self.mesh))
        self.pending.append((step, self.position, batch_tokens(local), metrics))
        self.position += 1
        done = step + 1
        do_eval = self.opts.eval_fn is not None and cfg.eval_every and done % cfg.eval_every == 0
        do_ckpt = self.ckpt is not None and cfg.ckpt_every and done % cfg.ckpt_every == 0
        if done % cfg.log_every == 0 or done == cfg.steps or do_eval or do_ckpt:
            self._flush()
        if do_eval:
            try:
                self._evaluate(done)
            except Exception:
                self._save_after_failed_evaluation(done)
                raise
        if do_ckpt:
            self._save()
            self.last_saved = done

    def _flush(self) -> None:
        """Fetch the pending steps' metrics in one transfer, check them, log them."""
        if not self.pending:
            return
        fetched = jax.device_get([m for *_, m in self.pending])
        dt = (time.perf_counter() - self.t_flush) / len(self.pending)
        rows = []
        for (step, pos, n_tok, _), metrics in zip(self.pending, fetched):
            check_finite(metrics, step, pos)
            row = {"step": step + 1, "tokens_per_s": n_tok / max(dt, 1e-9)}
            row.update({k: float(v) for k, v in metrics.items() if k != "finite"})
            rows.append(row)
        self.pending.clear()
        self.t_flush = time.perf_counter()
        self.history.extend(rows)
        if self.csv_log is not None:
            self.csv_log.write(rows)
        if self.tb is not None:
            self.tb.write(rows, "train/")
        self.bar.update(len(rows))
        self.bar.set_postfix(loss=f"{rows[-1]['loss']:.4f}",
                             tok_s=f"{rows[-1]['tokens_per_s']:.0f}")

    def _evaluate(self, done: int) -> None:
        state = self.state
        target = (state.params if self.graphdef is None
                  else nnx.merge(self.graphdef, state.params, state.rest))
        ev = eval_numbers(self.opts.eval_fn(target, done), done)
        if self.history:  # not a resumed run's first, owed evaluation
            self.history[-1].update({f"eval/{k}": v for k, v in ev.items()})
        if self.best is not None:
            self.best.consider(ev, done, state.params, state.rest)
        if self.eval_log is not None:
            self.eval_log.write([{"step": done, **ev}])
        if self.tb is not None:
            self.tb.write([{"step": done, **ev}], "eval/")

    def _save_after_failed_evaluation(self, done: int) -> None:
        """The checkpoint of step ``done``, whose evaluation failed, so the steps since the
        last checkpoint are not lost; a resumed run evaluates the step first
        (:func:`~moejax.train.run_state.evaluation_pending`). One process only: with several,
        the others may be in the next step's collectives, where the save's would hang."""
        if self.ckpt is None or self.last_saved == done or not self.single:
            return
        try:
            self._save()
            self.ckpt.wait()
        except Exception as e:  # noqa: BLE001 - the evaluation's error is the one to raise
            log.warning("step %d: its evaluation failed and so did its checkpoint (%s)", done,
                        e)
            return
        self.last_saved = done
        log.warning("step %d: its evaluation failed; its checkpoint was saved, and the run "
                    "resumed from it evaluates step %d first", done, done)

    def _save(self) -> None:
        if not bool(tree_all_finite(self.state.params)):
            raise NonFiniteError(
                f"parameters became non-finite by step {int(jax.device_get(self.state.step))}"
                "; nothing was saved (the previous checkpoint is intact). Lower the lr or "
                "enable grad_clip.")
        if self.best is not None:  # first: every resumable step has its best on disk
            self.best.save(self.state)
        self.ckpt.save(self.state, data_position=self.position, config=self.config,
                       data=self.data)
