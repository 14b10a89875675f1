"""BlockFFN: ReLU + RMSNorm routed mixture of fine-grained experts (BlockFFN paper, Sec. 3.1).

``y_BTD, aux = slot(x_BTD, train=..., key=None, mask_BT=None, segment_ids_BT=None)``::
    A0 = x W_router                  [E]   (no bias)
    A1 = ReLU(A0)                          activation pattern: expert e active iff A1_e > 0
    A  = RMSNorm(A1) (learnable scale; ``rmsnorm=False`` -> A = A1, the ReMoE router)
    E_e(x) = W_down^(e)T act(W_up^(e)T x)  non-gated Swish by default
    y  = sum_e A_e E_e(x)

No top-k, no load balancing: every token activates a variable number of experts. The slot is
the MoE skeleton (:class:`moejax.nn.moe.MoESkeleton`) with this router part (``route`` ->
:class:`BlockRoute`), this expert part (``experts_out``) and the statistics below as ``aux``.

Parameter paths: ``router/w [D, E]``, ``router_norm/scale [E]`` (``rmsnorm=True`` only),
``experts/w_up [E, D, F]``, ``experts/w_down [E, F, D]`` (+ ``experts/w_gate`` for a gated
activation; App. I ablation only).

Compute paths (same outputs and gradients, see tests/test_blockffn.py):
* ``"dense"``: the reference; every expert on every token, weighted by ``A`` (zero when
  inactive).
* ``"auto"``: the chunk-union scheme on each platform's fast path, chosen when the program is
  lowered: ``"chunk_union"`` on the CPU, ``"pallas"`` on GPU and TPU.
* ``"pallas"``: the same scheme as Pallas kernels that read only the union's expert weights,
  forward and backward (:mod:`moejax.kernels.chunk_union.pallas`; Triton on GPU, Mosaic on TPU;
  interpret mode on CPU, so for tests there).
* ``"triton"``: the same scheme as a Triton kernel through ``jax_triton``
  (:mod:`moejax.kernels.chunk_union.fused_triton`; GPU and the ``gpu`` extra only: building the
  layer elsewhere fails with the reason).
* ``"chunk_union"``: the paper's kernel scheme in JAX. Tokens are cut into tiles of
  ``union_chunk`` consecutive tokens; per tile the union ``U`` of active experts is taken and
  only the experts of ``U`` run, on all tokens of the tile, masked by ``A``. ``U`` is padded to
  the static size ``max_union`` (default ``E``: always exact). A tile whose union exceeds it
  drops its highest-index experts (``aux["union_overflow"]`` = fraction of such tiles).
  ``union_chunk=1`` is the per-token gather of the active experts.

``aux`` (losses unweighted except ``aux_loss``; padding and document boundaries respected):
* ``aux_loss = al_coef L_al + cs_coef L_cs + l1_coef L1 + entropy_coef H``
* ``al_loss``, ``cs_loss``, ``l1_loss`` (on ``A1``; plain or load-balanced), ``entropy_loss``: see
  :mod:`moejax.ops.chunk_sparsity`
* ``tls``: fraction of inactive experts over real tokens; ``act_magnitude``: mean ``||A||_2``
* ``active_BTE`` (bool), ``a_BTE`` (combine weights ``A``): for streaming metrics
* ``union_overflow`` (every path but ``dense``)

When an adaptive ``lambda_cs`` schedule is used (:mod:`moejax.chunk_sparse.schedule`) the slot's
``cs_coef`` must be 0; the schedule adds ``lambda_cs * cs_loss`` itself.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import config
from moejax.kernels.chunk_union.pallas import add_residual, chunk_union_auto, chunk_union_kernel
from moejax.kernels.chunk_union.reference import chunk_union_experts, dense_experts
from moejax.nn import axes as ax
from moejax.nn.moe import MoESkeleton, StackedExperts
from moejax.nn.norms import RMSNorm
from moejax.nn.slots import FFNSlotConfig
from moejax.ops import chunk_sparsity as cs
from moejax.ops.activations import ActivationName, is_gated

__all__ = ["BlockFFNConfig", "BlockFFN", "BlockRoute", "ReLURouter", "ExpertPath",
           "block_experts"]

ExpertPath = Literal["dense", "chunk_union", "auto", "pallas", "triton"]


@config
class BlockFFNConfig(FFNSlotConfig):
    """BlockFFN slot (see the module docstring).

    n_experts / d_expert: number of fine-grained experts and hidden width of each.
    activation: expert activation (paper: non-gated ``"swish"``).
    rmsnorm: RMSNorm after the ReLU router (False = ReMoE-style router).
    path / union_chunk / max_union: compute path, tile length, static union cap (None = E).
    alpha / al_coef: sigmoid sharpness and weight of the activation-locality loss.
    chunk_len / cs_coef / cs_eps: chunk-sparsification loss chunk, static weight, log clamp.
    l1_coef / entropy_coef: weights of the L1 and router-entropy sparsifiers (ablations).
    l1_form / l1_k: ``"plain"`` L1 on ``A1`` or ReMoE's ``"load_balanced"`` L1 (each
        expert's L1 weighted by its firing frequency, normalised by ``l1_k`` target active
        experts per token); reported as ``l1_loss``.
    """

    n_experts: int = 16
    d_expert: int = 64
    activation: ActivationName = "swish"
    rmsnorm: bool = True
    norm_eps: float = 1e-6
    path: ExpertPath = "dense"
    union_chunk: int = 32
    max_union: int | None = None
    alpha: float = 100.0
    al_coef: float = 2e-3
    chunk_len: int = 64
    cs_coef: float = 0.0
    cs_eps: float = 1e-6
    l1_coef: float = 0.0
    entropy_coef: float = 0.0
    l1_form: Literal["plain", "load_balanced"] = "plain"
    l1_k: float = 1.0

    def validate(self) -> None:
        r = self._require
        r(self.n_experts >= 1, f"n_experts={self.n_experts} must be >= 1")
        r(self.d_expert >= 1, f"d_expert={self.d_expert} must be >= 1")
        r(self.union_chunk >= 1, f"union_chunk={self.union_chunk} must be >= 1")
        r(self.max_union is None or 1 <= self.max_union <= self.n_experts,
          f"max_union={self.max_union} must be in [1, n_experts={self.n_experts}] or None "
          "(None = n_experts, always exact)")
        r(self.chunk_len >= 1, f"chunk_len={self.chunk_len} must be >= 1")
        r(self.alpha > 0, f"alpha={self.alpha} must be > 0")
        r(0 < self.cs_eps < 1, f"cs_eps={self.cs_eps} must be in (0, 1)")
        r(self.l1_k > 0, f"l1_k={self.l1_k} must be > 0 (target active experts per token)")
        for name in ("al_coef", "cs_coef", "l1_coef", "entropy_coef"):
            r(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")

    @property
    def active_params_per_expert(self) -> int:
        return (3 if is_gated(self.activation) else 2) * self.d_expert

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return BlockFFN(self, d_model, rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype or jnp.float32)


class ReLURouter(nnx.Module):
    """``A0 = x w`` with ``w [D, E]`` ~ N(0, 1/D); returns float32 scores."""

    def __init__(self, d_model: int, n_experts: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.w = ax.param(jax.random.normal(rngs.params(), (d_model, n_experts), param_dtype)
                          * d_model ** -0.5, ax.EMBED, ax.SCORES)

    def __call__(self, x_ND):
        return jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), self.w[...].astype(jnp.float32))


class BlockRoute(NamedTuple):
    """BlockFFN routing, float32 ``[N, E]``: scores ``a0``, ReLU ``a1``, combine weights ``a``."""

    a0: jax.Array
    a1: jax.Array
    a: jax.Array


class BlockFFN(MoESkeleton):
    """BlockFFN FFN slot built from a :class:`BlockFFNConfig` (see the module docstring): the
    MoE skeleton with the ReLU + RMSNorm router part, the dense or chunk-union expert part and
    the chunk-sparsity statistics as its ``aux``."""

    top_k_routing = False

    def __init__(self, cfg: BlockFFNConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        self.cfg = self.moe_cfg = cfg
        self.dtype, self.d_model = dtype, d_model
        self.router = ReLURouter(d_model, cfg.n_experts, rngs=rngs, param_dtype=param_dtype)
        if cfg.rmsnorm:
            self.router_norm = RMSNorm(cfg.n_experts, eps=cfg.norm_eps, dtype=jnp.float32,
                                       param_dtype=param_dtype)
        if cfg.path == "triton":
            from moejax.kernels.chunk_union.fused_triton import unavailable_reason

            if (why := unavailable_reason()) is not None:
                raise RuntimeError(f"BlockFFN path='triton' cannot run here: {why}; use "
                                   "path='chunk_union' (CPU) or path='pallas'")
        self.experts = StackedExperts(cfg.n_experts, d_model, cfg.d_expert,
                                      gated=is_gated(cfg.activation), rngs=rngs,
                                      param_dtype=param_dtype)

    def route(self, x_ND, *, train: bool = False, key=None) -> BlockRoute:
        del train, key  # deterministic
        a0 = self.router(x_ND)
        a1 = jax.nn.relu(a0)
        a = self.router_norm(a1) if self.cfg.rmsnorm else a1
        return BlockRoute(a0, a1, a)

    def experts_out(self, x_ND, r: BlockRoute, mask_N):
        """``(y_ND, {"union_overflow": ...} on the chunk_union path, else {})``."""
        return block_experts(self.cfg, x_ND, r, *self.experts.weights())

    def always_on(self, x_ND):
        return None

    def aux(self, r: BlockRoute, extra, *, B, T, mask_N, mask_BT, segment_ids_BT) -> dict:
        cfg = self.cfg
        a0, a1, a = (v.reshape(B, T, -1) for v in r)
        kw = dict(mask_BT=mask_BT, segment_ids_BT=segment_ids_BT)
        al = cs.activation_locality_loss(a0, alpha=cfg.alpha, **kw)
        csl = cs.chunk_sparsification_loss(a1, chunk_len=cfg.chunk_len, eps=cfg.cs_eps, **kw)
        if cfg.l1_form == "load_balanced":
            l1 = cs.load_balanced_l1_loss(a1, k=cfg.l1_k, mask_BT=mask_BT)
        else:
            l1 = cs.l1_activation_loss(a1, mask_BT=mask_BT)
        ent = cs.router_entropy_loss(a1, mask_BT=mask_BT)
        active = a1 > 0
        real = jnp.ones(active.shape[:2], bool) if mask_BT is None else mask_BT.astype(bool)
        w = real.astype(jnp.float32)
        n = jnp.maximum(jnp.sum(w), 1.0)
        tls = jnp.sum((1.0 - jnp.mean(active.astype(jnp.float32), -1)) * w) / n
        mag = jnp.sum(jnp.linalg.norm(a, axis=-1) * w) / n
        return {
            **extra,
            "aux_loss": (cfg.al_coef * al + cfg.cs_coef * csl + cfg.l1_coef * l1
                         + cfg.entropy_coef * ent),
            "al_loss": al, "cs_loss": csl, "l1_loss": l1, "entropy_loss": ent,
            "tls": tls, "act_magnitude": mag,
            "active_BTE": active, "a_BTE": a,
        }


def block_experts(cfg: BlockFFNConfig, x_ND, r: BlockRoute, w_up, w_down, w_gate,
                  residual_ND=None):
    """BlockFFN's expert part on ``cfg.path``: ``(y_ND, {"union_overflow": ...} on the
    chunk-union paths, else {})`` in ``x``'s dtype, the weights cast to it. With
    ``residual_ND``: ``residual + y`` in the residual's dtype (a decoder block's output), which
    ``path="auto"`` hands to its decode kernel to sum into
    (:func:`moejax.kernels.chunk_union.pallas.chunk_union_auto`)."""
    dt = x_ND.dtype
    w_up, w_down = w_up.astype(dt), w_down.astype(dt)
    w_gate = None if w_gate is None else w_gate.astype(dt)
    if cfg.path == "dense":
        y_ND = dense_experts(x_ND, r.a, w_up, w_down, w_gate, cfg.activation)
        return add_residual(residual_ND, y_ND.astype(dt)), {}
    kw = dict(tile=cfg.union_chunk, max_union=cfg.max_union or cfg.n_experts)
    if cfg.path == "auto":
        y_ND, overflow = chunk_union_auto(x_ND, r.a, r.a1 > 0, w_up, w_down, w_gate,
                                          activation=cfg.activation, residual_ND=residual_ND,
                                          **kw)
        return (y_ND.astype(dt) if residual_ND is None else y_ND), {"union_overflow": overflow}
    if cfg.path in ("pallas", "triton"):
        y_ND, overflow = chunk_union_kernel(x_ND, r.a, r.a1 > 0, w_up, w_down, w_gate,
                                            activation=cfg.activation, backend=cfg.path, **kw)
    else:
        y_ND, overflow = chunk_union_experts(x_ND, r.a, r.a1 > 0, w_up, w_down, w_gate,
                                             cfg.activation, **kw)
    return add_residual(residual_ND, y_ND.astype(dt)), {"union_overflow": overflow}
