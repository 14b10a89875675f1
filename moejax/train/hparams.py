"""Training configuration, learning-rate schedules and the optax optimizer.

``TrainConfig`` holds every knob of a training run. :func:`make_schedule` turns it into a
``step -> lr`` function and :func:`make_optimizer` into an optax chain::

    [clip_by_global_norm(grad_clip)]  ->  adamw / adam / sgd / adamr(schedule)

Weight decay (decoupled for ``adamw``, added to the gradient for ``sgd``) skips norms and
biases: see :func:`decay_mask`; ``decay_paths`` (a regex on leaf paths) narrows any optimizer's
decay further, e.g. to the pre-trained backbone when a new head is trained beside it.

Schedules (``t`` = optimizer step, ``S`` = ``steps``, ``W`` = ``warmup_steps``,
``m`` = ``min_lr_ratio``, ``lr`` = peak):

* warmup (all schedules), ``t < W``: ``lr * (t + 1) / W``
* ``constant``: ``lr``
* ``cosine``: ``lr * (m + (1 - m) * 0.5 * (1 + cos(pi * min(1, (t - W) / (S - W)))))``
* ``linear``: ``lr * (1 - (1 - m) * min(1, (t - W) / (S - W)))``
* ``wsd`` (warmup-stable-decay): ``D = S - round(decay_fraction * S)`` decay steps start;
  ``lr`` for ``W <= t < D``, then linear to ``m * lr`` at ``t = S``:
  ``lr * (1 - (1 - m) * min(1, (t - D) / (S - D)))``.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import jax
import optax

from moejax.config import Config, config
from moejax.config_names import SEED_LIMIT
from moejax.optim.anchored import adamr
from moejax.pytree import path_names, path_str

__all__ = ["EVAL_FIELDS", "LOOP_READERS", "OPTIMIZER_NAMES", "RUN_DIR_FIELDS", "TrainConfig",
           "adam_linear_config", "require_read", "make_schedule", "make_optimizer", "decay_mask",
           "paths_mask", "wsd_decay_start"]


# The fields the training loop reads only with an evaluation (``eval_fn``) or only with a run
# directory (``run_dir``: checkpoints, TensorBoard events and resume live there).
EVAL_FIELDS = ("eval_every",)
RUN_DIR_FIELDS = ("ckpt_every", "keep_checkpoints", "tensorboard", "resume")
# each optimizer as the papers name it (``TrainConfig.optimizer_label``)
OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adamr_l2": "AdamR-L2",
                   "adamr_l1": "AdamR-L1"}
# (the loop's argument, the fields only it lets the loop read, what a run without it lacks)
LOOP_READERS = (("eval_fn", EVAL_FIELDS, "has no evaluation"),
                ("run_dir", RUN_DIR_FIELDS, "has no run directory (its checkpoints, TensorBoard "
                                            "events and resume)"))


@config
class TrainConfig(Config):
    """Everything about one training run (model and data configs live elsewhere)."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-4
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "cosine"
    warmup_steps: int = 0
    decay_fraction: float = 0.1  # WSD: fraction of ``steps`` spent decaying
    min_lr_ratio: float = 0.1
    # adamr_l2 / adamr_l1: AdamR (DAREx Algorithm 1), weight_decay is its lambda (anchored
    # at the initial params, every leaf)
    optimizer: Literal["adamw", "adam", "sgd", "adamr_l2", "adamr_l1"] = "adamw"
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # regex on leaf paths ("encoder/blocks/0/ffn/w_in"): weight decay (AdamW's, SGD's, AdamR's
    # anchored decay) applies only to matching leaves; "" = every leaf the optimizer's own rule
    # covers (AdamW / SGD: matrices, not norms or biases; AdamR: every leaf)
    decay_paths: str = ""
    grad_clip: float = 1.0  # global-norm clipping threshold, 0 = off
    # micro-batches per optimizer step; the step takes the mean of their losses and gradients,
    # which is the whole batch's when each micro-batch scores as many tokens (a masked loss
    # over unequal micro-batches weighs each micro-batch equally, not each token)
    grad_accum: int = 1
    precision: Literal["float32", "bfloat16"] = "float32"
    mesh_data: int = -1  # -1 = all devices not used by the other axis
    mesh_expert: int = 1
    mesh_tensor: int = 1  # > 1: a tensor axis (moejax.train.mesh: FFN widths, heads split)
    fsdp: bool = False  # shard parameters and optimizer state over the data axis (ZeRO-3)
    log_every: int = 10
    eval_every: int = 0  # 0 = no periodic evaluation
    ckpt_every: int = 0  # 0 = only at the end of training
    keep_checkpoints: int = 3
    tensorboard: bool = False  # also write metrics as TensorBoard events (tensorboardX)
    seed: int = 0
    # Resuming from run_dir/checkpoints: "auto" refuses a checkpoint whose saved config
    # differs from this run's (other than logging/eval/checkpoint cadence), "force" resumes
    # anyway (the differences are logged).
    resume: Literal["auto", "force"] = "auto"

    def validate(self) -> None:
        r = self._require
        r(self.steps >= 1, f"steps={self.steps} must be >= 1")
        r(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")
        r(math.isfinite(self.lr) and self.lr > 0, f"lr={self.lr} must be finite and > 0")
        r(
            0 <= self.warmup_steps <= self.steps,
            f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]",
        )
        r(
            0.0 <= self.decay_fraction <= 1.0,
            f"decay_fraction={self.decay_fraction} must be in [0, 1]",
        )
        if self.schedule == "wsd":
            decay = round(self.decay_fraction * self.steps)
            r(
                self.warmup_steps + decay <= self.steps,
                f"wsd: warmup_steps={self.warmup_steps} + decay steps {decay} "
                f"(decay_fraction * steps) exceed steps={self.steps}; lower one of them",
            )
        r(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        self._require_default_unless(self.schedule == "wsd", "decay_fraction", "schedule='wsd'")
        r(self.schedule != "constant" or self.min_lr_ratio == self._default("min_lr_ratio"),
          f"min_lr_ratio={self.min_lr_ratio}: schedule='constant' never decays, so it would "
          "be ignored; choose a decaying schedule or set min_lr_ratio to its default, "
          f"{self._default('min_lr_ratio')}")
        r(0.0 <= self.b1 < 1.0, f"b1={self.b1} must be in [0, 1)")
        r(0.0 <= self.b2 < 1.0, f"b2={self.b2} must be in [0, 1)")
        r(math.isfinite(self.eps) and self.eps > 0, f"eps={self.eps} must be finite and > 0")
        r(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
          f"weight_decay={self.weight_decay} must be finite and >= 0")
        r(
            not (self.optimizer == "adam" and self.weight_decay > 0),
            f"weight_decay={self.weight_decay} has no effect with optimizer='adam'; use "
            "optimizer='adamw' (decoupled decay) or set weight_decay=0",
        )
        try:
            re.compile(self.decay_paths)
        except re.error as e:
            r(False, f"decay_paths={self.decay_paths!r} is not a regular expression ({e})")
        r(math.isfinite(self.grad_clip) and self.grad_clip >= 0,
          f"grad_clip={self.grad_clip} must be finite and >= 0 (0 = off)")
        r(self.grad_accum >= 1, f"grad_accum={self.grad_accum} must be >= 1")
        r(
            self.batch_size % self.grad_accum == 0,
            f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}; "
            "choose batch_size as a multiple of grad_accum",
        )
        for name in ("mesh_data", "mesh_expert"):
            v = getattr(self, name)
            r(v == -1 or v >= 1, f"{name}={v} must be -1 (all remaining devices) or >= 1")
        r(
            not (self.mesh_data == -1 and self.mesh_expert == -1),
            "mesh_data and mesh_expert cannot both be -1; fix one of them",
        )
        r(self.mesh_tensor >= 1, f"mesh_tensor={self.mesh_tensor} must be >= 1")
        r(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        r(self.eval_every >= 0, f"eval_every={self.eval_every} must be >= 0 (0 = off)")
        r(self.ckpt_every >= 0, f"ckpt_every={self.ckpt_every} must be >= 0 (0 = end only)")
        r(0 <= self.seed < SEED_LIMIT, f"seed={self.seed} must be in [0, 2**32) (PRNG seeds are "
          "unsigned; a JAX key keeps the low 32 bits, so 2**32 would run as 0)")
        r(self.keep_checkpoints >= 1, f"keep_checkpoints={self.keep_checkpoints} must be >= 1")

    def optimizer_label(self) -> str:
        """The optimizer as the papers name it, with the decay it runs: ``AdamR-L2 (lambda
        0.1)``, ``AdamW (weight decay 0.01)``, ``Adam``; for a table or a note that says
        which fine-tuning made a delta."""
        name = OPTIMIZER_NAMES[self.optimizer]
        if self.optimizer in ("adamr_l2", "adamr_l1"):
            return f"{name} (lambda {self.weight_decay:g})"
        return f"{name} (weight decay {self.weight_decay:g})" if self.weight_decay else name

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    def unread_by_loop(self, *, eval_fn: bool, run_dir: bool) -> list[str]:
        """The fields set away from their defaults that a loop without an evaluation
        (``eval_fn`` False) or without a run directory (``run_dir`` False) would ignore."""
        given = {"eval_fn": eval_fn, "run_dir": run_dir}
        return [f for arg, fields, _ in LOOP_READERS if not given[arg] for f in fields
                if getattr(self, f) != self._default(f)]


def require_read(owner: Config, key: str, run: str, *, eval_fn: bool = False,
                 run_dir: bool = False) -> None:
    """Refuse, as ``owner``'s error, the fields of its training config ``key`` that ``run``
    (the training that config drives, named for the message) would ignore: the evaluation
    cadence where it has no ``eval_fn``, the checkpoint and resume settings where it has no
    ``run_dir`` (:meth:`TrainConfig.unread_by_loop`). A study's config calls it from its
    ``validate``, so the setting is refused before anything runs, not at the loop."""
    cfg = owner
    for part in key.split("."):
        cfg = getattr(cfg, part)
    unread = cfg.unread_by_loop(eval_fn=eval_fn, run_dir=run_dir)
    why = " and ".join(lacks for _, fields, lacks in LOOP_READERS if set(unread) & set(fields))
    owner._require(not unread, f"{', '.join(f'{key}.{f}={getattr(cfg, f)!r}' for f in unread)}"
                   f": {run} {why}, so nothing would read it; leave "
                   + ", ".join(f"{key}.{f} at its default, {cfg._default(f)!r}" for f in unread))


def adam_linear_config(steps: int, lr: float, *, batch_size: int, optimizer: str = "adam",
                       weight: float = 0.0, warmup: int = 0, seed: int = 0) -> TrainConfig:
    """The DAREx studies' recipe: Adam / AdamW / AdamR (``weight`` = weight decay or AdamR's
    lambda; b2 = 0.999), ``warmup`` linear warmup steps (at most ``steps``), then linear decay
    to 0.1 lr; global-norm clipping at 1."""
    return TrainConfig(steps=steps, batch_size=batch_size, lr=lr, optimizer=optimizer,
                       weight_decay=weight, b2=0.999, warmup_steps=min(warmup, steps),
                       schedule="linear", min_lr_ratio=0.1, grad_clip=1.0, log_every=50,
                       seed=seed)


def wsd_decay_start(cfg: TrainConfig) -> int:
    """First step of the WSD decay phase."""
    return cfg.steps - round(cfg.decay_fraction * cfg.steps)


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
    """``step -> learning rate`` built from optax schedules (formulas in the module docstring):
    a linear warmup joined (``optax.join_schedules``) to the constant, cosine, linear or
    stable-then-linear-decay (WSD) main phase."""
    lr, m, W, S = cfg.lr, cfg.min_lr_ratio, cfg.warmup_steps, cfg.steps
    if cfg.schedule == "constant":
        main = optax.constant_schedule(lr)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, max(S - W, 1), alpha=m)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(lr, m * lr, max(S - W, 1))
    else:  # wsd: stable until the decay start D, then linear to m * lr at S
        D = wsd_decay_start(cfg)
        main = optax.join_schedules(
            [optax.constant_schedule(lr), optax.linear_schedule(lr, m * lr, max(S - D, 1))],
            [D - W])
    if W == 0:
        return main
    # lr * (t + 1) / W for t < W: from lr / W at t = 0 to lr at t = W - 1.
    warm = optax.linear_schedule(lr / W, lr, max(W - 1, 0))
    return optax.join_schedules([warm, main], [W])


_NO_DECAY_WORDS = ("norm", "bias", "scale", "ln_", "embedding_norm")


def decay_mask(params):
    """Bool tree: True where weight decay applies.

    Skipped: leaves with ``ndim <= 1`` and any leaf whose path mentions a norm or a bias
    (a component containing ``norm``/``bias``/``scale`` or named ``b``), e.g. stacked
    expert biases ``[E, f]``.
    """

    def rule(path, x):
        names = [n.lower() for n in path_names(path)]
        if getattr(x, "ndim", 0) <= 1:
            return False
        if any(w in n for n in names for w in _NO_DECAY_WORDS) or (names and names[-1] == "b"):
            return False
        return True

    return jax.tree_util.tree_map_with_path(rule, params)


def paths_mask(pattern: str, base=None):
    """``params -> bool tree``: True where the leaf path matches ``pattern`` (``re.search``)
    and, given ``base`` (a mask function such as :func:`decay_mask`), where ``base`` is True.
    ``pattern=""`` returns ``base`` itself (``None`` = every leaf). A pattern that selects no
    leaf is refused (a misspelt path would otherwise switch the decay off unnoticed)."""
    if not pattern:
        return base
    rx = re.compile(pattern)

    def mask(params):
        inner = (jax.tree_util.tree_map(lambda _: True, params) if base is None
                 else base(params))
        out = jax.tree_util.tree_map_with_path(
            lambda path, _, m: bool(m) and rx.search(path_str(path)) is not None, params, inner)
        if not any(jax.tree_util.tree_leaves(out)):
            some = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)][:3]
            raise ValueError(f"decay_paths={pattern!r} selects no parameter the optimizer "
                             f"decays (paths look like {', '.join(some)}); fix the pattern, "
                             "or leave it empty to decay them all")
        return out

    return mask


def make_optimizer(cfg: TrainConfig, schedule=None) -> optax.GradientTransformation:
    """Optax chain for ``cfg`` (clipping, then the optimizer with ``schedule``)."""
    schedule = make_schedule(cfg) if schedule is None else schedule
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    if cfg.optimizer == "adamw":
        parts.append(
            optax.adamw(
                schedule,
                b1=cfg.b1,
                b2=cfg.b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=paths_mask(cfg.decay_paths, decay_mask),
            )
        )
    elif cfg.optimizer in ("adamr_l2", "adamr_l1"):
        parts.append(adamr(schedule, cfg.weight_decay, reg=cfg.optimizer[-2:], b1=cfg.b1,
                           b2=cfg.b2, eps=cfg.eps,
                           mask=paths_mask(cfg.decay_paths)))
    elif cfg.optimizer == "adam":
        parts.append(optax.adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    else:  # sgd; b1 is the momentum (0 = plain SGD)
        if cfg.weight_decay > 0:
            parts.append(optax.add_decayed_weights(cfg.weight_decay,
                                                   mask=paths_mask(cfg.decay_paths, decay_mask)))
        parts.append(optax.sgd(schedule, momentum=cfg.b1 if cfg.b1 > 0 else None))
    return optax.chain(*parts)
