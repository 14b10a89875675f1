"""GRIN baseline (Liu et al. 2024, "GRIN: GRadient-INformed MoE"): top-2 MoE routed by
SparseMixer-v2 (top-k with ``k`` sequential stages as an extension).

The experts, dispatch and statistics are those of :class:`moejax.nn.moe.MoE` (stacked experts,
``router/w_g [D, E]`` logits ``s = x W_g`` in float32, :func:`moejax.kernels.moe_ffn.api.dispatch`,
:func:`moejax.nn.moe.router_aux`); only the routing differs. This follows the reference
``sparsemixer`` function of microsoft/GRIN-MoE (``modeling_grinmoe.py``), which is top-2;
``moe.top_k = k > 2`` runs ``k`` stages the same way (each on the logits with the experts of
the earlier stages at ``-inf``): our extension, used to match a baseline's token-level sparsity
(BlockFFN compares GRIN at close TLS), identical to the reference at ``k = 2``.

**Selection and forward weights** (stages ``k = 1, 2, ...``; stage ``k`` works on the logits
with the experts of stages ``< k`` set to ``-inf``). With ``m_k`` the largest remaining logit:

* masked softmax ("jitter" threshold ``eps = jitter_eps``): expert ``j`` stays a candidate iff
  ``(m_k - s_j) / max(|s_j|, m_k) <= 2 eps``; ``pi^(k) = softmax`` over the candidates (0 off).
* expert: eval ``D_k = argmax`` (the plain top-k ids); train (``sample=True``)
  ``D_k ~ pi^(k)`` drawn by Gumbel-max from the slot's ``key``.
* combine weight: eval ``w_k = pi^(k)_{D_k}``; train ``w_k = c_k pi^(k)_{D_k}`` with the
  Heun / midpoint factor ``c_k = 1`` if ``D_k`` is the stage argmax or with probability 1/4,
  else ``c_k = 1/3`` (the reference's "third-order Heun" ``f(x) - f(0) ~ .25 f'(x) + .75 f'(x/3)``
  realised by randomly evaluating the expert at a third of its gate).

**Backward (the SparseMixer-v2 estimator, train mode).** The sampling is non-differentiable;
the estimator routes the gradient of the loss w.r.t. ``w_k`` (call it ``g_k``) to the logits as
if the weight were the *unscaled* masked-softmax probability::

    dL/ds_j = sum_k g_k * pi^(k)_{D_k} * (1[j = D_k] - pi^(k)_j)

i.e. the ``c_k`` factor of the forward is *not* differentiated (implemented by the
straight-through trick ``w_k = pi_D + stop_gradient(c_k pi_D - pi_D)``, exactly the reference's
``mp`` autograd function, whose backward uses ``multiplier`` = ``pi_D`` and ignores
``mask_for_one``). Consequences, compared to plain top-k softmax weights:

* when ``c_k = 1/3`` the logit gradient is 3x what autodiff of the forward weight would give;
* only candidates of the masked softmax (within the ``2 eps`` relative band of the stage max)
  receive gradient; with ``pi^(k)_{D_k} = 1`` (a lone candidate) the weight gives none (the
  balance loss still trains the router);
* stage 2's softmax excludes the stage-1 expert, so ``w_2`` is not a slice of one softmax.

In eval mode (or ``sample=False``) ``c_k = 1`` and ids are argmax, so the custom and the plain
autodiff gradients coincide. Simplifications: no input-jitter noise; balance / z losses are
MoE's (``"switch"`` by default, on the full ``softmax(s)``), GRIN's global (cross-device)
balancing is not reproduced.

``aux`` is :func:`moejax.nn.moe.router_aux`'s (``aux_loss``, ``balance_loss``, ``z_loss``,
``load``, ``gate_mass_selected/unselected``, ``expert_ids [B, T, k]``, ``dropped_fraction``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import config
from moejax.nn.moe import MoEConfig, MoESkeleton, StackedExperts, make_router
from moejax.nn.router import RouterOutput
from moejax.nn.slots import FFNSlotConfig
from moejax.ops.activations import is_gated

__all__ = ["GRINConfig", "GRIN", "GRIN_MOE", "SparseMixerNoise", "sparsemixer_v2", "sample_noise"]


GRIN_MOE = MoEConfig(n_experts=16, top_k=2, d_expert=64, activation="swish", router="softmax",
                     renormalize=False, dispatch="dense")


@config
class GRINConfig(FFNSlotConfig):
    """GRIN (SparseMixer-v2) top-k MoE slot (the reference: ``k = 2``).

    moe: the MoE settings, declared once as a :class:`MoEConfig` (experts, expert width and
        activation, dispatch, capacity, balance / z-loss); ``top_k`` stages (2 in GRIN,
        ``2 <= top_k <= n_experts``); GRIN needs the
        softmax router's logits with ``renormalize=False`` (SparseMixer-v2 computes its own
        weights), and no shared experts or universal FFN.
    jitter_eps: masked-softmax band; expert j is a candidate iff
        ``(max - s_j) / max(|s_j|, max) <= 2 jitter_eps`` (GRIN-MoE / Phi-3.5-MoE use 0.01).
    sample: draw the experts from the masked softmax in training (GRIN); False = argmax always
        (then training is plain masked-softmax top-k with ordinary gradients).
    """

    moe: MoEConfig = GRIN_MOE
    jitter_eps: float = 0.01
    sample: bool = True

    def validate(self) -> None:
        m = self.moe
        self._require(2 <= m.top_k <= m.n_experts,
                      f"moe.top_k={m.top_k}: SparseMixer-v2 needs 2 <= top_k <= n_experts "
                      f"({m.n_experts}); GRIN itself is top-2")
        self._require(m.router == "softmax" and not m.renormalize,
                      "GRIN reads the softmax router's logits and computes its own weights: "
                      "set moe.router='softmax' and moe.renormalize=False")
        self._require(m.n_shared_experts == 0 and not m.universal_ffn,
                      "a GRIN slot has no shared experts or universal FFN")
        self._require(self.jitter_eps >= 0, f"jitter_eps={self.jitter_eps} must be >= 0")

    def moe_config(self) -> MoEConfig:
        """The slot's :class:`MoEConfig` (router / aux helpers)."""
        return self.moe

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return GRIN(self, d_model, rngs=rngs, dtype=dtype, param_dtype=param_dtype or jnp.float32)


class SparseMixerNoise(NamedTuple):
    """Random draws of one training call: ``gumbel_KNE [k, N, E]`` (Gumbel(0, 1) for the k
    Gumbel-max samples) and ``uniform_KN [k, N]`` (U(0, 1) for the Heun factor)."""

    gumbel_KNE: jax.Array
    uniform_KN: jax.Array


def sample_noise(key, n_tokens: int, n_experts: int, k: int = 2) -> SparseMixerNoise:
    kg, ku = jax.random.split(key)
    return SparseMixerNoise(jax.random.gumbel(kg, (k, n_tokens, n_experts), jnp.float32),
                            jax.random.uniform(ku, (k, n_tokens), jnp.float32))


def _stage(scores_NE, remaining_NE, jitter_eps: float, noise_NE, u_N):
    """One SparseMixer stage on ``remaining`` (``scores`` with used experts at -inf).
    Returns ``(ids_N, weight_N, pi_NE)``."""
    sg = jax.lax.stop_gradient
    m_N1 = jnp.max(sg(remaining_NE), axis=-1, keepdims=True)
    factor = jnp.maximum(jnp.abs(sg(scores_NE)), m_N1)
    drop = ((m_N1 - sg(scores_NE)) / factor > 2.0 * jitter_eps) | jnp.isneginf(remaining_NE)
    masked = jnp.where(drop, -jnp.inf, remaining_NE)
    pi_NE = jax.nn.softmax(masked, axis=-1)
    arg_N = jnp.argmax(remaining_NE, axis=-1)
    if noise_NE is None:
        ids_N = arg_N
    else:
        ids_N = jnp.argmax(sg(masked) + noise_NE, axis=-1)
    pi_sel = jnp.take_along_axis(pi_NE, ids_N[:, None], axis=-1)[:, 0]
    if u_N is None:
        return ids_N, pi_sel, pi_NE
    c_N = jnp.where((ids_N == arg_N) | (u_N > 0.75), 1.0, 1.0 / 3.0)
    # Straight-through: forward c * pi_D, backward d(pi_D)/ds (SparseMixer-v2 ``mp``).
    w_N = pi_sel + jax.lax.stop_gradient(c_N * pi_sel - pi_sel)
    return ids_N, w_N, pi_NE


def sparsemixer_v2(logits_NE, *, jitter_eps: float,
                   noise: SparseMixerNoise | None = None, k: int = 2) -> RouterOutput:
    """SparseMixer-v2 top-``k`` routing of float logits ``[N, E]`` (module docstring; GRIN:
    ``k = 2``; with ``noise``, ``k`` is its number of stages).

    ``noise=None``: eval (argmax ids, weights ``pi^(k)_{D_k}``); else the training forward /
    estimator with the given draws. ``probs_NE`` is the full ``softmax(logits)`` (for the
    balance loss and gate-mass statistics)."""
    s = logits_NE.astype(jnp.float32)
    N = s.shape[0]
    if noise is not None:
        k = noise.gumbel_KNE.shape[0]
    rest, ids, ws = s, [], []
    for i in range(k):
        g = None if noise is None else noise.gumbel_KNE[i]
        u = None if noise is None else noise.uniform_KN[i]
        ids_N, w_N, _ = _stage(s, rest, jitter_eps, g, u)
        ids.append(ids_N)
        ws.append(w_N)
        rest = rest.at[jnp.arange(N), ids_N].set(-jnp.inf)
    ids_NK = jnp.stack(ids, -1).astype(jnp.int32)
    weights_NK = jnp.stack(ws, -1)
    return RouterOutput(ids_NK, weights_NK, jax.nn.softmax(s, axis=-1), s)


class GRIN(MoESkeleton):
    """GRIN top-k MoE slot built from a :class:`GRINConfig` (see the module docstring).
    Parameters: ``router/w_g [D, E]``, ``experts/w_up [E, D, F]``, ``experts/w_down [E, F, D]``
    (+ ``experts/w_gate`` for gated activations)."""

    def __init__(self, cfg: GRINConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        self.cfg, self.dtype, self.d_model = cfg, dtype, d_model
        self.moe_cfg = cfg.moe_config()
        self.top_k = cfg.moe.top_k
        self.router = make_router(self.moe_cfg, d_model, rngs=rngs, param_dtype=param_dtype)
        self.experts = StackedExperts(cfg.moe.n_experts, d_model, cfg.moe.d_expert,
                                      gated=is_gated(cfg.moe.activation), rngs=rngs,
                                      param_dtype=param_dtype)

    def route(self, x_ND, *, train: bool = False, key=None) -> RouterOutput:
        logits = self.router.logits(x_ND)
        noise = None
        if train and self.cfg.sample:
            if key is None:
                raise ValueError(
                    "GRIN: train=True samples experts (SparseMixer-v2) and needs an explicit "
                    "PRNG key; pass key=jax.random.key(...), or use sample=False / train=False")
            noise = sample_noise(key, logits.shape[0], self.cfg.moe.n_experts, self.top_k)
        return sparsemixer_v2(logits, jitter_eps=self.cfg.jitter_eps, noise=noise,
                              k=self.top_k)
