"""Training: config/optimizer (optim), jitted step (step), mesh/sharding (mesh),
loop with logging/eval/checkpoints (loop), multi-process runtime (distributed)."""

from moejax.train.optim import TrainConfig, decay_mask, make_optimizer, make_schedule
from moejax.train.step import (
    NonFiniteError,
    TrainState,
    check_finite,
    init_train_state,
    lm_loss_fn,
    make_eval_step,
    make_train_step,
)

__all__ = [
    "TrainConfig",
    "make_schedule",
    "make_optimizer",
    "decay_mask",
    "TrainState",
    "NonFiniteError",
    "init_train_state",
    "make_train_step",
    "make_eval_step",
    "lm_loss_fn",
    "check_finite",
    "train",
]


def __getattr__(name):  # lazy: the loop pulls in orbax and tqdm
    if name == "train":
        from moejax.train.loop import train

        return train
    raise AttributeError(name)
