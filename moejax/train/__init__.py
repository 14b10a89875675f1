"""Training: config/optimizer (hparams), jitted step (step), mesh/sharding (mesh), checkpoints
(checkpoint), the one training loop (loop), multi-process runtime (distributed)."""

from moejax.train.checkpoint import ForeignCheckpointError, restore_params
from moejax.train.hparams import (
    TrainConfig,
    adam_linear_config,
    decay_mask,
    make_optimizer,
    make_schedule,
    paths_mask,
    require_read,
)
from moejax.train.loop import train, train_params
from moejax.train.loop_options import History, LoopOptions
from moejax.train.run_state import ResumeError, check_resume
from moejax.train.step import (
    NonFiniteError,
    TrainState,
    check_finite,
    init_state,
    init_train_state,
    lm_loss_fn,
    make_eval_step,
    make_train_step,
    params_loss,
)

__all__ = [
    "ForeignCheckpointError",
    "LoopOptions",
    "restore_params",
    "ResumeError",
    "check_resume",
    "TrainConfig",
    "adam_linear_config",
    "make_schedule",
    "make_optimizer",
    "decay_mask",
    "paths_mask",
    "require_read",
    "TrainState",
    "NonFiniteError",
    "init_state",
    "init_train_state",
    "make_train_step",
    "make_eval_step",
    "lm_loss_fn",
    "params_loss",
    "check_finite",
    "train",
    "train_params",
    "History",
]
