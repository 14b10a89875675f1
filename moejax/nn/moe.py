"""Top-k Mixture-of-Experts FFN slot (routers, dispatch paths, shared / universal FFNs).

``y_BTD, aux = moe(x_BTD, train=..., key=..., mask_BT=...)`` computes::
    y = sum_k G_k(x) E_{id_k}(x)  [+ shared(x)]  [+ universal(x)]

Parameter paths of :class:`MoE` (names are relied on by sharding and upcycling code):
* ``experts``: stacked experts, ``w_gate [E, D, F]`` (gated activations only),
  ``w_up [E, D, F]``, ``w_down [E, F, D]``. Training code shards every parameter whose path
  contains ``"experts"`` along its leading axis, so nothing else may use that word.
* ``router``: ``w_g [D, E]`` (+ ``w_noise [D, E]`` for the noisy router).
* ``shared`` (``n_shared_experts > 0``): DeepSeekMoE shared experts, always active. The sum
  of ``n`` FFNs of width ``d_shared`` equals one FFN of width ``n * d_shared`` (the hidden
  units concatenate), so they are stored as one FFN ``w_gate/w_up [D, n * d_shared]``,
  ``w_down [n * d_shared, D]``; expert ``j`` is hidden columns ``[j * d_shared, (j+1) * d_shared)``.
  With ``shared_gate`` (Qwen2-MoE) their output is scaled per token by
  ``sigmoid(x w_shared_gate)``, ``w_shared_gate [D, 1]``.
* ``universal`` (``universal_ffn=True``): the Med-MoE / Coder-MoE universal FFN,
  ``w_gate/w_up [D, d_universal]``, ``w_down [d_universal, D]``, run in parallel and summed.

``aux`` (padding tokens of ``mask_BT`` excluded everywhere):
* ``aux_loss`` = ``balance_coef * balance_loss + z_loss_coef * z_loss`` (scalar)
* ``balance_loss`` raw balance loss of the configured form (0 when ``"none"``)
* ``z_loss`` raw router z-loss ``mean logsumexp(logits)^2`` (always computed)
* ``load [E]`` fraction of real (token, slot) assignments per expert
* ``gate_mass_selected`` / ``gate_mass_unselected`` mean full-softmax probability held by
  the selected experts / by the others
* ``expert_ids [B, T, k]`` selected experts (best first)
* ``dropped_fraction`` fraction of real assignments dropped (capacity path; else 0)
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import config
from moejax.kernels.moe_ffn.api import dispatch
from moejax.kernels.moe_ffn.jnp_paths import DispatchMethod, ffn_apply
from moejax.nn import axes as ax
from moejax.nn.router import NoisyTopKRouter, SoftmaxRouter
from moejax.nn.slots import FFNSlotConfig
from moejax.ops import router_losses as rl
from moejax.ops.activations import ActivationName, is_gated

__all__ = ["MoEConfig", "MoE", "MoESkeleton", "StackedExperts", "FFNWeights", "make_router",
           "router_aux", "add_always_on"]


@config
class MoEConfig(FFNSlotConfig):
    """Top-k MoE slot.

    n_experts / top_k / d_expert: experts, experts per token, hidden width per expert.
    activation: expert (and shared / universal FFN) activation.
    router: "softmax" (top-k of softmax(x W_g)) or "noisy" (Shazeer 2017 noisy top-k).
    renormalize: softmax router only: renormalise the k selected weights to sum to 1
        (Mixtral, MoE-LLaVA) or keep the raw softmax probabilities (Switch). The noisy
        router always renormalises (softmax over the kept logits), so it requires True.
    dispatch: "auto" (the default: "expert_parallel" under a data x expert mesh, else
        "host" lowered for a CPU and "tokamax" for a GPU/TPU with one device, "grouped" with
        several; see :func:`moejax.kernels.moe_ffn.api.resolve_dispatch`),
        "expert_parallel" / "expert_parallel_capacity" (all-to-all expert parallelism,
        dropless / with ``capacity_factor``; :mod:`moejax.kernels.moe_ffn.expert_parallel`),
        "dense" (oracle, all
        experts on all tokens), "capacity" (fixed [E, C, D] buffers, drops overflow),
        "ragged" (dropless grouped matmul with ``jax.lax.ragged_dot``), "tokamax"
        (dropless, tokamax's Mosaic GPU / TPU grouped-matmul kernels with their backward;
        ``jax.lax.ragged_dot`` elsewhere), "gmm" (dropless, the project's Pallas
        grouped-matmul kernels with their backward; GPU, interpret mode on CPU),
        "grouped" (dropless, block-padded grouped tiles as batched dense matmuls
        in jnp; runs and shards anywhere), "host" (dropless: the fused expert FFN of
        :mod:`moejax.kernels.moe_ffn.host`, each expert's exact rows on numpy's BLAS, one
        callback forward and one backward; CPU backend only, first-order gradients; the
        fastest path on CPU), "host_capacity" (the capacity path's drops, computed by
        the same kernel over the kept rows only) or "bucketed" (dropless: the capacity
        path at the smallest rung of a capacity ladder that holds the fullest expert;
        one compiled capacity path per rung).
    capacity_factor: ``C = ceil(capacity_factor * N * k / E)`` slots per expert
        (capacity path only; ``N`` = tokens in the call, padding included); None =
        ``n_experts / top_k``, which never drops (:attr:`capacity`).
    capacity_priority: who keeps a slot of a full expert: ``"choice"`` (GShard: every
        token's first choice before any second choice) or ``"token"`` (earlier tokens first).
    n_shared_experts / d_shared: DeepSeekMoE always-active experts (width default d_expert).
    shared_gate: scale the shared experts' output per token by ``sigmoid(x w_shared_gate)``,
        ``w_shared_gate [D, 1]`` (Qwen2-MoE's ``shared_expert_gate``); needs shared experts.
    universal_ffn / d_universal: parallel dense "universal" FFN (width default d_expert).
    balance_loss / balance_coef: "cv2" (CV(m)^2 + CV(P)^2), "switch" (E sum f_i P_i) or "none".
    z_loss_coef: weight of the router z-loss in ``aux_loss``.
    """

    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 256
    activation: ActivationName = "swiglu"
    router: Literal["softmax", "noisy"] = "softmax"
    renormalize: bool = True
    dispatch: DispatchMethod = "auto"
    capacity_factor: float | None = 2.0
    capacity_priority: Literal["choice", "token"] = "choice"
    n_shared_experts: int = 0
    d_shared: int | None = None
    shared_gate: bool = False
    universal_ffn: bool = False
    d_universal: int | None = None
    balance_loss: Literal["none", "cv2", "switch"] = "switch"
    balance_coef: float = 0.01
    z_loss_coef: float = 0.0

    @property
    def capacity(self) -> float:
        """The capacity factor in use: ``capacity_factor``, or ``n_experts / top_k`` if None."""
        if self.capacity_factor is None:
            return self.n_experts / self.top_k
        return float(self.capacity_factor)

    def validate(self) -> None:
        self._require(self.n_experts >= 1, f"n_experts={self.n_experts} must be >= 1")
        self._require(
            1 <= self.top_k <= self.n_experts,
            f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]; lower top_k or "
            "raise n_experts",
        )
        self._require(self.d_expert > 0, f"d_expert={self.d_expert} must be > 0")
        self._require(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"capacity_factor={self.capacity_factor} must be > 0 (1.0 = exactly balanced "
            "load fits; None or >= n_experts / top_k never drops)",
        )
        self._require(
            self.n_shared_experts >= 0,
            f"n_shared_experts={self.n_shared_experts} must be >= 0",
        )
        self._require(
            self.d_shared is None or self.d_shared > 0,
            f"d_shared={self.d_shared} must be > 0 (or None for d_expert)",
        )
        self._require(
            self.d_shared is None or self.n_shared_experts > 0,
            f"d_shared={self.d_shared} is set but n_shared_experts=0; set n_shared_experts "
            "> 0 or leave d_shared=None",
        )
        self._require(
            not self.shared_gate or self.n_shared_experts > 0,
            "shared_gate=True gates the shared experts but n_shared_experts=0; set "
            "n_shared_experts > 0 or shared_gate=False",
        )
        self._require(
            self.d_universal is None or self.d_universal > 0,
            f"d_universal={self.d_universal} must be > 0 (or None for d_expert)",
        )
        self._require(
            self.d_universal is None or self.universal_ffn,
            f"d_universal={self.d_universal} is set but universal_ffn=False; set "
            "universal_ffn=True or leave d_universal=None",
        )
        self._require(
            self.router != "noisy" or self.renormalize,
            "router='noisy' always renormalises (softmax over the kept logits); set "
            "renormalize=True or use router='softmax'",
        )
        self._require(self.balance_coef >= 0, f"balance_coef={self.balance_coef} must be >= 0")
        self._require(self.z_loss_coef >= 0, f"z_loss_coef={self.z_loss_coef} must be >= 0")

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return MoE(self, d_model, rngs=rngs, dtype=dtype, param_dtype=param_dtype or jnp.float32)


def _normal(rngs: nnx.Rngs, shape, param_dtype, *names: str):
    """N(0, 1/fan_in) with fan_in = ``shape[-2]`` (same scheme as DenseFFN), named
    ``names`` (:mod:`moejax.nn.axes`)."""
    return ax.param(jax.random.normal(rngs.params(), shape, param_dtype) * shape[-2] ** -0.5,
                    *names)


class StackedExperts(nnx.Module):
    """``E`` expert FFNs stacked on the leading axis: ``w_gate`` (gated only) / ``w_up``
    ``[E, D, F]``, ``w_down [E, F, D]``."""

    def __init__(self, n_experts: int, d_model: int, d_hidden: int, *, gated: bool,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        E, D, F = n_experts, d_model, d_hidden
        up, down = (ax.EXPERTS, ax.EMBED, ax.MLP), (ax.EXPERTS, ax.MLP, ax.EMBED)
        if gated:
            self.w_gate = _normal(rngs, (E, D, F), param_dtype, *up)
        self.w_up = _normal(rngs, (E, D, F), param_dtype, *up)
        self.w_down = _normal(rngs, (E, F, D), param_dtype, *down)

    def weights(self):
        """``(w_up_EDF, w_down_EFD, w_gate_EDF or None)`` as arrays."""
        w_gate = self.w_gate[...] if hasattr(self, "w_gate") else None
        return self.w_up[...], self.w_down[...], w_gate


class FFNWeights(nnx.Module):
    """A plain bias-free FFN (shared experts, universal FFN): ``w_gate`` (gated only) /
    ``w_up [D, F]``, ``w_down [F, D]`` (DenseFFN naming, so weights copy across)."""

    def __init__(self, d_model: int, d_hidden: int, *, gated: bool, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        if gated:
            self.w_gate = _normal(rngs, (d_model, d_hidden), param_dtype, ax.EMBED, ax.MLP)
        self.w_up = _normal(rngs, (d_model, d_hidden), param_dtype, ax.EMBED, ax.MLP)
        self.w_down = _normal(rngs, (d_hidden, d_model), param_dtype, ax.MLP, ax.EMBED)

    def __call__(self, x_ND, *, activation: str):
        w_gate = self.w_gate[...] if hasattr(self, "w_gate") else None
        return ffn_apply(x_ND, self.w_up[...], self.w_down[...], w_gate, activation=activation)


class MoESkeleton(nnx.Module):
    """The one MoE forward every MoE slot shares (top-k MoE, DeRS, synthesised, GRIN, BlockFFN,
    ReMoE)::
        r = route(x)                         # the router part (softmax / noisy / GRIN / ReLU)
        y, extra = experts_out(x, r)         # the expert part (stacked, DeRS, synthesised ...)
        y += always_on(x)                    # shared experts + universal FFN
        aux = aux(r, extra, ...)             # statistics and auxiliary losses, one place

    A slot sets ``self.moe_cfg`` (its config), ``self.router``, ``self.dtype``, ``self.d_model``,
    ``self.top_k`` and overrides the parts it changes: :meth:`route`, :meth:`expert_weights`
    (stacked weights for :func:`moejax.kernels.moe_ffn.api.dispatch`) or the whole
    :meth:`experts_out`, :meth:`universal_ffn`, :meth:`always_on` and :meth:`aux` (default:
    :func:`router_aux` of a top-k router; ``extra`` is then the dropped fraction).
    ``top_k_routing`` is False for slots whose router picks a variable number of experts
    (BlockFFN, ReMoE): teacher routing modes and top-k statistics skip them."""

    top_k_routing = True

    def route(self, x_ND, *, train: bool, key):
        return self.router(x_ND, train=train, key=key, top_k=self.top_k)

    def expert_weights(self):
        """``(w_up_EDF, w_down_EFD, w_gate_EDF or None)``."""
        return self.experts.weights()

    def experts_out(self, x_ND, r, mask_N):
        """``(y_ND, dropped_fraction)``: the routed experts' combined output."""
        return self.dispatch_experts(x_ND, r, mask_N, self.expert_weights())

    def dispatch_experts(self, x_ND, r, mask_N, weights):
        """:meth:`experts_out` with the experts' ``weights`` (:meth:`expert_weights`'
        triple) given."""
        m = self.moe_cfg
        w_up, w_down, w_gate = weights
        out = dispatch(m.dispatch, x_ND, r.ids_NK, r.weights_NK, w_up, w_down, w_gate,
                       activation=m.activation, capacity_factor=m.capacity,
                       valid_N=mask_N, priority=m.capacity_priority)
        return out.y_ND, out.dropped_fraction

    def universal_ffn(self, x_ND):
        return self.universal(x_ND, activation=self.moe_cfg.activation)

    def always_on(self, x_ND):
        """Shared experts + universal FFN output, or ``None`` when the slot has neither."""
        m, y = self.moe_cfg, None
        if getattr(m, "n_shared_experts", 0) > 0:
            y = self.shared(x_ND, activation=m.activation)
            if getattr(m, "shared_gate", False):  # Qwen2-MoE: a sigmoid gate per token
                y = y * jax.nn.sigmoid(x_ND @ self.w_shared_gate[...].astype(x_ND.dtype))
        if getattr(m, "universal_ffn", False):
            u = self.universal_ffn(x_ND)
            y = u if y is None else y + u
        return y

    def aux(self, r, extra, *, B: int, T: int, mask_N, mask_BT, segment_ids_BT) -> dict:
        del mask_BT, segment_ids_BT  # token-wise routing: document boundaries do not matter
        return router_aux(self.moe_cfg, r, mask_N, extra, B, T)

    def __call__(self, x_BTD: jax.Array, *, train: bool = False, key: jax.Array | None = None,
                 mask_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None):
        B, T, D = x_BTD.shape
        if D != self.d_model:
            raise ValueError(f"{type(self).__name__}: input width {D} != d_model {self.d_model}")
        if B * T == 0:  # no token: an empty output, and the statistics of none (zeros)
            _, aux = jax.eval_shape(lambda x: self(x, train=False), jnp.zeros((1, 1, D),
                                                                             x_BTD.dtype))
            return (jnp.zeros((B, T, D), self.dtype or x_BTD.dtype),
                    jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux))
        dt = self.dtype or x_BTD.dtype
        x_ND = x_BTD.reshape(B * T, D).astype(dt)
        mask_N = None if mask_BT is None else mask_BT.reshape(B * T).astype(bool)
        r = self.route(x_ND, train=train, key=key)  # float32 routing
        y_ND, extra = self.experts_out(x_ND, r, mask_N)
        always = self.always_on(x_ND)
        if always is not None:
            y_ND = y_ND + always
        return y_ND.reshape(B, T, D), self.aux(r, extra, B=B, T=T, mask_N=mask_N,
                                               mask_BT=mask_BT, segment_ids_BT=segment_ids_BT)


def add_always_on(slot, moe: MoEConfig, d_model: int, *, gated: bool, rngs, param_dtype,
                  universal: bool = True) -> None:
    """Give ``slot`` the DeepSeekMoE shared experts and (``universal``) the universal FFN that
    ``moe`` asks for, as plain FFNs."""
    if moe.n_shared_experts > 0:
        slot.shared = FFNWeights(d_model, moe.n_shared_experts * (moe.d_shared or moe.d_expert),
                                 gated=gated, rngs=rngs, param_dtype=param_dtype)
        if moe.shared_gate:
            slot.w_shared_gate = _normal(rngs, (d_model, 1), param_dtype, ax.EMBED, ax.SCORES)
    if moe.universal_ffn and universal:
        slot.universal = FFNWeights(d_model, moe.d_universal or moe.d_expert, gated=gated,
                                    rngs=rngs, param_dtype=param_dtype)


class MoE(MoESkeleton):
    """Top-k MoE FFN slot built from a :class:`MoEConfig` (see the module docstring): the
    skeleton with :class:`StackedExperts` and the configured router.

    ``self.top_k`` is a plain attribute: setting it (e.g. to ``n_experts`` to activate all
    experts for distillation) changes the routing of later calls (and retraces jit)."""

    def __init__(self, cfg: MoEConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        self.cfg = self.moe_cfg = cfg
        self.dtype, self.d_model, self.top_k = dtype, d_model, cfg.top_k
        gated = is_gated(cfg.activation)
        self.router = make_router(cfg, d_model, rngs=rngs, param_dtype=param_dtype)
        self.experts = StackedExperts(cfg.n_experts, d_model, cfg.d_expert, gated=gated,
                                      rngs=rngs, param_dtype=param_dtype)
        add_always_on(self, cfg, d_model, gated=gated, rngs=rngs, param_dtype=param_dtype)


def make_router(cfg: MoEConfig, d_model: int, *, rngs, param_dtype=jnp.float32):
    """The router ``cfg`` asks for (softmax top-k or noisy top-k); shared by MoE variants."""
    if cfg.router == "softmax":
        return SoftmaxRouter(d_model, cfg.n_experts, cfg.top_k, renormalize=cfg.renormalize,
                             rngs=rngs, param_dtype=param_dtype)
    return NoisyTopKRouter(d_model, cfg.n_experts, cfg.top_k, rngs=rngs, param_dtype=param_dtype)


def router_aux(cfg: MoEConfig, r, mask_N, dropped_fraction, B: int, T: int) -> dict:
    """The MoE slot's ``aux`` dict: weighted ``aux_loss`` plus raw balance / z losses, per-expert
    load, selected vs unselected gate mass, selected ids, the full gate distribution
    ``gate_probs`` ``[B, T, E]`` (softmax over every expert's logit) and the dropped
    fraction."""
    if cfg.balance_loss == "cv2":
        # P = summed gate values actually used (combine weights), as in Shazeer / Llama-MoE.
        gates_NE = jnp.zeros_like(r.probs_NE).at[
            jnp.arange(r.ids_NK.shape[0])[:, None], r.ids_NK].add(r.weights_NK)
        balance = rl.cv2_balance_loss(r.ids_NK, gates_NE, mask_N)
    elif cfg.balance_loss == "switch":
        balance = rl.switch_balance_loss(r.ids_NK, r.probs_NE, mask_N)
    else:
        balance = jnp.zeros((), jnp.float32)
    z = rl.router_z_loss(r.logits_NE, mask_N)
    counts_E = rl.expert_counts(r.ids_NK, cfg.n_experts, mask_N)
    sel = rl.gate_mass_selected(r.ids_NK, r.probs_NE, mask_N)
    return {
        "aux_loss": cfg.balance_coef * balance + cfg.z_loss_coef * z,
        "balance_loss": balance,
        "z_loss": z,
        "load": counts_E / jnp.maximum(jnp.sum(counts_E), 1.0),
        "gate_mass_selected": sel,
        "gate_mass_unselected": 1.0 - sel,
        "expert_ids": r.ids_NK.reshape(B, T, -1),
        "gate_probs": r.probs_NE.reshape(B, T, -1),
        "dropped_fraction": dropped_fraction,
    }
