"""Extracted-experts FFN slot (MoEE, and MoEfication's experts): a dense MLP whose hidden
neurons are grouped into (possibly overlapping) experts, one or ``top_k`` experts per token.

``y_BTD, aux = slot(x_BTD, train=..., key=None, mask_BT=None)``::

    s_NE = score(x)                      router (below), float32
    S_n  = top_k(s_n)                    selected experts of token n
    m_nF = OR_{c in S_n} masks[c]        the hidden neurons the token's experts use
    y_n  = (act(x_n W_up + b_up) * m_nF) W_down + b_down

so a token routed to expert ``c`` computes exactly ``W_down[M_c]^T act(W_up[:, M_c]^T x + b_up[M_c])
+ b_down`` (the paper's expert output). The hidden width ``d_hidden`` is the number of neurons
kept by at least one expert (the others were removed at extraction).

Routers (``router`` in the config; vectors ``r_c`` and biases ``b_c`` come from the plan):

* ``"cosine"`` (MoEE default): ``s_c = x . r_c / |r_c|`` (= cosine up to the token's norm);
* ``"euclidean"`` (ablation): ``s_c = -|x - r_c|^2``;
* ``"dot"``: ``s_c = x . r_c + b_c``;
* ``"param"`` (MoEfication's parameter-centre router, Zhang et al. 2022 Sec. 3.2):
  ``s_c = -|x / |x| - r_c|``, the nearest centre to the normalised input;
* ``"mlp"`` (MoEfication's MLP router): ``s = tanh((x / |x|) R1) R2``, trained beforehand
  (:func:`moejax.extract.pipeline.train_mlp_router`);
* ``"random"`` (MoEE Table 2's random routing): each token to uniformly random experts,
  drawn from a hash of the token's bits (fixed for a given input, unrelated to its content).

Parameter paths: ``w_up [D, F]``, ``b_up [F]``, ``w_down [F, D]``, ``b_down [D]`` (DenseFFN
names, trainable); ``masks [E, F]`` (:class:`ExpertMask`), ``router [E, D]``, ``router_bias
[E]`` or ``router_w1 [D, H]``, ``router_w2 [H, E]``
(:class:`RouterWeights`): not ``nnx.Param``, so fine-tuning keeps the extracted routing.

Two layouts (``layout`` in the config):

* ``"masked"`` (default, trainable): the masked oracle above; every kept neuron is evaluated
  and the unused ones zeroed, so it saves no time.
* ``"compact"`` (serving, built by :func:`moejax.extract.layer_surgery.compact_model`): each
  expert's neurons copied into contiguous weights ``w_up [E, D (+1), d_expert]`` (the up
  bias folded in as an extra input row), ``w_down [E, d_expert, D (+1)]``, zero-padded to the
  largest expert; tokens go to their experts through the MoE dispatch (``dispatch``: the host
  kernel on a CPU, which skips each expert's padding, the grouped-matmul kernel on GPU/TPU),
  so a token computes only its expert's neurons. Optionally ``d_shared`` neurons (e.g. those
  of the most used expert) are taken out of the experts and computed for every token in one
  dense product, masked per token like the masked layout (``w_up_shared [D, d_shared]``,
  ``b_up_shared``, ``w_down_shared [d_shared, D]``, ``shared_masks [E, d_shared]``): a few
  MACs more for tokens of the other experts, in exchange for the dense product's rate on the
  neurons most tokens use (:func:`moejax.extract.layer_surgery.shared_neurons` chooses them). Exact
  for one expert per token, or for experts whose non-shared neurons are disjoint.

``aux``: ``expert_ids [B, T, k]``, ``load [E]`` (share of real tokens' assignments per expert),
``active_neurons`` (mean hidden neurons used per real token). No auxiliary loss.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import config
from moejax.kernels.moe_ffn.api import dispatch
from moejax.kernels.moe_ffn.jnp_paths import DispatchMethod
from moejax.nn import axes as ax
from moejax.nn.slots import FFNSlotConfig
from moejax.ops.activations import ActivationName, activation_fn

__all__ = ["ExtractedFFNConfig", "ExtractedFFN", "ExpertMask", "RouterWeights", "random_scores"]


def _mix(h):
    """A 32-bit integer finaliser (MurmurHash3's): every input bit flips each output bit with
    probability about 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def random_scores(x_ND: jax.Array, n_experts: int) -> jax.Array:
    """``[N, E]`` scores uniform in [0, 1), independent across experts and across distinct
    tokens: a hash of each token's float32 bits, so the top-k are uniformly random experts that
    do not depend on what the token means (equal inputs get equal experts)."""
    bits = jax.lax.bitcast_convert_type(x_ND.astype(jnp.float32), jnp.uint32)
    odd = jnp.arange(x_ND.shape[-1], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    h = _mix(jnp.sum(_mix(bits ^ (odd * jnp.uint32(0x9E3779B1))) * odd, -1, dtype=jnp.uint32))
    c = jnp.arange(n_experts, dtype=jnp.uint32)
    u = _mix(h[:, None] + (c + jnp.uint32(1)) * jnp.uint32(0x9E3779B9))
    return (u >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


class ExpertMask(nnx.Variable):
    """Expert-to-neuron membership (0/1, float32): structure, not trained."""


class RouterWeights(nnx.Variable):
    """Routing vectors / router network fixed at extraction, not trained."""


@config
class ExtractedFFNConfig(FFNSlotConfig):
    """d_hidden: kept neurons; n_experts / top_k: experts and experts per token; router:
    see the module docstring (d_router: hidden width of the ``"mlp"`` router)."""

    d_hidden: int
    n_experts: int
    top_k: int = 1
    activation: ActivationName = "gelu"
    use_bias: bool = True
    router: Literal["cosine", "euclidean", "dot", "param", "mlp", "random"] = "cosine"
    d_router: int = 0
    layout: Literal["masked", "compact"] = "masked"
    d_expert: int | None = None  # compact layout: neurons per expert (the largest expert's)
    d_shared: int = 0  # compact layout: neurons computed for every token (masked), not routed
    dispatch: DispatchMethod = "auto"  # compact layout: the MoE dispatch path

    def validate(self) -> None:
        self._require(self.d_hidden > 0, f"d_hidden={self.d_hidden} must be > 0")
        self._require(self.n_experts >= 1, f"n_experts={self.n_experts} must be >= 1")
        self._require(1 <= self.top_k <= self.n_experts,
                      f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        self._require(self.activation not in ("swiglu", "geglu"),
                      "extracted experts support non-gated activations only")
        self._require(self.router != "mlp" or self.d_router > 0,
                      "router='mlp' needs d_router > 0 (the router's hidden width)")
        self._require(self.layout == "masked" or self.d_expert is not None,
                      "layout='compact' needs d_expert (build it with "
                      "moejax.extract.layer_surgery.compact_model)")
        self._require(self.d_shared >= 0 and (self.d_expert or 0) >= 0,
                      f"d_shared={self.d_shared} and d_expert={self.d_expert} must be >= 0")
        self._require(self.layout == "compact" or self.d_shared == 0,
                      "d_shared is a compact-layout field")

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return ExtractedFFN(self, d_model, rngs=rngs, dtype=dtype,
                            param_dtype=param_dtype or jnp.float32)


class ExtractedFFN(nnx.Module):
    """See the module docstring. Built empty (zeros); :mod:`moejax.extract.layer_surgery`
    fills it."""

    def __init__(self, cfg: ExtractedFFNConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        del rngs  # every value comes from the dense layer and the plan
        self.cfg, self.dtype, self.d_model = cfg, dtype, d_model
        D, F, E, H = d_model, cfg.d_hidden, cfg.n_experts, cfg.d_router
        z = lambda *s: jnp.zeros(s, param_dtype)  # noqa: E731
        if cfg.layout == "compact":
            Fe, bias_row = cfg.d_expert, int(cfg.use_bias)
            self.w_up = ax.param(z(E, D + bias_row, Fe), ax.EXPERTS, ax.EMBED, ax.MLP)
            self.w_down = ax.param(z(E, Fe, D + bias_row), ax.EXPERTS, ax.MLP, ax.EMBED)
            if cfg.use_bias:
                self.b_down = ax.param(z(D), ax.EMBED)
            self.sizes = ExpertMask(jnp.zeros((E,), jnp.float32))
            if cfg.d_shared:
                Fs = cfg.d_shared
                self.w_up_shared = ax.param(z(D, Fs), ax.EMBED, ax.MLP)
                self.w_down_shared = ax.param(z(Fs, D), ax.MLP, ax.EMBED)
                if cfg.use_bias:
                    self.b_up_shared = ax.param(z(Fs), ax.MLP)
                self.shared_masks = ExpertMask(jnp.zeros((E, Fs), jnp.float32))
        else:
            self.w_up = ax.param(z(D, F), ax.EMBED, ax.MLP)
            self.w_down = ax.param(z(F, D), ax.MLP, ax.EMBED)
            if cfg.use_bias:
                self.b_up, self.b_down = ax.param(z(F), ax.MLP), ax.param(z(D), ax.EMBED)
            self.masks = ExpertMask(jnp.zeros((E, F), jnp.float32))
        if cfg.router == "mlp":
            self.router_w1, self.router_w2 = RouterWeights(z(D, H)), RouterWeights(z(H, E))
        else:
            self.router, self.router_bias = RouterWeights(z(E, D)), RouterWeights(z(E))

    def scores(self, x_ND: jax.Array) -> jax.Array:
        """Routing scores ``[N, E]`` (float32)."""
        x = x_ND.astype(jnp.float32)
        kind = self.cfg.router
        if kind == "random":
            return random_scores(x, self.cfg.n_experts)
        if kind in ("mlp", "param"):
            x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        if kind == "mlp":
            return jnp.tanh(x @ self.router_w1[...]) @ self.router_w2[...]
        r = self.router[...].astype(jnp.float32)
        dots = x @ r.T
        if kind == "cosine":
            return dots / jnp.maximum(jnp.linalg.norm(r, axis=-1), 1e-12)
        if kind == "dot":
            return dots + self.router_bias[...]
        sq = jnp.sum(r * r, -1) + jnp.sum(x * x, -1, keepdims=True) - 2.0 * dots
        return -sq if kind == "euclidean" else -jnp.sqrt(jnp.maximum(sq, 0.0))  # param

    def __call__(self, x_BTD: jax.Array, *, train: bool = False, key=None, mask_BT=None,
                 segment_ids_BT=None):
        del train, key, segment_ids_BT
        cfg = self.cfg
        B, T, D = x_BTD.shape
        dt = self.dtype or x_BTD.dtype
        x = x_BTD.reshape(B * T, D).astype(dt)
        _, ids_NK = jax.lax.top_k(self.scores(x), cfg.top_k)
        sel_NE = jnp.sum(jax.nn.one_hot(ids_NK, cfg.n_experts, dtype=jnp.float32), axis=1)
        if cfg.layout == "compact":
            y, used_N = self._compact(x, ids_NK, sel_NE, mask_BT, dt)
        else:
            y, used_N = self._masked(x, sel_NE, self.masks, self.w_up,
                                     self.b_up if cfg.use_bias else None, self.w_down, dt)
        if cfg.use_bias:
            y = y + self.b_down[...].astype(dt)
        real_N = (jnp.ones((B * T,), jnp.float32) if mask_BT is None
                  else mask_BT.reshape(B * T).astype(jnp.float32))
        n_real = jnp.maximum(jnp.sum(real_N), 1.0)
        counts_E = jnp.sum(sel_NE * real_N[:, None], axis=0)
        aux = {"expert_ids": ids_NK.reshape(B, T, -1),
               "load": counts_E / jnp.maximum(jnp.sum(counts_E), 1.0),
               "active_neurons": jnp.sum(used_N * real_N) / n_real}
        return y.reshape(B, T, D), aux

    def _masked(self, x_ND, sel_NE, masks, w_up, b_up, w_down, dt):
        """``(y_ND, neurons used per token)``: every neuron of ``w_up`` for every token, those
        no selected expert keeps zeroed (the masked layout, and the compact one's shared
        neurons)."""
        m_NF = jnp.minimum(sel_NE @ masks[...], 1.0)
        up = x_ND @ w_up[...].astype(dt)
        if b_up is not None:
            up = up + b_up[...].astype(dt)
        h = activation_fn(self.cfg.activation)(up) * m_NF.astype(dt)
        return h @ w_down[...].astype(dt), jnp.sum(m_NF, -1)

    def _compact(self, x_ND, ids_NK, sel_NE, mask_BT, dt):
        """``(y_ND without b_down, neurons used per token)``: the shared neurons in one masked
        dense product, each token through its experts' own contiguous weights by the MoE
        dispatch."""
        cfg = self.cfg
        parts, used_N = [], sel_NE @ self.sizes[...]
        if cfg.d_shared:
            y_shared, shared_N = self._masked(x_ND, sel_NE, self.shared_masks, self.w_up_shared,
                                              self.b_up_shared if cfg.use_bias else None,
                                              self.w_down_shared, dt)
            parts, used_N = [y_shared], used_N + shared_N
        if cfg.d_expert:
            xb = x_ND
            if cfg.use_bias:  # the folded up-bias row
                xb = jnp.concatenate([x_ND, jnp.ones((x_ND.shape[0], 1), x_ND.dtype)], axis=1)
            valid_N = None if mask_BT is None else mask_BT.reshape(-1) > 0
            out = dispatch(cfg.dispatch, xb, ids_NK, jnp.ones(ids_NK.shape, dt),
                           self.w_up[...].astype(dt), self.w_down[...].astype(dt), None,
                           activation=cfg.activation, valid_N=valid_N,
                           expert_widths_E=self.sizes[...].astype(jnp.int32))
            parts.append(out.y_ND[:, :self.d_model].astype(dt))
        return (sum(parts[1:], parts[0]) if parts else jnp.zeros_like(x_ND)), used_N
