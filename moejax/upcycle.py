"""Upcycling a dense decoder into an MoE decoder as explicit, pure tree surgery (DeRS paper,
Sec. 3.1).

A rule map (:class:`UpcycleConfig`) says which blocks become MoE layers (``"all"``,
``"every_other"`` or an explicit ``block_list``), ``N`` / ``k``, the router (new, random or
zero), universal FFN and shared experts, and the expert form:

* ``"vanilla"``: each of the N experts is a copy of the dense FFN
  ``W_i = W_dense`` (stacked ``experts/w_* [N, ...]``, :class:`moejax.nn.moe.MoE`);
* ``"sm"`` / ``"lm"``: DeRS upcycling (:mod:`moejax.nn.ders_moe`), ``W_shared = W_dense`` and
  zero increments (SM index vectors drawn once from the key and stored as buffers);
* ``"split"`` (Llama-MoE's neuron partition): the dense FFN's ``F`` hidden neurons are split
  by a random permutation (from the key) into N groups of ``F / N``, expert ``e`` keeps its
  group's columns of ``w_up`` / ``w_gate`` and rows of ``w_down``, scaled by ``N``; so
  ``FFN(x) = sum_e E_e(x) / N``: with uniform gates the ALL-experts mixture is exactly the dense
  FFN, and top-k is ``(N / k)`` times the selected experts' share (unbiased over a uniformly
  random selection). Total FFN parameters stay those of the dense model.

Universal FFN and shared experts are also copies of the dense FFN. By default they are plain
copies, as in the papers (Med-MoE / Coder-MoE: the layer's output at step 0 is ``(1 + u +
n_shared)`` times the dense FFN's). With ``scale_outputs=True`` (an option) every ``w_down``
is multiplied by ``s = 1 / (1 + [universal] + n_shared)`` so that the upcycled layer
computes exactly the dense function at step 0::

    y = sum_k g_k(x) s FFN(x) + s FFN(x) [universal] + n_shared s FFN(x) = FFN(x)

(renormalised top-k weights ``sum_k g_k = 1`` and no dropped tokens). Without universal FFN
and shared experts ``s = 1`` either way.

:func:`upcycle_params` is the pure function ``dense parameter dict -> MoE variable dict``;
:func:`upcycle_model` wraps it for an nnx model (builds the MoE model abstractly, so no random
init of the big expert stacks is computed). Upcycling returns parameters only: training starts
from a fresh optimizer state (``moejax.train.init_train_state`` / ``train`` build one), the
router is new. :func:`param_report` gives the exact trainable / added / stored counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config, config
from moejax.nn.ders_moe import (
    DeRSFrozen,
    DeRSIndex,
    DeRSMoEConfig,
    check_lm_rank,
    draw_sm_indices,
    lm_a_std,
    sm_num_kept,
)
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.surgery import build_from_pure

__all__ = ["UpcycleConfig", "UPCYCLE_MOE", "upcycled_layers", "moe_slot_config",
           "upcycle_decoder_config", "upcycle_ffn", "upcycle_params", "upcycle_model",
           "output_scale", "param_report", "model_variables"]

_W = ("w_gate", "w_up", "w_down")

# The MoE settings upcycling starts from: MoEConfig's defaults, except a capacity that never
# drops (n_experts / top_k). Derive variants with ``UPCYCLE_MOE.replace(n_experts=8, ...)``.
UPCYCLE_MOE = MoEConfig(capacity_factor=None)


@config
class UpcycleConfig(Config):
    """Rule map of dense -> MoE upcycling (see the module docstring).

    blocks / block_list / offset: ``"all"``, ``"every_other"`` (layers offset, offset+2, ...;
        MoE-LLaVA uses every other block) or ``"list"`` (the indices in ``block_list``).
    moe: the new MoE layers' settings (experts, top-k, router, dispatch, capacity, balance
        and z losses, universal FFN and shared experts, which are copies of the dense FFN);
        its ``d_expert``, ``activation``, ``d_shared`` and ``d_universal`` are taken from the
        dense FFN (the ``"split"`` form: ``d_expert = d_hidden / n_experts``).
        ``capacity_factor=None`` (the default here) = ``n_experts / top_k``: never drops.
    router_init / router_init_std: ``w_g ~ N(0, std^2)`` or zeros (the router is always new).
    scale_outputs: divide every ``w_down`` by the number of parallel copies (function
        preserving; see module docstring). Default False: plain copies, as in the papers.
    expert_form: ``"vanilla"`` copies or DeRS ``"sm"`` / ``"lm"`` with ``sm_rate``,
        ``lm_rank``, ``lm_init_std``, ``freeze_shared``, ``extended`` (DeRSMoEConfig).
    """

    blocks: Literal["all", "every_other", "list"] = "every_other"
    block_list: tuple = ()
    offset: int = 1
    moe: MoEConfig = MoEConfig(capacity_factor=None)  # = UPCYCLE_MOE
    router_init: Literal["normal", "zeros"] = "normal"
    router_init_std: float = 0.02
    scale_outputs: bool = False
    expert_form: Literal["vanilla", "sm", "lm", "split"] = "vanilla"
    sm_rate: float = 0.99
    lm_rank: int = 4
    lm_init_std: float | None = None
    freeze_shared: bool = False
    extended: bool = False

    def validate(self) -> None:
        r = self._require
        r(self.blocks != "list" or len(self.block_list) > 0,
          "blocks='list' needs block_list (e.g. block_list=(1, 3)); or use blocks='all'")
        r(self.blocks == "list" or not self.block_list,
          f"block_list={self.block_list} is read only with blocks='list' (blocks="
          f"{self.blocks!r} would ignore it); set blocks='list' or drop block_list")
        r(all(isinstance(i, int) and i >= 0 for i in self.block_list),
          f"block_list={self.block_list} must hold non-negative layer indices")
        r(self.offset >= 0, f"offset={self.offset} must be >= 0")
        r(self.router_init_std >= 0, f"router_init_std={self.router_init_std} must be >= 0")
        r(0.0 <= self.sm_rate < 1.0, f"sm_rate={self.sm_rate} must be in [0, 1) (the fraction "
          "of a delta's positions without a trainable value; 1 would leave none)")
        for name, read, rule in (
                ("offset", self.blocks == "every_other", "blocks='every_other'"),
                ("sm_rate", self.expert_form == "sm", "expert_form='sm'"),
                ("lm_rank", self.expert_form == "lm", "expert_form='lm'"),
                ("lm_init_std", self.expert_form == "lm", "expert_form='lm'"),
                ("router_init_std", self.router_init == "normal", "router_init='normal'")):
            self._require_default_unless(read, name, rule)
        for name in ("d_expert", "activation", "d_shared", "d_universal"):
            value = getattr(self.moe, name)
            r(value == MoEConfig._default(name),
              f"moe.{name}={value!r}: the experts take it from the dense FFN they are "
              "upcycled from (its width and activation), so it would be ignored; drop it")
        r(self.expert_form in ("sm", "lm") or not (self.freeze_shared or self.extended),
          "freeze_shared / extended apply to DeRS experts; set expert_form='sm' or 'lm'")
        r(not self.extended or self.moe.universal_ffn,
          "extended=True decomposes the universal FFN; set moe.universal_ffn=True")


def upcycled_layers(n_layers: int, rule: UpcycleConfig) -> tuple[int, ...]:
    """Indices of the blocks that become MoE layers; a rule that chooses none is refused
    (the "upcycled" model would be the dense one)."""
    if rule.blocks == "all":
        return tuple(range(n_layers))
    if rule.blocks == "every_other":
        layers = tuple(range(rule.offset, n_layers, 2))
        if not layers:
            raise ValueError(f"upcycle: blocks='every_other' from offset={rule.offset} chooses "
                             f"no block of a {n_layers}-layer model, so nothing would become "
                             "an MoE; lower offset or use blocks='all'")
        return layers
    bad = [i for i in rule.block_list if i >= n_layers]
    if bad:
        raise ValueError(f"upcycle: block_list entries {bad} out of range for {n_layers} layers")
    return tuple(sorted(set(rule.block_list)))


def moe_slot_config(rule: UpcycleConfig, dense: DenseFFNConfig):
    """The MoE slot (``MoEConfig`` or ``DeRSMoEConfig``) replacing a dense FFN slot."""
    if not isinstance(dense, DenseFFNConfig):
        raise TypeError(f"upcycle: can only upcycle DenseFFNConfig slots, got {type(dense)}")
    if dense.use_bias:
        raise ValueError("upcycle: dense FFNs with biases are not supported (MoE experts are "
                         "bias-free); upcycle a bias-free model")
    d_expert = dense.d_hidden
    if rule.expert_form == "split":
        if dense.d_hidden % rule.moe.n_experts:
            raise ValueError(f"upcycle: expert_form='split' divides the {dense.d_hidden} hidden "
                             f"neurons into n_experts={rule.moe.n_experts} equal groups; pick a "
                             "divisor")
        d_expert = dense.d_hidden // rule.moe.n_experts
    # the universal FFN and shared experts are copies of the whole dense FFN, also when the
    # split experts are narrower
    moe = rule.moe.replace(
        d_expert=d_expert, activation=dense.activation, capacity_factor=rule.moe.capacity,
        d_shared=dense.d_hidden if rule.moe.n_shared_experts else None,
        d_universal=dense.d_hidden if rule.moe.universal_ffn else None)
    if rule.expert_form in ("vanilla", "split"):
        return moe
    return DeRSMoEConfig(moe=moe, form=rule.expert_form, sm_rate=rule.sm_rate,
                         lm_rank=rule.lm_rank, lm_init_std=rule.lm_init_std,
                         freeze_shared=rule.freeze_shared, extended=rule.extended)


def upcycle_decoder_config(dense_cfg, rule: UpcycleConfig):
    """``dense_cfg`` (any config with ``n_layers`` and ``ffn_slots``) with the chosen slots
    replaced by :func:`moe_slot_config`."""
    chosen = set(upcycled_layers(dense_cfg.n_layers, rule))
    slots = tuple(moe_slot_config(rule, s) if i in chosen else s
                  for i, s in enumerate(dense_cfg.ffn_slots))
    return dataclasses.replace(dense_cfg, ffn_slots=slots)


def output_scale(rule: UpcycleConfig) -> float:
    """``s = 1 / (1 + [universal] + n_shared)`` with ``scale_outputs``, else 1."""
    if not rule.scale_outputs:
        return 1.0
    return 1.0 / (1 + int(rule.moe.universal_ffn) + rule.moe.n_shared_experts)


def _scaled(ffn: dict, s: float) -> dict:
    return {k: (v * s if k == "w_down" else v) for k, v in ffn.items()}


def _router(key, d_model: int, rule: UpcycleConfig, dtype) -> dict:
    shape = (d_model, rule.moe.n_experts)
    if rule.router_init == "zeros":
        w = jnp.zeros(shape, dtype)
    else:
        w = jax.random.normal(key, shape, dtype) * rule.router_init_std
    out = {"w_g": w}
    if rule.moe.router == "noisy":
        out["w_noise"] = jnp.zeros(shape, dtype)
    return out


def _ders_stack(key, n: int, ffn: dict, rule: UpcycleConfig) -> dict:
    """Zero DeRS increments for ``n`` experts (SM: fresh index vectors from ``key``)."""
    out = {}
    for j, w in enumerate(k for k in _W if k in ffn):
        name, (d_in, d_out) = w[2:], ffn[w].shape
        kk = jax.random.fold_in(key, j)
        if rule.expert_form == "sm":
            k = sm_num_kept(d_in, d_out, rule.sm_rate)
            out[f"idx_{name}"] = draw_sm_indices(kk, n, d_in * d_out, k)
            out[f"v_{name}"] = jnp.zeros((n, k), ffn[w].dtype)
        else:
            check_lm_rank(rule.lm_rank, name, d_in, d_out)
            out[f"a_{name}"] = (jax.random.normal(kk, (n, d_in, rule.lm_rank), ffn[w].dtype)
                                * lm_a_std(rule.lm_init_std, d_in))
            out[f"b_{name}"] = jnp.zeros((n, rule.lm_rank, d_out), ffn[w].dtype)
    return out


def upcycle_ffn(key: jax.Array, ffn: dict, rule: UpcycleConfig) -> dict:
    """Pure surgery of ONE layer: dense FFN params ``{w_gate?, w_up [D, F], w_down [F, D]}``
    -> the variables of the MoE slot (Params and buffers in one nested dict)."""
    missing = [w for w in ("w_up", "w_down") if w not in ffn]
    if missing or any(k not in _W for k in ffn):
        raise ValueError(f"upcycle_ffn: expected dense FFN keys {_W} (bias-free), got "
                         f"{sorted(ffn)}")
    ffn = {k: jnp.asarray(v) for k, v in ffn.items()}
    d_model = ffn["w_up"].shape[0]
    s = output_scale(rule)
    k_router, k_exp, k_uni = jax.random.split(key, 3)
    out: dict[str, Any] = {"router": _router(k_router, d_model, rule, ffn["w_up"].dtype)}
    scaled = _scaled(ffn, s)
    if rule.expert_form == "vanilla":
        out["experts"] = {k: jnp.broadcast_to(v, (rule.moe.n_experts,) + v.shape)
                          for k, v in scaled.items()}
    elif rule.expert_form == "split":
        n, f = rule.moe.n_experts, ffn["w_up"].shape[1]
        if f % n:
            raise ValueError(f"upcycle_ffn: {f} hidden neurons do not split into {n} experts")
        groups_EG = jax.random.permutation(k_exp, f).reshape(n, f // n)
        out["experts"] = {k: (v[groups_EG] * (n * s) if k == "w_down"
                              else jnp.transpose(v[:, groups_EG], (1, 0, 2)))
                          for k, v in ffn.items()}
    else:
        out["base"] = dict(scaled)
        out["experts"] = _ders_stack(k_exp, rule.moe.n_experts, ffn, rule)
    if rule.moe.universal_ffn:
        out["universal"] = (_ders_stack(k_uni, 1, ffn, rule) if rule.extended
                            else dict(scaled))
    if rule.moe.n_shared_experts > 0:
        n = rule.moe.n_shared_experts
        out["shared"] = {k: jnp.concatenate([v] * n, axis=0 if k == "w_down" else 1)
                         for k, v in scaled.items()}
    return out


def _get(tree: dict, i: int):
    blocks = tree["blocks"]
    return blocks[i] if i in blocks else blocks[str(i)]


def upcycle_params(key: jax.Array, dense_params: dict, dense_cfg, rule: UpcycleConfig) -> dict:
    """Pure: dense parameter dict (``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` layout,
    ``blocks/{i}/ffn/w_*``) -> variable dict of the upcycled model (every non-FFN leaf shared
    unchanged; layer ``i`` uses ``fold_in(key, i)``)."""
    layers = upcycled_layers(dense_cfg.n_layers, rule)
    out = jax.tree.map(lambda x: x, dense_params)  # new containers, same leaves
    for i in layers:
        block = _get(out, i)
        block["ffn"] = upcycle_ffn(jax.random.fold_in(key, i), block["ffn"], rule)
    return out


def upcycle_model(dense_model, rule: UpcycleConfig, key: jax.Array):
    """nnx wrapper: a new model of ``type(dense_model)`` with the upcycled config and the
    parameters of :func:`upcycle_params` (the dense model is left untouched)."""
    cfg = upcycle_decoder_config(dense_model.cfg, rule)
    dense = nnx.to_pure_dict(nnx.state(dense_model, nnx.Param))
    return build_from_pure(lambda: type(dense_model)(cfg, rngs=nnx.Rngs(0)),
                           upcycle_params(key, dense, dense_model.cfg, rule))


def model_variables(model) -> dict[str, int]:
    """Exact element counts by variable kind: ``trainable`` (nnx.Param), ``frozen``
    (DeRSFrozen), ``index`` (DeRSIndex), ``other`` (any other non-Param variable)."""
    def n(filt):
        return int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, filt))))
    trainable, frozen, index = n(nnx.Param), n(DeRSFrozen), n(DeRSIndex)
    total = int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model))))
    return {"trainable": trainable, "frozen": frozen, "index": index,
            "other": total - trainable - frozen - index}


def param_report(dense_model, moe_model) -> dict[str, int]:
    """Exact counts of an upcycled model against its dense source:

    * ``dense``: parameters of the dense model;
    * ``trainable``: ``nnx.Param`` elements of the MoE model (what the optimizer updates);
    * ``weights``: float weights of the MoE model (trainable + frozen shared);
    * ``added``: ``weights - dense`` (the paper's "Added Params": router + expert extras);
    * ``index``: DeRS-SM index entries (stored, never trained);
    * ``stored``: ``weights + index``; ``added_with_index``: ``stored - dense``.
    """
    dense = model_variables(dense_model)["trainable"]
    v = model_variables(moe_model)
    weights = v["trainable"] + v["frozen"]
    return {"dense": dense, "trainable": v["trainable"], "weights": weights,
            "added": weights - dense, "index": v["index"], "stored": weights + v["index"],
            "added_with_index": weights + v["index"] - dense}
