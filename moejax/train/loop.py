"""The training loop: data -> sharded step -> logs, evaluation, checkpoints, resume.

``train(model, source, cfg, run_dir=...)``:

* builds the optimizer/schedule from ``cfg`` (:class:`TrainConfig`), the mesh
  (``cfg.mesh_data`` x ``cfg.mesh_expert``) and the jitted sharded step;
* resumes automatically from the newest complete checkpoint in ``run_dir/checkpoints``
  (params, optimizer state, step, PRNG key, data position), so a restarted run continues with
  exactly the batches and random draws of an uninterrupted one;
* per step: fetches ``source.batch(position)`` (this process's rows only in multi-process runs),
  runs the step, raises :class:`NonFiniteError` before a non-finite update is applied or saved,
  appends a row (``step, loss, lr, grad_norm, tokens_per_s`` + the loss_fn's scalar metrics) to
  ``run_dir/metrics.csv`` and updates a tqdm bar (loss, tokens/s);
* every ``cfg.eval_every`` steps calls ``eval_fn(model, step) -> dict`` (rows in
  ``run_dir/eval.csv``, merged into the history with an ``eval/`` prefix);
* checkpoints every ``cfg.ckpt_every`` steps and at the end; writes ``run_dir/config.json``.

Returns the history: a list of per-step metric dicts (only the steps run by this call). The
passed ``model`` is updated in place with the final params.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from moejax.checkpoint import Checkpointer
from moejax.config import Config, to_json
from moejax.train import mesh as mesh_lib
from moejax.train.distributed import assemble, is_main_process, local_batch
from moejax.train.optim import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import check_finite, init_train_state, lm_loss_fn, make_train_step

__all__ = ["train", "read_csv"]

_FIRST_COLS = ["step", "loss", "lr", "grad_norm", "tokens_per_s"]


class _CsvLog:
    """Append-only CSV whose columns are fixed by the first row; on resume rows past the
    resumed step (written after the last checkpoint of a crashed run) are dropped."""

    def __init__(self, path: str, resume_step: int):
        self.path, self.cols = path, None
        if os.path.exists(path):
            rows = read_csv(path)
            rows = [r for r in rows if int(float(r["step"])) <= resume_step]
            if rows:
                self.cols = list(rows[0].keys())
            with open(path, "w", newline="") as f:
                if self.cols:
                    w = csv.DictWriter(f, self.cols)
                    w.writeheader()
                    w.writerows(rows)

    def write(self, row: dict) -> None:
        new = self.cols is None
        if new:
            self.cols = [c for c in _FIRST_COLS if c in row] + sorted(
                c for c in row if c not in _FIRST_COLS
            )
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, self.cols, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)


def read_csv(path: str) -> list[dict]:
    """Rows of a metrics CSV as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _tokens(batch) -> float:
    """Real tokens in the global batch, from this process's rows."""
    if "mask" in batch:
        n = float(np.sum(batch["mask"]))
    else:
        n = float(np.size(next(iter(batch.values()))))
    return n * jax.process_count()


def train(
    model: nnx.Module,
    source,
    cfg: TrainConfig,
    *,
    run_dir: str | None = None,
    loss_fn: Callable = lm_loss_fn,
    eval_fn: Callable | None = None,
    config: Config | None = None,
    mesh=None,
    progress: bool = True,
) -> list[dict]:
    """Train ``model`` on ``source`` for ``cfg.steps`` optimizer steps (see module docstring).

    ``config``: the full experiment config stored with every checkpoint and in
    ``run_dir/config.json`` (defaults to ``cfg``). ``mesh``: override the mesh built from
    ``cfg.mesh_data``/``cfg.mesh_expert``. Without ``run_dir`` nothing is written to disk.
    """
    if getattr(source, "batch_size", cfg.batch_size) != cfg.batch_size:
        raise ValueError(
            f"source.batch_size={source.batch_size} != TrainConfig.batch_size={cfg.batch_size}; "
            "build the source with the training batch size"
        )
    config = cfg if config is None else config
    schedule = make_schedule(cfg)
    tx = make_optimizer(cfg, schedule)
    graphdef, state = init_train_state(model, tx, cfg.seed)
    mesh = mesh_lib.make_mesh(cfg.mesh_data, cfg.mesh_expert) if mesh is None else mesh
    state = mesh_lib.shard_tree(state, mesh)
    main = is_main_process()

    ckpt, position = None, 0
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        if main:
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                f.write(to_json(config))
        ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.keep_checkpoints)
        if ckpt.latest_step() is not None:
            state, meta = ckpt.restore(state)
            position = int(meta["data_position"])
    start = int(jax.device_get(state.step))
    csv_log = _CsvLog(os.path.join(run_dir, "metrics.csv"), start) if run_dir and main else None
    eval_log = _CsvLog(os.path.join(run_dir, "eval.csv"), start) if run_dir and main else None

    step_fn = make_train_step(graphdef, loss_fn, tx, cfg, schedule=schedule, mesh=mesh, donate=True)
    history: list[dict] = []
    bar = tqdm(total=cfg.steps, initial=start, disable=not (progress and main), desc="train")
    last_saved = start if ckpt is not None and ckpt.latest_step() == start else None
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            local = local_batch(source, position)
            batch = assemble(local, mesh)
            new_state, metrics = step_fn(state, batch)
            metrics = jax.device_get(metrics)
            check_finite(metrics, step, position)
            state, position = new_state, position + 1
            dt = time.perf_counter() - t0
            row = {"step": step + 1, "tokens_per_s": _tokens(local) / max(dt, 1e-9)}
            row.update({k: float(v) for k, v in metrics.items() if k != "finite"})
            history.append(row)
            if csv_log is not None:
                csv_log.write(row)
            bar.update(1)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if eval_fn is not None and cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                ev = eval_fn(nnx.merge(graphdef, state.params, state.rest), step + 1)
                ev = {k: float(v) for k, v in ev.items()}
                row.update({f"eval/{k}": v for k, v in ev.items()})
                if eval_log is not None:
                    eval_log.write({"step": step + 1, **ev})
            if ckpt is not None and cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
                ckpt.save(state, data_position=position, config=config)
                last_saved = step + 1
        if (
            ckpt is not None
            and last_saved != cfg.steps
            and int(jax.device_get(state.step)) == cfg.steps
        ):
            ckpt.save(state, data_position=position, config=config)
    finally:
        bar.close()
        if ckpt is not None:
            ckpt.close()
    nnx.update(model, state.params, state.rest)
    return history
