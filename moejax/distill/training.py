"""Distillation from an MoE (or dense) teacher into a dense student through the one training
loop ("Every Expert Matters", Kim et al. 2025, Sec. 3-4).

    pair = distill_pair(student, teacher, cfg)          # teacher rerouted + frozen copies
    train(pair, batches, tcfg, loss_fn=distill_loss_fn(cfg), tx=distill_tx(cfg, tcfg))
    pair.student                                        # the distilled student

    student, pair, history = distil(student, teacher, cfg, tcfg, batches)   # the same, on copies

:class:`DistillConfig.method`:
* ``sft``: cross-entropy on the dataset responses (no teacher);
* ``kd``: ``kd_ratio KL(p || q) + (1 - kd_ratio) CE`` on the dataset responses (forward KL
  to the teacher plus the responses' cross-entropy; ``kd_ratio`` 0.5 as the paper's official
  code trains its KD baseline, 1.0 for pure forward KL), teacher top-k (``teacher_k`` > 0
  overrides k, the paper's Fig. 2 sweep);
* ``gkd``: reverse ``KL(q || p)`` on responses sampled from the student (on-policy; the
  fraction of rows with sampled rather than dataset responses is ``on_policy_fraction``);
* ``all``: as ``gkd`` with every expert of the teacher active (softmax over all N logits);
* ``ka``: as ``gkd`` with Knowledge Augmentation: ``ka_m`` teacher passes on the same
  student sample, each with its own key (per layer and token: N-1 experts sampled from the
  gate w.p. ``ka_lambda``, else the top N-1). ``ka_updates="sequential"`` (the default, the
  paper's Algorithm 1): one student sample per step, then ``ka_m`` optimizer updates, one per
  teacher pass (the loop's step takes them, :func:`moejax.train.step.updates_per_batch`;
  every update of a step gets that step's learning rate); ``"averaged"``: the ``ka_m``
  losses averaged into one update;
* ``sar``: Student-Aware Router, two stages per step as the paper: (1) the teacher's router
  weights (``W_g``, ``W_noise``) take one AdamW step (``router_lr``, ``router_weight_decay``)
  on ``KL(p || q) + sar_beta * CV^2`` balance loss (noisy gate, all experts, the student's
  distribution fixed); (2) the student distils (reverse KL) from the teacher with all experts
  active under the updated router (clean gate). The router weights are
  :class:`RouterParam` variables and their AdamW state a :class:`RouterOptState` of the pair:
  both are updated inside the loss (like :class:`~moejax.chunk_sparse.schedule.ScheduledLM`'s
  state), so they ride in the train state, the checkpoints and the non-finite rollback.

``divergence`` overrides the method's default (``forward_kl`` for KD, ``reverse_kl``
otherwise; ``jsd`` with ``jsd_beta`` is GKD's generalised JSD). Nothing of the teacher is
trained except, with SAR, its router: :func:`distill_pair` turns every teacher parameter into
a :class:`FrozenParam` or :class:`RouterParam` (not ``nnx.Param``, so the loop neither
differentiates nor optimises them). The trained teacher passed in is left unchanged.

Batches: :class:`moejax.data.batches.PromptResponseBatches` (``prompts``, ``prompt_lens``,
``tokens``, ``response_mask``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.config import Config, config
from moejax.data.packing import prompt_response_real
from moejax.distill.routing_modes import RoutingMode, moe_slots, with_routing
from moejax.nn.sample import sample_traced
from moejax.ops.distill_losses import (
    Reduction,
    check_same_vocab,
    distill_divergence,
    forward_kl,
)
from moejax.ops.losses import cross_entropy
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.loop import train
from moejax.train.loop_options import History
from moejax.train.step import per_step_schedule

__all__ = ["DistillConfig", "FrozenParam", "RouterParam", "RouterOptState", "DistillPair",
           "freeze", "distill_pair", "distill_loss_fn", "distill_tx", "sar_router_step",
           "teacher_routing", "distil", "METHODS"]

Method = Literal["sft", "kd", "gkd", "all", "ka", "sar"]
METHODS = ("sft", "kd", "gkd", "all", "ka", "sar")
ON_POLICY = ("gkd", "all", "ka", "sar")


@config
class DistillConfig(Config):
    method: Method = "kd"
    divergence: Literal["default", "forward_kl", "reverse_kl", "jsd"] = "default"
    jsd_beta: float = 0.5
    reduction: Reduction = "token"
    teacher_k: int = 0  # kd / gkd teacher top-k; 0 = as trained
    kd_ratio: float = 0.5  # kd: weight of the divergence, the rest cross-entropy
    on_policy_fraction: float = 1.0  # rows whose response is sampled from the student
    temperature: float = 1.0  # student sampling (the paper: 1.0, top-p 1.0)
    top_p: float = 1.0
    ka_lambda: float = 0.05
    ka_m: int = 2
    ka_updates: Literal["sequential", "averaged"] = "sequential"
    sar_beta: float = 0.01
    router_lr: float = 1e-5
    router_weight_decay: float = 0.01  # AdamW's (PyTorch default, as the official code)
    # SAR's router step differentiates the all-expert teacher through every layer; True
    # recomputes one teacher block at a time in that backward instead of keeping every
    # block's activations (same gradient, one more teacher forward)
    sar_remat: bool = True
    eos_id: int | None = 2  # ends a sampled response (ByteTokenizer's EOS); None: never
    pad_id: int = 0

    def validate(self):
        r = self._require
        r(0.0 <= self.on_policy_fraction <= 1.0,
          f"on_policy_fraction={self.on_policy_fraction} must be in [0, 1]")
        r(0.0 < self.jsd_beta < 1.0, f"jsd_beta={self.jsd_beta} must be in (0, 1)")
        self._require_default_unless(self.divergence == "jsd", "jsd_beta", "divergence='jsd'")
        r(self.teacher_k >= 0, f"teacher_k={self.teacher_k} must be >= 0 (0 = as trained)")
        r(0.0 <= self.kd_ratio <= 1.0, f"kd_ratio={self.kd_ratio} must be in [0, 1]")
        r(self.method != "kd" or self.kd_ratio > 0, "kd_ratio=0 leaves the teacher out of "
          "KD's loss: that is method='sft'")
        r(0.0 <= self.ka_lambda <= 1.0, f"ka_lambda={self.ka_lambda} must be in [0, 1]")
        r(self.ka_m >= 1, f"ka_m={self.ka_m} must be >= 1")
        r(self.temperature > 0.0, f"temperature={self.temperature} must be > 0")
        r(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1]")
        r(self.router_lr > 0 and self.sar_beta >= 0 and self.router_weight_decay >= 0,
          "router_lr must be > 0, sar_beta and router_weight_decay >= 0")

    @property
    def divergence_kind(self) -> str:
        if self.divergence != "default":
            return self.divergence
        return "forward_kl" if self.method == "kd" else "reverse_kl"


class FrozenParam(nnx.Variable):
    """A parameter held fixed: not an ``nnx.Param``, so the training loop carries it with the
    model's other state and never differentiates or updates it."""


class RouterParam(nnx.Variable):
    """A teacher router weight that SAR updates inside the loss with its own AdamW."""


class RouterOptState(nnx.Variable):
    """The AdamW state (an optax state pytree) of the :class:`RouterParam` weights."""


def _parent(root, path):
    node = root
    for p in path[:-1]:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def freeze(module: nnx.Module, kind=lambda path: FrozenParam) -> nnx.Module:
    """A copy of ``module`` (same arrays) whose ``nnx.Param`` s become ``kind(path)``
    (:class:`FrozenParam` by default; ``path`` is ``"/"``-joined; ``None`` keeps a Param)."""
    graphdef, state = nnx.split(module)
    out = nnx.merge(graphdef, state, copy=True)  # new Variables over the same arrays
    found = [(path, v) for path, v in nnx.iter_graph(out) if isinstance(v, nnx.Param)]
    for path, var in found:
        new_kind = kind("/".join(map(str, path)))
        if new_kind is None:
            continue
        _set_attr(_parent(out, path), path[-1], new_kind(var.get_value()))
    return out


def teacher_routing(cfg: DistillConfig) -> RoutingMode | None:
    """The teacher routing of ``cfg.method`` (None: no teacher)."""
    if cfg.method == "sft":
        return None
    if cfg.method in ("kd", "gkd"):
        return RoutingMode(mode="topk", top_k=cfg.teacher_k)
    if cfg.method == "ka":
        return RoutingMode(mode="ka", ka_lambda=cfg.ka_lambda)
    return RoutingMode(mode="all")  # all, sar


class DistillPair(nnx.Module):
    """The student (trained), the rerouted frozen teacher and, with SAR, the AdamW state of
    the teacher's router."""

    def __init__(self, student: nnx.Module, teacher: nnx.Module | None,
                 router_opt: RouterOptState | None = None):
        self.student, self.teacher, self.router_opt = student, teacher, router_opt

    @property
    def vocab_size(self) -> int | None:
        """The student's vocabulary (the teacher's is the same): what the training loop
        checks the batches' token ids against."""
        return getattr(getattr(self.student, "cfg", None), "vocab_size", None)


def _is_router(path: str) -> bool:
    return "/router/" in f"/{path}/"


def distill_pair(student: nnx.Module, teacher: nnx.Module | None,
                 cfg: DistillConfig) -> DistillPair:
    """Pair ``student`` with a rerouted copy of ``teacher`` for ``cfg.method``; raises when
    their vocabularies differ or an MoE routing mode meets a teacher without MoE layers."""
    mode = teacher_routing(cfg)
    if mode is None:
        return DistillPair(student, None)
    if teacher is None:
        raise ValueError(f"method={cfg.method!r} distils from a teacher; pass one")
    check_same_vocab(teacher.cfg.vocab_size, student.cfg.vocab_size,
                     f"teacher {type(teacher).__name__}", f"student {type(student).__name__}")
    if cfg.method in ON_POLICY and cfg.on_policy_fraction > 0:
        _check_sampling_ids(cfg, student.cfg.vocab_size)
    if moe_slots(teacher):
        teacher = with_routing(teacher, mode)
    elif cfg.method in ("all", "ka", "sar") or cfg.teacher_k:
        raise ValueError(f"method={cfg.method!r} (teacher_k={cfg.teacher_k}) changes an MoE "
                         "teacher's routing, but the teacher has no MoE layer")
    if cfg.method != "sar":
        return DistillPair(student, freeze(teacher))
    teacher = freeze(teacher, lambda p: RouterParam if _is_router(p) else FrozenParam)
    router = nnx.to_pure_dict(nnx.state(teacher, RouterParam))
    return DistillPair(student, teacher, RouterOptState(_router_tx(cfg).init(router)))


def _check_sampling_ids(cfg: DistillConfig, vocab_size: int) -> None:
    """Refuse an ``eos_id`` or ``pad_id`` of the student's samples outside its vocabulary: a
    padding id past it fed the models ids they have no embedding for (a NaN loss), an EOS
    past it was never emitted (every response ran to its full length)."""
    for name, v in (("eos_id", cfg.eos_id), ("pad_id", cfg.pad_id)):
        if v is not None and not 0 <= v < vocab_size:
            raise ValueError(f"DistillConfig.{name}={v} lies outside the student's vocabulary "
                             f"[0, {vocab_size}); give the tokenizer's {name[:3]} id")


def _router_tx(cfg: DistillConfig) -> optax.GradientTransformation:
    return optax.adamw(cfg.router_lr, weight_decay=cfg.router_weight_decay)


def sar_router_step(pair: DistillPair, inputs, s_logits, mask, key, cfg: DistillConfig,
                    real=None):
    """Stage 1 of SAR, in place on ``pair``: one AdamW step of the teacher's router weights on
    ``KL(p_noisy-gate || q) + sar_beta * CV^2`` (the student's logits held fixed; ``real``:
    the real tokens, which alone are routed and balanced). Returns ``(kl, balance)`` before
    the step."""
    graphdef, router, rest = nnx.split(pair.teacher, RouterParam, ...)
    s_fixed = jax.lax.stop_gradient(s_logits)

    def objective(pure):
        logits, aux = nnx.merge(graphdef, _as_state(router, pure), rest)(
            inputs, train=True, key=key, remat=cfg.sar_remat, mask_BT=real)
        kl = forward_kl(logits, s_fixed, mask, cfg.reduction)
        balance = _balance(aux)
        return kl + cfg.sar_beta * balance, (kl, balance)

    pure = nnx.to_pure_dict(router)
    (_, (kl, balance)), grads = jax.value_and_grad(objective, has_aux=True)(pure)
    updates, opt_state = _router_tx(cfg).update(grads, pair.router_opt.get_value(), pure)
    new = dict(nnx.to_flat_state(_as_state(router, optax.apply_updates(pure, updates))))
    for path, var in list(nnx.iter_graph(pair.teacher)):
        if isinstance(var, RouterParam):
            var[...] = new[tuple(path)].get_value()
    pair.router_opt = RouterOptState(opt_state)
    return kl, balance


def _as_state(like, pure):
    out = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(out, pure)
    return out


def _set_attr(parent, name, value) -> None:
    if isinstance(name, int):
        parent[name] = value
    else:
        setattr(parent, name, value)


def _frozen_copy(model: nnx.Module) -> nnx.Module:
    """``model`` with ``stop_gradient`` on every array (for sampling inside a loss)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.lax.stop_gradient(state))


def _sequences(pair, batch, cfg: DistillConfig, key):
    """``(inputs, targets, mask, real)`` of the rows to distil on: the dataset responses, or
    (on policy) a student sample for a ``on_policy_fraction`` share of the rows; ``real`` marks
    each row's prompt part and response (the padding after them routes no token and weighs in
    no router statistic)."""
    tokens, resp = batch["tokens"], batch["response_mask"] > 0
    if cfg.method in ON_POLICY and cfg.on_policy_fraction > 0:
        k_sample, k_mix = jax.random.split(key)
        max_new = tokens.shape[1] - batch["prompts"].shape[1]
        s = sample_traced(_frozen_copy(pair.student), batch["prompts"], batch["prompt_lens"],
                          k_sample, max_new=max_new, temperature=cfg.temperature,
                          top_p=cfg.top_p, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
        use = jax.random.bernoulli(k_mix, cfg.on_policy_fraction, (tokens.shape[0],))
        tokens = jnp.where(use[:, None], s.tokens_BS, tokens)
        resp = jnp.where(use[:, None], s.response_mask_BS, resp)
    real = prompt_response_real(batch["prompt_lens"], resp)[:, :-1]
    return tokens[:, :-1], tokens[:, 1:], resp[:, 1:].astype(jnp.float32), real


def _draws(cfg: DistillConfig) -> bool:
    """Whether ``cfg.method``'s loss draws from its key: on-policy student samples, KA's
    sampled teacher experts, SAR's noisy gate."""
    return (cfg.method in ("ka", "sar")
            or (cfg.method in ON_POLICY and cfg.on_policy_fraction > 0))


def _balance(aux) -> jax.Array:
    return sum((la["balance_loss"] for la in aux["layers"] if "balance_loss" in la),
               jnp.zeros((), jnp.float32))


@dataclasses.dataclass(frozen=True)
class _DistillLoss:
    """``cfg.method``'s loss as a value: two built from equal configs are equal, so the
    training loop's step cache compiles one step per recipe, not one per run (seeds, repeats
    of one method), and holds one executable per recipe."""

    cfg: DistillConfig

    def _div(self, t_logits, s_logits, mask):
        return distill_divergence(self.cfg.divergence_kind, t_logits, s_logits, mask,
                                  beta=self.cfg.jsd_beta, reduction=self.cfg.reduction)

    @property
    def updates_per_batch(self) -> int:
        """KA's sequential updates: ``ka_m`` optimizer updates per batch (Algorithm 1)."""
        cfg = self.cfg
        return cfg.ka_m if cfg.method == "ka" and cfg.ka_updates == "sequential" else 1

    def prepare(self, pair, batch, key):
        """The batch with the student's sampled responses in place (once per step, shared
        by the step's updates; :func:`moejax.train.step.make_step_fn`)."""
        return {**batch, "presampled": _sequences(pair, batch, self.cfg, key)}

    def __call__(self, pair, batch, key, train: bool = True):
        cfg = self.cfg
        if key is None:
            if _draws(cfg):
                raise ValueError(
                    f"distill loss: method={cfg.method!r} draws (student samples, teacher "
                    "passes or router noise) and needs an explicit PRNG key, a new one each "
                    "step; pass key=jax.random.fold_in(jax.random.key(seed), step)")
            key = jax.random.key(0)  # nothing is drawn: the key is never read
        k_seq, k_teacher = jax.random.split(key)
        if "presampled" in batch:
            inputs, targets, mask, real = batch["presampled"]
        else:
            inputs, targets, mask, real = _sequences(pair, batch, cfg, k_seq)
        s_logits, _ = pair.student(inputs, train=train, mask_BT=real)
        metrics = {"response_tokens": jnp.sum(mask) / inputs.shape[0]}
        if cfg.method == "sft":
            loss = cross_entropy(s_logits, targets, mask)
            return loss, {"ce": loss, **metrics}
        metrics["ce"] = cross_entropy(s_logits, targets, mask)
        if cfg.method == "ka":
            losses = []  # sequential: one teacher pass per update (the step takes ka_m)
            n = 1 if self.updates_per_batch > 1 else cfg.ka_m
            for k in jax.random.split(k_teacher, n):
                t_logits, _ = pair.teacher(inputs, train=False, key=k, mask_BT=real)
                losses.append(self._div(jax.lax.stop_gradient(t_logits), s_logits, mask))
            loss = sum(losses) / n
            return loss, {"distill": loss, **metrics}
        if cfg.method == "sar":  # stage 1: the router step; stage 2 below sees its result
            k_noise, k_teacher = jax.random.split(k_teacher)
            kl, balance = sar_router_step(pair, inputs, s_logits, mask, k_noise, cfg,
                                          real=real)
            metrics.update(sar_kl=kl, sar_balance=balance)
        t_logits, _ = pair.teacher(inputs, train=False, key=k_teacher, mask_BT=real)
        distill = self._div(jax.lax.stop_gradient(t_logits), s_logits, mask)
        loss = (cfg.kd_ratio * distill + (1.0 - cfg.kd_ratio) * metrics["ce"]
                if cfg.method == "kd" else distill)
        return loss, {**metrics, "distill": distill}


def distill_loss_fn(cfg: DistillConfig):
    """``loss(pair, batch, key) -> (loss, metrics)`` of ``cfg.method`` for the training loop
    (equal for equal configs). ``key`` may be None only where the method draws nothing (SFT,
    KD, and GKD / ALL without on-policy rows); a method that draws refuses to run without one."""
    return _DistillLoss(cfg)


def distill_tx(cfg: DistillConfig, tcfg: TrainConfig) -> optax.GradientTransformation:
    """The student's optimizer from ``tcfg`` (SAR's router AdamW runs inside the loss): the
    training loop's own optimizer of ``tcfg``, which :func:`distil` lets the loop build so
    that runs of one recipe share one compiled step."""
    updates = distill_loss_fn(cfg).updates_per_batch  # KA's: every update at its step's lr
    return make_optimizer(tcfg, per_step_schedule(make_schedule(tcfg), updates))


def distil(student: nnx.Module, teacher: nnx.Module | None, cfg: DistillConfig,
           tcfg: TrainConfig, source, *, eval_fn=None, keep_best: str = "",
           keep_best_mode: str | None = None, desc: str = "distil", run_dir=None, config=None
           ) -> tuple[nnx.Module, DistillPair, History]:
    """Distil a copy of ``student`` from ``teacher`` by ``cfg.method`` for ``tcfg.steps``
    steps on ``source`` (prompt/response batches); ``eval_fn(student, step)`` with
    ``keep_best`` (and ``keep_best_mode``: :class:`~moejax.train.loop_options.LoopOptions`)
    keeps the best-evaluated student. Returns ``(student, pair, history)``
    (``pair.teacher``: the teacher as distilled from, e.g. SAR's trained router); the models
    passed in are left unchanged. ``run_dir`` / ``config``: the training loop's checkpoints
    and the config stored with them (:class:`moejax.train.loop_options.LoopOptions`), so a stopped
    distillation resumes and a finished one is restored."""
    pair = distill_pair(nnx.clone(student), teacher, cfg)
    history = train(pair, source, tcfg, loss_fn=distill_loss_fn(cfg), tx=None,
                    eval_fn=None if eval_fn is None else (lambda p, step: eval_fn(p.student,
                                                                                 step)),
                    keep_best=keep_best, keep_best_mode=keep_best_mode, desc=desc,
                    run_dir=run_dir, config=config)
    return pair.student, pair, history
