"""Token-level distillation divergences between a teacher ``p`` and a student ``q``, on
response tokens only ("Every Expert Matters", Eqs. 1-2; GKD's generalised JSD).

All take logits ``[B, T, V]`` of teacher and student at the same positions and a mask
``[B, T]`` of the positions to score (response tokens; prompt and padding are 0), and compute
in float32 per position::

    forward_kl:       KL(p || q) = sum_v p_v (log p_v - log q_v)                  (KD)
    reverse_kl:       KL(q || p) = sum_v q_v (log q_v - log p_v)                  (GKD, KA, SAR)
    generalized_jsd:  beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q

Reduction over positions (``reduction``):

* ``"token"`` (default): the mean over every masked position of the batch, as the official
  MiniLLM / GKD / MoE-KD code computes it (``sum(loss * mask) / sum(mask)``);
* ``"sequence"``: the mean over each row's masked positions, then the mean over rows that have
  at least one (every response weighs the same, whatever its length).

Teacher and student must share the vocabulary: logits with different ``V`` raise an error
naming both sizes (:func:`check_same_vocab` does the same for two models up front).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from moejax.ops.losses import check_mask

__all__ = ["forward_kl", "reverse_kl", "generalized_jsd", "distill_divergence",
           "check_same_vocab", "reduce_positions", "Divergence", "Reduction"]

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
Reduction = Literal["token", "sequence"]


def check_same_vocab(teacher_vocab: int, student_vocab: int, teacher: str = "teacher",
                     student: str = "student") -> None:
    """Raise unless teacher and student have the same vocabulary size."""
    if int(teacher_vocab) != int(student_vocab):
        raise ValueError(
            f"{teacher} has a vocabulary of {teacher_vocab} tokens and {student} of "
            f"{student_vocab}: token-level distillation needs one tokenizer and vocabulary; "
            "build the student with the teacher's tokenizer")


def reduce_positions(loss_BT: jax.Array, mask_BT: jax.Array,
                     reduction: Reduction = "token") -> jax.Array:
    """Masked mean of per-position losses (see the module docstring)."""
    check_mask("reduce_positions", mask_BT, jnp.shape(loss_BT))
    m = mask_BT.astype(jnp.float32)
    if reduction == "token":
        return jnp.sum(loss_BT * m) / jnp.maximum(jnp.sum(m), 1.0)
    if reduction == "sequence":
        n_B = jnp.sum(m, axis=-1)
        per_row = jnp.sum(loss_BT * m, axis=-1) / jnp.maximum(n_B, 1.0)
        has_B = (n_B > 0).astype(jnp.float32)
        return jnp.sum(per_row * has_B) / jnp.maximum(jnp.sum(has_B), 1.0)
    raise ValueError(f"reduction={reduction!r}; use 'token' or 'sequence'")


def _logps(teacher_logits, student_logits):
    check_same_vocab(teacher_logits.shape[-1], student_logits.shape[-1])
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher logits of shape {tuple(teacher_logits.shape)} and student "
                         f"logits of shape {tuple(student_logits.shape)}: a divergence compares "
                         "the two at the same positions; give both the same tokens")
    return (jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1),
            jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1))


def _kl_BT(logp_a, logp_b):
    """``KL(a || b)`` per position from log-probabilities. A token ``a`` gives no mass
    (a ``-inf`` logit: a masked or padded vocabulary entry) adds nothing, ``0 * log 0 = 0``,
    in the value and the gradient; one that ``a`` gives mass and ``b`` none makes it ``inf``."""
    p_a = jnp.exp(logp_a)
    log_ratio = jnp.where(p_a > 0, logp_a - logp_b, 0.0)
    return jnp.sum(p_a * log_ratio, axis=-1)


def forward_kl(teacher_logits, student_logits, mask_BT, reduction: Reduction = "token"):
    """``KL(p || q)`` on masked positions."""
    lp, lq = _logps(teacher_logits, student_logits)
    return reduce_positions(_kl_BT(lp, lq), mask_BT, reduction)


def reverse_kl(teacher_logits, student_logits, mask_BT, reduction: Reduction = "token"):
    """``KL(q || p)`` on masked positions."""
    lp, lq = _logps(teacher_logits, student_logits)
    return reduce_positions(_kl_BT(lq, lp), mask_BT, reduction)


def generalized_jsd(teacher_logits, student_logits, mask_BT, beta: float = 0.5,
                    reduction: Reduction = "token"):
    """GKD's ``JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p +
    (1 - beta) q``, for ``beta`` in (0, 1) (0.5: the symmetric Jensen-Shannon divergence)."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta={beta} must be in (0, 1); use forward_kl / reverse_kl for the "
                         "limits")
    lp, lq = _logps(teacher_logits, student_logits)
    lm = jnp.logaddexp(lp + jnp.log(beta), lq + jnp.log1p(-beta))
    loss_BT = beta * _kl_BT(lp, lm) + (1.0 - beta) * _kl_BT(lq, lm)
    return reduce_positions(loss_BT, mask_BT, reduction)


def distill_divergence(kind: Divergence, teacher_logits, student_logits, mask_BT, *,
                       beta: float = 0.5, reduction: Reduction = "token"):
    """The divergence ``kind`` (``forward_kl`` / ``reverse_kl`` / ``jsd``)."""
    if kind == "forward_kl":
        return forward_kl(teacher_logits, student_logits, mask_BT, reduction)
    if kind == "reverse_kl":
        return reverse_kl(teacher_logits, student_logits, mask_BT, reduction)
    if kind == "jsd":
        return generalized_jsd(teacher_logits, student_logits, mask_BT, beta, reduction)
    raise ValueError(f"divergence {kind!r}; use 'forward_kl', 'reverse_kl' or 'jsd'")
