"""Distillation from an MoE (or dense) teacher into a dense student through the one training
loop ("Every Expert Matters"; SPEC section 5).

    pair = distill_pair(student, teacher, cfg)          # teacher rerouted + frozen copies
    train(pair, batches, tcfg, loss_fn=distill_loss_fn(cfg), tx=distill_tx(cfg, tcfg))
    pair.student                                        # the distilled student

:class:`DistillConfig.method`:

* ``sft``: cross-entropy on the dataset responses (no teacher);
* ``kd``: forward ``KL(p || q)`` on the dataset responses, teacher top-k (``teacher_k`` > 0
  overrides k, the paper's Fig. 2 sweep);
* ``gkd``: reverse ``KL(q || p)`` on responses sampled from the student (on-policy; the
  fraction of rows with sampled rather than dataset responses is ``on_policy_fraction``);
* ``all``: as ``gkd`` with every expert of the teacher active (softmax over all N logits);
* ``ka``: as ``gkd`` with Knowledge Augmentation: ``ka_m`` teacher passes on the same
  student sample, each with its own key (per layer and token: N-1 experts sampled from the
  gate w.p. ``ka_lambda``, else the top N-1), the ``ka_m`` losses averaged;
* ``sar``: Student-Aware Router: the teacher's router weights (``W_g``, ``W_noise``) train on
  ``KL(p || q) + sar_beta * CV^2`` balance loss (noisy gate, all experts, student fixed) with
  their own AdamW (``router_lr``), while the student distils from the teacher with all experts
  active under that router (clean gate, reverse KL). Both updates are taken in the same
  optimizer step from one objective whose two terms see each other only through
  ``stop_gradient``: the paper updates the router first and then distils under the updated
  router; here the distillation target uses the router of the start of the step (one step
  behind, a difference of one router step of ``router_lr``).

``divergence`` overrides the method's default (``forward_kl`` for KD, ``reverse_kl``
otherwise; ``jsd`` with ``jsd_beta`` is GKD's generalised JSD). Nothing of the teacher is
trained except, with SAR, its router: :func:`distill_pair` turns every other teacher parameter
into a :class:`FrozenParam` (not an ``nnx.Param``, so the loop neither differentiates nor
optimises it). The trained teacher passed in is left unchanged.

Batches: :class:`moejax.data.batches.PromptResponseBatches` (``prompts``, ``prompt_lens``,
``tokens``, ``response_mask``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.config import Config, config
from moejax.nn.routing_modes import RoutingMode, moe_slots, with_routing
from moejax.nn.sample import sample_traced
from moejax.ops.distill_losses import (
    Reduction,
    check_same_vocab,
    distill_divergence,
    forward_kl,
)
from moejax.ops.losses import cross_entropy
from moejax.pytree import path_str
from moejax.train.optim import TrainConfig, make_optimizer, make_schedule

__all__ = ["DistillConfig", "FrozenParam", "DistillPair", "freeze", "distill_pair",
           "distill_loss_fn", "distill_tx", "teacher_routing", "METHODS"]

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
    on_policy_fraction: float = 1.0  # rows whose response is sampled from the student
    temperature: float = 1.0  # student sampling (the paper: 1.0, top-p 1.0)
    top_p: float = 1.0
    ka_lambda: float = 0.05
    ka_m: int = 2
    sar_beta: float = 0.01
    router_lr: float = 1e-5
    eos_id: int = 2  # ends a sampled response (ByteTokenizer's EOS)
    pad_id: int = 0

    def validate(self):
        r = self._require
        r(0.0 <= self.on_policy_fraction <= 1.0,
          f"on_policy_fraction={self.on_policy_fraction} must be in [0, 1]")
        r(0.0 < self.jsd_beta < 1.0, f"jsd_beta={self.jsd_beta} must be in (0, 1)")
        r(self.teacher_k >= 0, f"teacher_k={self.teacher_k} must be >= 0 (0 = as trained)")
        r(0.0 <= self.ka_lambda <= 1.0, f"ka_lambda={self.ka_lambda} must be in [0, 1]")
        r(self.ka_m >= 1, f"ka_m={self.ka_m} must be >= 1")
        r(self.temperature > 0.0, f"temperature={self.temperature} must be > 0")
        r(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1]")
        r(self.router_lr > 0 and self.sar_beta >= 0, "router_lr must be > 0, sar_beta >= 0")

    @property
    def divergence_kind(self) -> str:
        if self.divergence != "default":
            return self.divergence
        return "forward_kl" if self.method == "kd" else "reverse_kl"


class FrozenParam(nnx.Variable):
    """A parameter held fixed: not an ``nnx.Param``, so the training loop carries it with the
    model's other state and never differentiates or updates it."""


def _parent(root, path):
    node = root
    for p in path[:-1]:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def freeze(module: nnx.Module, keep=lambda path: False) -> nnx.Module:
    """A copy of ``module`` (same arrays) whose ``nnx.Param`` s become :class:`FrozenParam`,
    except those whose path (a ``"/"``-joined string) satisfies ``keep``."""
    graphdef, state = nnx.split(module)
    out = nnx.merge(graphdef, state, copy=True)  # new Variables over the same arrays
    found = [(path, v) for path, v in nnx.iter_graph(out) if isinstance(v, nnx.Param)]
    for path, var in found:
        if keep("/".join(map(str, path))):
            continue
        parent, name = _parent(out, path), path[-1]
        frozen = FrozenParam(var.get_value())
        if isinstance(name, int):
            parent[name] = frozen
        else:
            setattr(parent, name, frozen)
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
    """The student (trained) and the rerouted, frozen teacher (its router trainable with SAR)."""

    def __init__(self, student: nnx.Module, teacher: nnx.Module | None):
        self.student, self.teacher = student, teacher


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
    if moe_slots(teacher):
        teacher = with_routing(teacher, mode)
    elif cfg.method in ("all", "ka", "sar") or cfg.teacher_k:
        raise ValueError(f"method={cfg.method!r} (teacher_k={cfg.teacher_k}) changes an MoE "
                         "teacher's routing, but the teacher has no MoE layer")
    keep = _is_router if cfg.method == "sar" else (lambda p: False)
    return DistillPair(student, freeze(teacher, keep))


def _frozen_copy(model: nnx.Module) -> nnx.Module:
    """``model`` with ``stop_gradient`` on every array (for sampling inside a loss)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.lax.stop_gradient(state))


def _sequences(pair, batch, cfg: DistillConfig, key):
    """``(inputs, targets, mask)`` of the rows to distil on: the dataset responses, or (on
    policy) a student sample for a ``on_policy_fraction`` share of the rows."""
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
    return tokens[:, :-1], tokens[:, 1:], resp[:, 1:].astype(jnp.float32)


def _balance(aux) -> jax.Array:
    return sum((la["balance_loss"] for la in aux["layers"] if "balance_loss" in la),
               jnp.zeros((), jnp.float32))


def distill_loss_fn(cfg: DistillConfig):
    """``loss(pair, batch, key) -> (loss, metrics)`` of ``cfg.method`` for the training loop."""
    kind = cfg.divergence_kind

    def div(t_logits, s_logits, mask):
        return distill_divergence(kind, t_logits, s_logits, mask, beta=cfg.jsd_beta,
                                  reduction=cfg.reduction)

    def loss_fn(pair, batch, key, train: bool = True):
        key = jax.random.key(0) if key is None else key
        k_seq, k_teacher = jax.random.split(key)
        inputs, targets, mask = _sequences(pair, batch, cfg, k_seq)
        s_logits, _ = pair.student(inputs, train=train)
        metrics = {"response_tokens": jnp.sum(mask) / inputs.shape[0]}
        if cfg.method == "sft":
            loss = cross_entropy(s_logits, targets, mask)
            return loss, {"ce": loss, **metrics}
        metrics["ce"] = cross_entropy(s_logits, targets, mask)
        if cfg.method == "ka":
            losses = []
            for k in jax.random.split(k_teacher, cfg.ka_m):
                t_logits, _ = pair.teacher(inputs, train=False, key=k)
                losses.append(div(jax.lax.stop_gradient(t_logits), s_logits, mask))
            loss = sum(losses) / cfg.ka_m
            return loss, {"distill": loss, **metrics}
        t_logits, _ = pair.teacher(inputs, train=False, key=k_teacher)
        loss = div(jax.lax.stop_gradient(t_logits), s_logits, mask)
        metrics["distill"] = loss
        if cfg.method != "sar":
            return loss, metrics
        # SAR router objective: noisy gate, all experts, the student's distribution fixed
        noisy_logits, aux = pair.teacher(inputs, train=True, key=k_teacher)
        kl = forward_kl(noisy_logits, jax.lax.stop_gradient(s_logits), mask, cfg.reduction)
        balance = _balance(aux)
        sar = kl + cfg.sar_beta * balance
        return loss + sar, {**metrics, "sar_kl": kl, "sar_balance": balance}

    return loss_fn


def distill_tx(cfg: DistillConfig, tcfg: TrainConfig) -> optax.GradientTransformation:
    """The student's optimizer from ``tcfg``; with SAR, the teacher's router parameters get
    their own AdamW at ``router_lr`` (same schedule shape, weight decay and clipping)."""
    student_tx = make_optimizer(tcfg, make_schedule(tcfg))
    if cfg.method != "sar":
        return student_tx
    rcfg = tcfg.replace(lr=cfg.router_lr)
    router_tx = make_optimizer(rcfg, make_schedule(rcfg))

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "router" if path_str(p).startswith("teacher/") else "student", params)

    return optax.multi_transform({"student": student_tx, "router": router_tx}, labels)
