"""The loop's jitted train steps, cached by what they are built from, and the memory they
hold: repeated runs of one recipe (seeds, methods) in one process compile once, and the
compiled programs are dropped when the machine runs short of memory."""

from __future__ import annotations

import functools
import logging

import jax

from moejax.kernels.host_memory import available_fraction, release_freed_memory
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import make_train_step, per_step_schedule, updates_per_batch

log = logging.getLogger(__name__)


def loss_name(loss_fn) -> str:
    """What tells a run's step apart from another's of the same shapes: its loss (a function's
    name, or the repr of a loss value such as a distillation method's, equal for equal
    recipes)."""
    name = getattr(loss_fn, "__qualname__", None)
    return f"{loss_fn.__module__}.{name}" if name else repr(loss_fn)


def _build_step(graphdef, loss_fn, tx, cfg: TrainConfig, mesh):
    schedule = None
    if tx is None:  # a loss taking several updates per batch: each gets its step's lr
        schedule = make_schedule(cfg)
        tx = make_optimizer(cfg, per_step_schedule(schedule, updates_per_batch(loss_fn)))
    return tx, make_train_step(graphdef, loss_fn, tx, cfg, schedule=schedule, mesh=mesh,
                               donate=True)


# Jitted steps keyed by what they are built from, so that repeated runs of one recipe (seeds,
# methods) compile once, as jax.jit's own cache would for one function object. Bounded.
cached_step = functools.lru_cache(maxsize=16)(_build_step)
NOT_IN_STEP = dict(seed=0, log_every=1, eval_every=0, ckpt_every=0, keep_checkpoints=1,
               tensorboard=False, resume="auto")


# Below this fraction of the machine's memory available at the end of a run, the cached steps
# (compiled programs: hundreds of MB each at a real model's size) are dropped.
LOW_MEMORY_FRACTION = 0.3


def release_memory(available=available_fraction) -> bool:
    """At the end of a run: give freed heap back and, when memory is short, drop the cached
    steps and jax's compilation caches (a later run of the same recipe compiles again).
    Returns whether the caches were dropped."""
    short = (available() or 1.0) < LOW_MEMORY_FRACTION
    if short:
        log.info("memory short after this run: dropping %d cached train steps",
                 cached_step.cache_info().currsize)
        cached_step.cache_clear()
        jax.clear_caches()
    release_freed_memory()
    return short


def loop_step(graphdef, loss_fn, tx, cfg: TrainConfig, mesh):
    """``(tx, jitted step)`` the loop runs for these (``tx`` None: built from ``cfg``);
    settings that do not change the step (seed, logging) are dropped from the cache key."""
    try:
        return cached_step(graphdef, loss_fn, tx, cfg.replace(**NOT_IN_STEP), mesh)
    except TypeError:  # something unhashable: build without the cache
        return _build_step(graphdef, loss_fn, tx, cfg, mesh)
