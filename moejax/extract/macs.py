"""Exact multiply-accumulate (MAC) and parameter accounting of dense, extracted and MoEfied
encoder models (per example, matrix products only; biases, norms, softmax and activations
are not MACs, as in fvcore / the paper's tables).

Per block with ``T`` tokens, width ``D``:

* attention: ``4 T D^2`` (q, k, v, o projections) + ``2 T^2 D`` (scores and weighted values);
  over text examples of several real lengths, the mean of ``T`` and of ``T^2``
* dense FFN of width ``F``: ``2 T D F`` (``3 T D F`` gated)
* extracted FFN: router ``T E D`` (``T (D H + H E)`` for the MLP router) + experts
  ``2 T D a``, ``a`` = mean hidden neurons a token uses (measured: ``aux["active_neurons"]``)

plus the ViT's patch embedding ``n_patches * p^2 Z * D`` and the classifier head ``D L``
(BERT embeddings are lookups: 0). Parameters: trainable weights (``nnx.Param``) plus the
extracted routers' vectors (:class:`~moejax.nn.extracted.RouterWeights`); expert masks are
structure (an index list per expert) and are counted separately.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from moejax.extract.layer_surgery import ffn_holder
from moejax.extract.plan import kept_neurons
from moejax.nn.extracted import ExpertMask, ExtractedFFNConfig, RouterWeights
from moejax.nn.ffn import DenseFFNConfig
from moejax.ops.activations import is_gated

__all__ = ["ffn_macs", "model_macs", "param_counts", "param_breakdown"]


def ffn_macs(slot_cfg, d_model: int, tokens: float, active_neurons: float | None = None) -> dict:
    """``{"router": ..., "experts": ...}`` MACs of one FFN slot over ``tokens`` tokens."""
    D = d_model
    if isinstance(slot_cfg, DenseFFNConfig):
        return {"router": 0.0,
                "experts": float(tokens * (3 if is_gated(slot_cfg.activation) else 2) * D
                                 * slot_cfg.d_hidden)}
    if isinstance(slot_cfg, ExtractedFFNConfig):
        if active_neurons is None:
            raise ValueError("an extracted FFN's MACs need active_neurons (the mean hidden "
                             "neurons per token, aux['active_neurons'])")
        E, H = slot_cfg.n_experts, slot_cfg.d_router
        router = {"mlp": D * H + H * E, "random": 0}.get(slot_cfg.router, E * D)
        return {"router": float(tokens * router), "experts": float(tokens * 2 * D * active_neurons)}
    raise TypeError(f"no MAC count for slot {type(slot_cfg).__name__}")


def model_macs(model, seq_len=None, active_neurons: dict[int, float] | None = None) -> dict:
    """MACs per example: ``total``, ``attention``, ``ffn`` (router + experts), ``other``
    (patch embedding, head) and ``per_layer`` FFN MACs. ``seq_len``: tokens per example (a
    ViT's is fixed: ``1 + n_patches``); for a text model every example's real length (the
    mean example's MACs: attention's ``T^2`` averaged as such), or one length for all."""
    holder = ffn_holder(model)
    cfg = holder.cfg
    D = cfg.d_model
    other = 0.0
    if hasattr(cfg, "n_patches"):
        T = 1 + cfg.n_patches
        T2 = T * T
        other += cfg.n_patches * cfg.patch_size ** 2 * cfg.n_channels * D + D * cfg.n_classes
    else:
        if seq_len is None:
            raise ValueError("model_macs of a text model needs seq_len (each example's real "
                             "tokens)")
        lens = np.asarray(seq_len, np.float64).reshape(-1)
        if lens.size == 0 or np.any(lens < 0):
            raise ValueError(f"model_macs: seq_len needs example lengths >= 0, got {seq_len!r}")
        T, T2 = float(lens.mean()), float((lens * lens).mean())
        head = getattr(model, "w_cls", None)  # SequenceClassifier's head
        if head is not None:
            other += float(np.prod(head[...].shape))
    active_neurons = active_neurons or {}
    per_layer = [ffn_macs(s, D, T, active_neurons.get(i)) for i, s in enumerate(cfg.ffn_slots)]
    attn = cfg.n_layers * (4 * T * D * D + 2 * T2 * D)
    ffn = sum(p["router"] + p["experts"] for p in per_layer)
    return {"total": attn + ffn + other, "attention": attn, "ffn": ffn, "other": other,
            "per_layer": per_layer}


def param_counts(model) -> dict:
    """``{"params": trainable weights + router vectors, "mask_entries": expert-mask size}``."""
    def n(filt):
        return int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, filt))))
    return {"params": n(nnx.Param) + n(RouterWeights), "mask_entries": n(ExpertMask)}


def param_breakdown(dense_model, plans: dict) -> list[dict]:
    """Where extraction's parameter savings come from: one row per FFN layer of the dense model
    (``ffn_width``, ``kept_neurons`` by the union of the plan's experts, the FFN's parameters
    and the net parameters removed, router vectors added back), then the removed share of
    three totals: the whole model (what the MoEE paper's Table 1 counts), the model without
    its embeddings (every parameter under a name containing ``embed``), and the FFNs."""
    holder = ffn_holder(dense_model)
    rows, removed, ffn_total = [], 0, 0
    for i, block in enumerate(holder.blocks):
        w_up = block.ffn.w_up[...]
        D, F = w_up.shape
        bias = int(getattr(block.ffn, "b_up", None) is not None)
        plan = plans.get(i)
        kept = F if plan is None else int(len(kept_neurons(plan.masks_EF)))
        router = 0 if plan is None else int(plan.router_ED.size + plan.router_bias_E.size)
        ffn_params = F * (2 * D + bias) + bias * D
        gone = (F - kept) * (2 * D + bias) - router
        rows.append({"layer": i, "ffn_width": F, "kept_neurons": kept,
                     "kept_%": 100.0 * kept / F, "ffn_params": ffn_params,
                     "params_removed": gone})
        removed, ffn_total = removed + gone, ffn_total + ffn_params
    whole = param_counts(dense_model)["params"]
    embed = sum(int(np.size(v)) for path, v in nnx.to_flat_state(nnx.state(dense_model, nnx.Param))
                if any("embed" in str(k) for k in path))
    for name, total in (("whole model", whole), ("without embeddings", whole - embed),
                        ("FFNs only", ffn_total)):
        rows.append({"layer": name, "total_params": total, "params_removed": removed,
                     "removed_%": 100.0 * removed / total})
    return rows
