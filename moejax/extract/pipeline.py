"""The expert-extraction recipe end to end, on any model
:mod:`moejax.extract.layer_surgery` handles.

    records = record_ffn(model, batches, n_tokens=cfg.n_tokens, seed=seed)   # step 1 data
    labels  = cluster_layers(records, cfg.cluster, seed=seed)                 # step 1
    plans   = moee_plans(records, labels, cfg, seed=seed)                     # step 2
    moee    = extract_model(model, plans, router=cfg.router)                  # step 3
    stats   = routing_stats(moee, eval_batches)                              # loads, MACs

MoEfication at matched MACs: :func:`moefication_model` partitions the same layers into
``n_experts`` equal experts and gives each layer the ``top_k`` that makes its mean active
neurons closest to the MoEE layer's (:func:`matched_top_k`); ``router="mlp"`` trains its
MLP router (:func:`train_mlp_router`) through the training loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moejax.config import Config, config
from moejax.data.batches import ArrayBatches
from moejax.extract.cluster import ClusterConfig, cluster_activations
from moejax.extract.layer_surgery import (
    apply_model,
    check_layers,
    extract_model,
    ffn_holder,
    slot_layers,
)
from moejax.extract.plan import ExpertPlan, Selection, kept_neurons, moee_plan, moefication_plan
from moejax.extras import late_progress
from moejax.nn import axes as ax
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train

__all__ = ["ExtractConfig", "cluster_layers", "moee_plans", "routing_stats", "matched_top_k",
           "router_targets", "router_bce", "router_train_config",
           "moefication_model", "train_mlp_router", "MLPRouterNet", "expert_summary"]


@config
class ExtractConfig(Config):
    """n_tokens: recorded token sample; cluster: clustering of each layer's activations;
    p: share of the cluster's variance the kept neurons cover; selection / router: the paper's
    choices (variance selection, cosine routing to the cluster input means) or the ablations
    (``router="random"``: every token to a random expert, Table 2)."""

    n_tokens: int = 20000
    cluster: ClusterConfig = ClusterConfig()
    p: float = 0.8
    selection: Selection = "variance"
    router: Literal["cosine", "euclidean", "random"] = "cosine"

    def validate(self) -> None:
        self._require(self.n_tokens >= 10, f"n_tokens={self.n_tokens} must be >= 10")
        self._require(0 < self.p <= 1, f"p={self.p} must be in (0, 1]")


def layer_seed(seed: int, layer: int) -> int:
    """Layer ``layer``'s seed of a run seeded ``seed``: ``seed * 1000 + layer`` modulo 2**32
    (scikit-learn's k-means takes seeds below 2**32 only)."""
    return (seed * 1000 + layer) % 2**32


def cluster_layers(records: dict, cfg: ClusterConfig, *, seed: int = 0,
                   n_clusters: dict[int, int] | None = None) -> dict[int, np.ndarray]:
    """Cluster labels per layer; ``n_clusters`` (per layer) overrides ``cfg.n_clusters`` for the
    methods that need a count (a layer with count 0 gets no cluster)."""
    out = {}
    for i, (_, y) in late_progress(sorted(records.items()), desc=f"clustering ({cfg.method})",
                                   unit="layer"):
        k = cfg.n_clusters if n_clusters is None else n_clusters.get(i, 0)
        if cfg.method in ("kmeans", "birch", "random") and k == 0:
            out[i] = np.full(y.shape[0], -1)
            continue
        out[i] = cluster_activations(y, cfg.replace(n_clusters=max(k, 1)),
                                     seed=layer_seed(seed, i))
    return out


def moee_plans(records: dict, labels: dict, cfg: ExtractConfig, *,
               seed: int = 0) -> dict[int, ExpertPlan | None]:
    """MoEE plan of every recorded layer (``None``: no cluster, the layer stays dense)."""
    return {i: moee_plan(x, y, labels[i], p=cfg.p, selection=cfg.selection,
                         seed=layer_seed(seed, i))
            for i, (x, y) in sorted(records.items())}


def routing_stats(model, batches: Iterable[dict], n_classes: int = 0) -> dict[int, dict]:
    """Per extracted layer: ``active_neurons`` (mean per real token of the neurons its experts
    use, their union when it has several: the slot's own count), ``load [E]`` (share of the
    first-choice assignments) and, with labels in the batches and ``n_classes``,
    ``per_class [L, E]`` (share of each class's tokens routed to each expert, first choice)."""
    layers = slot_layers(model)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, batch):
        _, aux = apply_model(nnx.merge(graphdef, state), batch)
        return {i: aux["layers"][i]["expert_ids"] for i in layers}

    holder = ffn_holder(model)
    acc = {i: {"active": 0.0, "tokens": 0.0,
               "counts": np.zeros(holder.blocks[i].ffn.cfg.n_experts),
               "per_class": np.zeros((max(n_classes, 1), holder.blocks[i].ffn.cfg.n_experts))}
           for i in layers}
    masks = {i: np.asarray(holder.blocks[i].ffn.masks[...]) > 0 for i in layers}
    for batch in batches:
        ids = fwd(state, {k: jnp.asarray(v) for k, v in batch.items()})
        for i in layers:
            ids_BTK = np.asarray(ids[i])
            first = ids_BTK[..., 0]
            real = (np.ones(first.shape, bool) if "mask" not in batch
                    else np.asarray(batch["mask"]) > 0)
            a = acc[i]
            a["counts"] += np.bincount(first[real], minlength=len(a["counts"]))
            a["tokens"] += real.sum()
            # the union of each real token's experts' neurons (an expert alone: its size)
            a["active"] += int(masks[i][ids_BTK[real]].any(axis=1).sum())
            if n_classes and "labels" in batch:
                lab = np.broadcast_to(np.asarray(batch["labels"])[:, None], first.shape)
                np.add.at(a["per_class"], (lab[real], first[real]), 1.0)
    out = {}
    for i, a in acc.items():
        active = a["active"] / max(a["tokens"], 1)
        pc = a["per_class"] / np.maximum(a["per_class"].sum(1, keepdims=True), 1)
        out[i] = {"active_neurons": float(active), "load": a["counts"] / max(a["tokens"], 1),
                  "per_class": pc}
    return out


def matched_top_k(active_neurons: dict[int, float], expert_size: dict[int, int],
                  n_experts: int) -> dict[int, int]:
    """Per layer, the ``top_k`` of equal experts of ``expert_size`` neurons whose active
    neurons are closest to ``active_neurons`` (at least 1)."""
    return {i: int(np.clip(round(a / expert_size[i]), 1, n_experts))
            for i, a in active_neurons.items()}


class MLPRouterNet(nnx.Module):
    """MoEfication's MLP router (Zhang et al. 2022, Sec. 3.2, as in the authors' code):
    ``tanh(x_hat W1) W2`` on the L2-normalised input ``x_hat``, no biases; ``W1 [D, E]``
    starts at the parameter centres, ``W2 [E, E]`` at the identity."""

    def __init__(self, centres_ED: np.ndarray):
        E = centres_ED.shape[0]
        self.w1 = ax.param(jnp.asarray(centres_ED, jnp.float32).T, ax.EMBED, ax.SCORES)
        self.w2 = ax.param(jnp.eye(E, dtype=jnp.float32), ax.SCORES, ax.SCORES)

    def __call__(self, x_ND):
        x = x_ND / jnp.maximum(jnp.linalg.norm(x_ND, axis=-1, keepdims=True), 1e-12)
        return jnp.tanh(x @ self.w1[...]) @ self.w2[...]

    def weights(self) -> dict:
        return {"w1": np.asarray(self.w1[...]), "w2": np.asarray(self.w2[...])}


def router_targets(y_NF: np.ndarray, masks_EF: np.ndarray) -> np.ndarray:
    """``[N, E]``: each expert's positive activation mass ``sum_{f in c} relu(y_f)`` (the
    MLP router's target before the per-batch scaling of :func:`router_bce`)."""
    return np.maximum(np.asarray(y_NF, np.float32), 0) @ masks_EF.T.astype(np.float32)


def router_bce(logits_NE, mass_NE):
    """Binary cross-entropy with logits against ``mass / max(mass)`` (the max over the whole
    batch, as the authors' code scales its targets)."""
    t = mass_NE / jnp.maximum(jnp.max(mass_NE), 1e-12)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits_NE, t))


def _router_loss(net, batch, key=None, train=True):
    s = net(batch["inputs"])
    loss = router_bce(s, batch["targets"])
    top = jnp.mean(jnp.argmax(s, -1) == jnp.argmax(batch["targets"], -1))
    return loss, {"bce": loss, "top1_agreement": top}


def router_train_config(n_tokens: int, epochs: int = 30, batch_size: int = 512) -> TrainConfig:
    """The authors' MLP-router training: Adam, learning rate 0.01, batches of 512, 30 epochs."""
    steps = max(1, -(-epochs * n_tokens // batch_size))
    return TrainConfig(steps=steps, batch_size=batch_size, lr=1e-2, optimizer="adam",
                       weight_decay=0.0, schedule="constant", warmup_steps=0,
                       log_every=max(1, steps // 4))


def train_mlp_router(x_ND: np.ndarray, y_NF: np.ndarray, plan: ExpertPlan, *,
                     train_cfg: TrainConfig | None = None, seed: int = 0) -> dict:
    """Train :class:`MLPRouterNet` (initialised from ``plan``'s parameter centres) to predict
    each expert's activation mass (:func:`router_targets`) with :func:`router_bce`. Returns
    ``{w1, w2}`` for :func:`extract_model`."""
    train_cfg = train_cfg or router_train_config(len(x_ND))
    net = MLPRouterNet(plan.router_ED)
    src = ArrayBatches({"inputs": np.asarray(x_ND, np.float32),
                        "targets": router_targets(y_NF, plan.masks_EF)},
                       batch_size=train_cfg.batch_size, seed=seed)
    train(net, src, train_cfg, loss_fn=_router_loss, progress=False, desc="mlp router")
    return net.weights()


def moefication_model(model, records: dict, layers: Iterable[int], *, n_experts: int,
                      top_k: dict[int, int], router: Literal["param", "mlp"] = "param",
                      router_train: TrainConfig | None = None, seed: int = 0):
    """MoEfication of ``layers``: balanced k-means experts routed by their parameter centres
    (``"param"``) or by the trained MLP router, ``top_k[i]`` experts per token. ``records``:
    :func:`record_ffn` output (the MLP router's training data)."""
    holder = ffn_holder(model)
    layers = list(layers)
    check_layers("moefication_model", layers, len(holder.blocks))
    if missing := sorted(set(layers) - set(top_k)):
        raise ValueError(f"moefication_model: no top_k for layers {missing}; give one per layer")
    plans, mlps = {}, {}
    for i in layers:
        plans[i] = moefication_plan(np.asarray(holder.blocks[i].ffn.w_up[...]), n_experts,
                                    seed=layer_seed(seed, i))
        if router == "mlp":
            x, y = records[i]
            mlps[i] = train_mlp_router(x, y, plans[i], train_cfg=router_train,
                                       seed=layer_seed(seed, i))
    return extract_model(model, plans, router=router, top_k=top_k,
                         router_mlps=mlps if router == "mlp" else None), plans


def expert_summary(plans: dict) -> list[dict]:
    """One row per layer: experts, mean / min / max expert size, kept neurons."""

    rows = []
    for i, p in sorted(plans.items()):
        if p is None:
            rows.append({"layer": i, "experts": 0})
            continue
        s = p.sizes_E
        rows.append({"layer": i, "experts": p.n_experts, "size_mean": float(s.mean()),
                     "size_min": int(s.min()), "size_max": int(s.max()),
                     "kept_neurons": int(len(kept_neurons(p.masks_EF))),
                     "of_neurons": int(p.masks_EF.shape[1])})
    return rows



