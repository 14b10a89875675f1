"""Layer surgery for expert extraction: record a model's MLP activations, and replace dense FFN
slots by extracted-experts slots (:mod:`moejax.nn.extracted`) following per-layer
:class:`~moejax.extract.plan.ExpertPlan` s.

Works on every model whose blocks hold their FFN at ``blocks[i].ffn`` with the slot configs in
``cfg.ffn_slots``: :class:`~moejax.nn.encoder.ViT`, :class:`~moejax.nn.decoder.DecoderLM`
(the holder is the model) and :class:`~moejax.nn.encoder.SequenceClassifier` (its
``encoder``). The new model is a copy (every array copied); the source is never edited.

Models are called as the classifier loss calls them: ``model(batch["inputs"][, mask_BT])``.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import is_integer
from moejax.extract.plan import ExpertPlan, kept_neurons
from moejax.nn.extracted import ExtractedFFN, ExtractedFFNConfig
from moejax.nn.ffn import DenseFFN, DenseFFNConfig
from moejax.nn.surgery import build_from_pure

__all__ = ["ffn_holder", "dense_ffn_layers", "record_ffn", "extract_model", "copy_model",
           "slot_layers", "apply_model", "extracted_ffn_variables", "compact_ffn_variables",
           "compact_model", "shared_neurons"]


def ffn_holder(model) -> nnx.Module:
    """The module that holds ``blocks`` and ``cfg.ffn_slots``."""
    for m in (model, getattr(model, "encoder", None)):
        if m is not None and hasattr(m, "blocks") and hasattr(getattr(m, "cfg", None),
                                                               "ffn_slots"):
            return m
    raise TypeError(f"{type(model).__name__} has no blocks with cfg.ffn_slots; expert "
                    "extraction supports ViT, SequenceClassifier and DecoderLM")


def dense_ffn_layers(model) -> list[int]:
    """Indices of the blocks whose FFN is a :class:`DenseFFN`."""
    return [i for i, b in enumerate(ffn_holder(model).blocks) if isinstance(b.ffn, DenseFFN)]


def slot_layers(model, kind=ExtractedFFN) -> list[int]:
    """Indices of the blocks whose FFN is a ``kind`` module."""
    return [i for i, b in enumerate(ffn_holder(model).blocks) if isinstance(b.ffn, kind)]


def copy_model(model):
    """An independent copy (new Variables and new buffers)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.array(a, copy=True), state))


def apply_model(model, batch: dict):
    """``model(batch["inputs"][, mask_BT=batch["mask"] > 0])`` -> ``(logits, aux)``."""
    kw = {"mask_BT": jnp.asarray(batch["mask"]) > 0} if "mask" in batch else {}
    return model(jnp.asarray(batch["inputs"]), **kw)


class _Recorder(nnx.Module):
    """Wraps a DenseFFN; returns its output and, in ``aux``, its input and hidden activations."""

    def __init__(self, inner: DenseFFN):
        self.inner = inner

    def __call__(self, x_BTD, *, train=False, key=None, mask_BT=None, segment_ids_BT=None):
        y, _ = self.inner(x_BTD)
        return y, {"ffn_x": x_BTD, "ffn_h": self.inner.hidden(x_BTD)}


def check_layers(who: str, layers: list, n_layers: int) -> None:
    """Refuse a layer index that is not one of the model's ``0..n_layers-1``, or one given
    twice (``-1`` would reach the last layer by Python's indexing in one place and fail, or
    seed something with -1, in another)."""
    bad = [i for i in layers if not is_integer(i) or not 0 <= i < n_layers]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"{who}: layers {layers}; give distinct layers of the model's "
                         f"0..{n_layers - 1}")


def record_ffn(model, batches: Iterable[dict], *, n_tokens: int, seed: int = 0,
               layers: Iterable[int] | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{layer: (x_ND, y_NF)}``: FFN inputs and hidden activations of ``n_tokens`` tokens drawn
    uniformly without replacement (``seed``) from the real (unmasked) tokens of ``batches``;
    the same tokens for every layer. Fails if the batches hold fewer real tokens."""
    rec = copy_model(model)
    holder = ffn_holder(rec)
    layers = dense_ffn_layers(rec) if layers is None else list(layers)
    check_layers("record_ffn", layers, len(holder.blocks))
    for i in layers:
        if not isinstance(holder.blocks[i].ffn, DenseFFN):
            raise ValueError(f"layer {i} is not a DenseFFN; record before extraction")
        holder.blocks[i].ffn = _Recorder(holder.blocks[i].ffn)
    graphdef, state = nnx.split(rec)

    @jax.jit
    def fwd(state, batch):
        _, aux = apply_model(nnx.merge(graphdef, state), batch)
        return {i: (aux["layers"][i]["ffn_x"], aux["layers"][i]["ffn_h"]) for i in layers}

    xs = {i: [] for i in layers}
    hs = {i: [] for i in layers}
    for batch in batches:
        out = fwd(state, {k: jnp.asarray(v) for k, v in batch.items()})
        real = (np.ones(np.shape(batch["inputs"])[:1] + out[layers[0]][0].shape[1:2], bool)
                if "mask" not in batch else np.asarray(batch["mask"]) > 0)
        for i in layers:
            xs[i].append(np.asarray(out[i][0])[real])
            hs[i].append(np.asarray(out[i][1])[real])
    total = sum(len(a) for a in xs[layers[0]])
    if total < n_tokens:
        raise ValueError(f"record_ffn: the batches hold {total} real tokens, fewer than "
                         f"n_tokens={n_tokens}; pass more batches or lower n_tokens")
    pick = np.sort(np.random.default_rng(seed).choice(total, n_tokens, replace=False))
    return {i: (np.concatenate(xs[i])[pick], np.concatenate(hs[i])[pick]) for i in layers}


def _neurons(ffn: dict, masks_EF: np.ndarray, idx: np.ndarray, use_bias: bool) -> dict:
    """The FFN's neurons ``idx`` (``w_up``, ``w_down``, ``b_up``) and the experts' masks over
    them."""
    out = {"w_up": ffn["w_up"][:, idx], "w_down": ffn["w_down"][idx],
           "masks": jnp.asarray(np.asarray(masks_EF)[:, idx], jnp.float32)}
    if use_bias:
        out["b_up"] = ffn["b_up"][idx]
    return out


def extracted_ffn_variables(ffn: dict, plan: ExpertPlan, *, use_bias: bool, router: str,
                            router_mlp: dict | None = None) -> dict:
    """Pure: a dense FFN's variable dict (``w_up [D, F]``, ``w_down [F, D]``, biases) and a plan
    -> the :class:`ExtractedFFN` variable dict (neurons no expert uses removed)."""
    out = _neurons(ffn, plan.masks_EF, kept_neurons(plan.masks_EF), use_bias)
    if use_bias:
        out["b_down"] = ffn["b_down"]
    if router == "mlp":
        if router_mlp is None:
            raise ValueError("router='mlp' needs router_mlp weights (w1, w2)")
        out.update({f"router_{k}": jnp.asarray(router_mlp[k], jnp.float32)
                    for k in ("w1", "w2")})
    else:
        out["router"] = jnp.asarray(plan.router_ED, jnp.float32)
        out["router_bias"] = jnp.asarray(plan.router_bias_E, jnp.float32)
    return out


def shared_neurons(masks_EF: np.ndarray, load_E: np.ndarray, grouped_cost: float = 2.0
                   ) -> np.ndarray:
    """bool ``[F]``: the neurons a compact layout computes for every token in one masked dense
    product instead of per expert: the neurons of the ``k`` most used experts (``load_E``:
    each expert's share of the tokens), ``k`` in ``0..E`` minimising the cost per token
    ``|S| + grouped_cost * sum_c load_c |M_c minus S|`` (MACs, a routed MAC costing
    ``grouped_cost`` dense ones). ``k = 0`` is the plain compact layout, ``k = E`` the
    masked one; with one dominant expert, its neurons."""
    masks = np.asarray(masks_EF) > 0
    load = np.asarray(load_E, np.float64)
    if load.shape != masks.shape[:1] or grouped_cost < 1:
        raise ValueError(f"load_E {load.shape} must be [E={masks.shape[0]}] and grouped_cost="
                         f"{grouped_cost} >= 1")
    best, best_cost = np.zeros(masks.shape[1], bool), np.inf
    shared = np.zeros(masks.shape[1], bool)
    for c in [None, *np.argsort(-load, kind="stable")]:
        if c is not None:
            shared = shared | masks[c]
        cost = shared.sum() + grouped_cost * float(load @ (masks & ~shared).sum(1))
        if cost < best_cost - 1e-9:
            best, best_cost = shared.copy(), cost
    return best


def compact_ffn_variables(ffn: dict, *, top_k: int, use_bias: bool,
                          shared: np.ndarray | None = None, where: str = "") -> dict:
    """Pure: a masked :class:`ExtractedFFN` variable dict -> the compact layout's. The
    ``shared`` neurons (bool ``[F]``; default none) stay in dense weights with their expert
    masks; each expert's other neurons are made contiguous, zero-padded to the largest
    expert, the up bias folded in as an extra input row, with a matching zero output column.
    Refuses experts whose routed neurons overlap with ``top_k > 1`` (not exact)."""
    masks = np.asarray(ffn["masks"]) > 0
    E, F = masks.shape
    shared = np.zeros(F, bool) if shared is None else np.asarray(shared, bool)
    if shared.shape != (F,):
        raise ValueError(f"{where}shared must be bool [{F}], got {shared.shape}")
    routed = masks & ~shared
    if top_k > 1 and np.any(routed.sum(0) > 1):
        raise ValueError(f"{where}compact layout with top_k={top_k}: experts share routed "
                         "neurons, so a token's experts would count them twice; use top_k=1, "
                         "disjoint experts, or share the common neurons")
    sizes = routed.sum(1)
    Fe = int(sizes.max())
    idx_EF = np.full((E, Fe), F)  # F: an appended zero neuron
    for c in range(E):
        idx_EF[c, :sizes[c]] = np.flatnonzero(routed[c])
    pad = lambda a, axis: jnp.concatenate(  # noqa: E731
        [a, jnp.zeros_like(jnp.take(a, jnp.arange(1), axis=axis))], axis=axis)
    w_up_EDF = jnp.transpose(pad(ffn["w_up"], 1)[:, idx_EF], (1, 0, 2))
    out = {"w_down": pad(ffn["w_down"], 0)[idx_EF], "sizes": jnp.asarray(sizes, jnp.float32)}
    if use_bias:  # input row D carries the up bias; output column D is a zero (dropped)
        w_up_EDF = jnp.concatenate([w_up_EDF, pad(ffn["b_up"], 0)[idx_EF][:, None, :]], 1)
        out["w_down"] = pad(out["w_down"], 2)
        out["b_down"] = ffn["b_down"]
    out["w_up"] = w_up_EDF
    if shared.any():
        names = {"masks": "shared_masks"}
        out.update({names.get(k, f"{k}_shared"): v for k, v in _neurons(
            ffn, masks, np.flatnonzero(shared), use_bias).items()})
    out.update({k: v for k, v in ffn.items() if k.startswith("router")})
    return out


def compact_model(model, dispatch: str = "auto", layers: Iterable[int] | None = None,
                  loads: dict[int, np.ndarray] | None = None, grouped_cost: float = 2.0):
    """A copy of ``model`` whose :class:`ExtractedFFN` slots (those in ``layers``; default
    all) use the compact layout (serving: a token computes only its experts' neurons; same
    outputs as the masked layout). With ``loads`` (layer -> each expert's share of the
    tokens, e.g. ``routing_stats``' ``load``), each layer computes the
    :func:`shared_neurons` (``grouped_cost``) for every token in one dense product."""
    holder = ffn_holder(model)
    pure = nnx.to_pure_dict(nnx.state(model))
    blocks = pure["blocks"] if holder is model else pure["encoder"]["blocks"]
    slots = list(holder.cfg.ffn_slots)
    extracted = slot_layers(model)
    layers = extracted if layers is None else sorted(layers)
    bad = [i for i in layers if i not in extracted]
    if bad:
        raise ValueError(f"layers {bad} are not extracted FFN slots (extracted: {extracted})")
    missing = [] if loads is None else [i for i in layers if i not in loads]
    if missing:
        raise ValueError(f"loads has no entry for layers {missing}; pass routing_stats' load "
                         "for every compacted layer")
    for i in layers:
        cfg = slots[i]
        if cfg.layout == "compact":
            continue
        ffn = blocks[i]["ffn"]
        shared = None if loads is None else shared_neurons(ffn["masks"], loads[i], grouped_cost)
        blocks[i]["ffn"] = compact_ffn_variables(ffn, top_k=cfg.top_k, use_bias=cfg.use_bias,
                                                 shared=shared, where=f"layer {i}: ")
        slots[i] = cfg.replace(layout="compact", dispatch=dispatch,
                               d_expert=int(blocks[i]["ffn"]["w_down"].shape[1]),
                               d_shared=0 if shared is None else int(shared.sum()))
    return _rebuild(model, holder, holder.cfg.replace(ffn_slots=tuple(slots)), pure)


def _rebuild(model, holder, cfg, pure):
    """``model``'s class built with the new slot configs and filled from ``pure``."""
    if holder is model:
        make = lambda: type(model)(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    else:  # SequenceClassifier(encoder_cfg, n_classes)
        make = lambda: type(model)(cfg, int(model.b_cls.shape[0]), rngs=nnx.Rngs(0))  # noqa: E731
    return build_from_pure(make, pure)


def extract_model(model, plans: dict[int, ExpertPlan | None], *, router: str = "cosine",
                  top_k: int | dict[int, int] = 1, router_mlps: dict[int, dict] | None = None):
    """A new model in which every layer ``i`` with ``plans[i]`` not ``None`` has an
    :class:`ExtractedFFN` made from its dense FFN and the plan; other layers stay dense.
    ``top_k``: one value or one per layer. Built by :func:`build_from_pure` from the pure
    variable dict and the matching config; ``model`` is unchanged."""
    holder = ffn_holder(model)
    pure = nnx.to_pure_dict(nnx.state(model))
    blocks = pure["blocks"] if holder is model else pure["encoder"]["blocks"]
    slots = list(holder.cfg.ffn_slots)
    check_layers("extract_model", list(plans), len(slots))
    for i, plan in sorted(plans.items()):
        if plan is None:
            continue
        dense = slots[i]
        if not isinstance(dense, DenseFFNConfig):
            raise ValueError(f"layer {i} is {type(dense).__name__}, not a dense FFN")
        if plan.masks_EF.shape[1] != dense.d_hidden:
            raise ValueError(f"layer {i}: plan has {plan.masks_EF.shape[1]} neurons, the FFN "
                             f"{dense.d_hidden}")
        mlp = None if router_mlps is None else router_mlps.get(i)
        slots[i] = ExtractedFFNConfig(
            d_hidden=int(len(kept_neurons(plan.masks_EF))), n_experts=plan.n_experts,
            top_k=top_k[i] if isinstance(top_k, dict) else top_k, activation=dense.activation,
            use_bias=dense.use_bias, router=router,
            d_router=0 if mlp is None else int(np.shape(mlp["w1"])[1]))
        blocks[i]["ffn"] = extracted_ffn_variables(blocks[i]["ffn"], plan,
                                                   use_bias=dense.use_bias, router=router,
                                                   router_mlp=mlp)
    return _rebuild(model, holder, holder.cfg.replace(ffn_slots=tuple(slots)), pure)
