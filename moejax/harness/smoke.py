"""Smoke runs: a study's preset at its real model sizes and weights, with every training run
and evaluation cut to a couple of steps and batches, to prove the recipe runs end to end
before it meets an accelerator (``python -m experiments.<paper>.<study> preset=full smoke=true``).

:func:`smoke_config` cuts every :class:`~moejax.train.hparams.TrainConfig` in a config tree
(substrates' included): ``steps`` steps of at most ``rows`` rows, no warm-up, a log line per
step, periodic evaluation and checkpoints at most once; every ``eval_batches`` field to
``steps`` batches; the classifier substrates' example counts (``eval_examples``,
``max_train_examples``, where 0 means all) to a few hundred rows; and a substrate that
starts from another (``init_preset``) starts from that one's smoke run (``"full_smoke"``).
What else a study counts (prompts, seeds, repeats, recorded tokens) it cuts itself with its
own ``SMOKE`` overrides. Model shapes and sequence lengths are never touched.
"""

from __future__ import annotations

import dataclasses

from moejax.config import Config
from moejax.train.hparams import TrainConfig

__all__ = ["smoke_config", "SMOKE_STEPS", "SMOKE_ROWS", "SMOKE_SUFFIX"]

SMOKE_STEPS = 2
SMOKE_ROWS = 4
_EVAL_COUNTS = ("eval_batches",)
_EXAMPLE_COUNTS = {"eval_examples": 64, "max_train_examples": 256}  # 0 = all examples
SMOKE_SUFFIX = "_smoke"  # a preset name's suffix: that preset as a smoke run


def _smoke_train(t: TrainConfig, steps: int, rows: int) -> TrainConfig:
    steps = min(t.steps, steps)
    return t.replace(steps=steps, batch_size=min(t.batch_size, rows), warmup_steps=0,
                     log_every=1, eval_every=min(t.eval_every, steps),
                     ckpt_every=min(t.ckpt_every, steps))


def smoke_config(cfg: Config, steps: int = SMOKE_STEPS, rows: int = SMOKE_ROWS, *,
                 cut_training: bool = True) -> Config:
    """``cfg`` with every training run and ``eval_batches`` cut (module docstring);
    ``cut_training=False`` leaves the training runs whole (ahead-of-time proof captures them
    at their real shapes instead of running them) and cuts only the rest."""
    if isinstance(cfg, TrainConfig):
        return _smoke_train(cfg, steps, rows) if cut_training else cfg
    changes = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Config):
            changes[f.name] = smoke_config(value, steps, rows, cut_training=cut_training)
        elif (f.name == "init_preset" and cut_training and isinstance(value, str)
              and not value.endswith(SMOKE_SUFFIX)):
            changes[f.name] = value + SMOKE_SUFFIX
        elif not isinstance(value, int) or isinstance(value, bool):
            continue
        elif f.name in _EVAL_COUNTS:
            changes[f.name] = min(value, steps)
        elif f.name in _EXAMPLE_COUNTS:
            cap = _EXAMPLE_COUNTS[f.name]
            changes[f.name] = cap if value == 0 else min(value, cap)
    return cfg.replace(**changes) if changes else cfg
