"""Adaptive regulariser coefficients whose state rides in the train state (and checkpoints).

**BlockFFN lambda_cs scheduler** (paper App. B, Eq. 7). With ``L_t`` the chunk-sparsification
loss of step ``t`` (summed over BlockFFN layers) and windows of ``N_adj`` steps, at every step
``m = (i + 1) N_adj``::

    gamma = mean(L_t, t in window i) / mean(L_t, t in window i - 1)
    lambda <- lambda_0                                   if m <= N_st
    lambda <- gamma * lambda                             elif gamma <= 1
    lambda <- min(max(gamma_min, gamma), max_factor) * lambda   otherwise

(``max_factor`` = 4.0 is the clamp of the official code; no change before two windows exist.)
``lambda`` is used for the step's loss *before* that step's update.

**ReMoE L1 controller** (Wang et al. 2024): ``lambda <- lambda * alpha^sign(S* - S_t)`` every
step, ``S_t`` = mean token-level sparsity over ReLU-routed layers, ``S*`` = target sparsity.

Both are pure functions of :class:`ScheduleState` (:func:`lambda_schedule_update`,
:func:`remoe_update`). Why a model wrapper: ``moejax.train.step`` carries every non-``Param``
variable of the model in ``TrainState.rest`` through the jitted step and the checkpoints, so
keeping the state in :class:`ScheduleVariable` leaves of :class:`ScheduledLM` makes it update
in-graph (``jnp.where``), survive checkpoint/resume and roll back with the non-finite guard,
with no change to the training loop. With ``grad_accum > 1`` it advances once per
micro-batch (set ``N_st``/``N_adj`` in micro-batches).

``ScheduledLM(lm, cfg)(tokens_BT, train=..., key=..., mask_BT=..., segment_ids_BT=...)``
returns ``(logits, aux)`` with ``aux_loss = lm's aux_loss + lambda * penalty`` and scalar
summaries (``lambda``, ``cs_loss``, ``al_loss``, ``l1_loss``, ``tls``) that
:func:`moejax.train.step.lm_loss_fn` logs (it also hands packed batches' ``segment_ids`` /
``positions`` to the model).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import Config, config

__all__ = [
    "CoefScheduleConfig",
    "ScheduleState",
    "ScheduleVariable",
    "init_schedule_state",
    "lambda_schedule_update",
    "remoe_update",
    "ScheduledLM",
]


@config
class CoefScheduleConfig(Config):
    """kind: "blockffn_cs" (Eq. 7 on ``cs_loss``), "remoe_l1" (ReMoE controller on
    ``l1_loss``) or "none" (fixed ``lam0``, applied to ``cs_loss``)."""

    kind: Literal["none", "blockffn_cs", "remoe_l1"] = "blockffn_cs"
    lam0: float = 5e-2
    n_st: int = 1000
    n_adj: int = 100
    gamma_min: float = 1.025
    max_factor: float = 4.0
    target_sparsity: float = 0.875
    remoe_alpha: float = 1.2

    def validate(self) -> None:
        r = self._require
        r(self.lam0 >= 0, f"lam0={self.lam0} must be >= 0")
        r(self.kind == "none" or self.lam0 > 0, f"lam0={self.lam0} must be > 0 for "
          f"kind={self.kind!r}: the schedule scales it, so from 0 the penalty never acts "
          "(kind='none' applies a fixed coefficient, 0 included)")
        r(self.n_st >= 0, f"n_st={self.n_st} must be >= 0")
        r(self.n_adj >= 1, f"n_adj={self.n_adj} must be >= 1")
        r(self.gamma_min >= 1.0, f"gamma_min={self.gamma_min} must be >= 1 (paper: 1.025)")
        r(self.max_factor >= self.gamma_min,
          f"max_factor={self.max_factor} must be >= gamma_min={self.gamma_min}")
        r(0.0 <= self.target_sparsity < 1.0,
          f"target_sparsity={self.target_sparsity} must be in [0, 1)")
        r(self.remoe_alpha > 1.0, f"remoe_alpha={self.remoe_alpha} must be > 1 (ReMoE: 1.2)")


class ScheduleState(NamedTuple):
    lam: jax.Array  # float32: current coefficient
    step: jax.Array  # int32: updates seen
    win_sum: jax.Array  # float32: sum of the statistic in the current window
    prev_mean: jax.Array  # float32: mean of the previous complete window


def init_schedule_state(cfg: CoefScheduleConfig) -> ScheduleState:
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return ScheduleState(f(cfg.lam0), jnp.zeros((), jnp.int32), f(0.0), f(0.0))


def lambda_schedule_update(state: ScheduleState, l_cs, cfg: CoefScheduleConfig) -> ScheduleState:
    """One step of Eq. 7 (module docstring) after observing this step's ``l_cs``."""
    step = state.step + 1
    win_sum = state.win_sum + jnp.asarray(l_cs, jnp.float32)
    boundary = step % cfg.n_adj == 0
    cur_mean = win_sum / cfg.n_adj
    has_prev = (step >= 2 * cfg.n_adj) & (state.prev_mean > 0)
    gamma = jnp.where(has_prev, cur_mean / jnp.where(has_prev, state.prev_mean, 1.0), 1.0)
    factor = jnp.where(gamma <= 1.0, gamma, jnp.minimum(jnp.maximum(cfg.gamma_min, gamma),
                                                        cfg.max_factor))
    adjust = boundary & (step > cfg.n_st) & has_prev
    return ScheduleState(
        lam=jnp.where(adjust, state.lam * factor, state.lam),
        step=step,
        win_sum=jnp.where(boundary, 0.0, win_sum),
        prev_mean=jnp.where(boundary, cur_mean, state.prev_mean),
    )


def remoe_update(state: ScheduleState, sparsity, cfg: CoefScheduleConfig) -> ScheduleState:
    """ReMoE: ``lambda *= alpha ** sign(target - sparsity)``."""
    s = jnp.sign(cfg.target_sparsity - jnp.asarray(sparsity, jnp.float32))
    return state._replace(lam=state.lam * cfg.remoe_alpha ** s, step=state.step + 1)


class ScheduleVariable(nnx.Variable):
    """Non-``Param`` state of an adaptive coefficient (lives in ``TrainState.rest``)."""


def _sum(layers, name):
    vals = [la[name] for la in layers if name in la]
    return sum(vals) if vals else jnp.zeros((), jnp.float32)


class ScheduledLM(nnx.Module):
    """Wraps a ``DecoderLM`` (or any ``lm(tokens, train=, key=, positions_BT=, mask_BT=,
    segment_ids_BT=)`` whose aux has ``"layers"``) and adds ``lambda * penalty`` with an
    adaptive ``lambda``. ``segment_ids_BT`` is forwarded to ``lm`` (only when given)."""

    def __init__(self, lm: nnx.Module, cfg: CoefScheduleConfig):
        self.lm, self.cfg = lm, cfg
        st = init_schedule_state(cfg)
        self.sched_lam = ScheduleVariable(st.lam)
        self.sched_step = ScheduleVariable(st.step)
        self.sched_win_sum = ScheduleVariable(st.win_sum)
        self.sched_prev_mean = ScheduleVariable(st.prev_mean)
        owned = {"blockffn_cs": "cs_coef", "none": "cs_coef", "remoe_l1": "l1_coef"}[cfg.kind]
        for path, m in nnx.iter_modules(lm):
            c = getattr(getattr(m, "cfg", None), owned, None)
            if c is not None and hasattr(m, "route") and c != 0:
                raise ValueError(
                    f"ScheduledLM(kind={cfg.kind!r}) adds lambda * penalty itself, but the "
                    f"slot at {'/'.join(map(str, path))} has {owned}={c}; set {owned}=0 in the "
                    "slot config (it would be counted twice)")

    @property
    def vocab_size(self) -> int | None:
        """The wrapped LM's vocabulary (what the training loop checks token ids against)."""
        return getattr(getattr(self.lm, "cfg", None), "vocab_size", None)

    @property
    def state(self) -> ScheduleState:
        return ScheduleState(self.sched_lam[...], self.sched_step[...],
                             self.sched_win_sum[...], self.sched_prev_mean[...])

    def _set(self, st: ScheduleState) -> None:
        self.sched_lam[...] = st.lam
        self.sched_step[...] = st.step
        self.sched_win_sum[...] = st.win_sum
        self.sched_prev_mean[...] = st.prev_mean

    def __call__(self, tokens_BT, *, train: bool = False, key=None, positions_BT=None,
                 mask_BT=None, segment_ids_BT=None):
        kw = {} if segment_ids_BT is None else {"segment_ids_BT": segment_ids_BT}
        logits, aux = self.lm(tokens_BT, train=train, key=key, positions_BT=positions_BT,
                              mask_BT=mask_BT, **kw)
        layers = aux["layers"]
        cs_sum, l1_sum = _sum(layers, "cs_loss"), _sum(layers, "l1_loss")
        tls = [la["tls"] for la in layers if "tls" in la]
        tls_mean = sum(tls) / len(tls) if tls else jnp.zeros((), jnp.float32)
        st = self.state
        penalty = l1_sum if self.cfg.kind == "remoe_l1" else cs_sum
        aux_loss = aux["aux_loss"] + jax.lax.stop_gradient(st.lam) * penalty
        if train and self.cfg.kind == "blockffn_cs":
            self._set(lambda_schedule_update(st, jax.lax.stop_gradient(cs_sum), self.cfg))
        elif train and self.cfg.kind == "remoe_l1":
            self._set(remoe_update(st, jax.lax.stop_gradient(tls_mean), self.cfg))
        return logits, {"aux_loss": aux_loss, "layers": layers, "lambda": st.lam,
                        "cs_loss": cs_sum, "al_loss": _sum(layers, "al_loss"),
                        "l1_loss": l1_sum, "tls": tls_mean}
