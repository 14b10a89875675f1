"""The expert-extraction recipe end to end, on any model :mod:`moejax.extract.surgery` handles.

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
from flax import nnx

from moejax.config import Config, config
from moejax.data.batches import ArrayBatches
from moejax.extract.cluster import ClusterConfig, cluster_activations
from moejax.extract.plan import ExpertPlan, kept_neurons, moee_plan, moefication_plan
from moejax.extract.surgery import apply_model, extract_model, ffn_holder, slot_layers
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train

__all__ = ["ExtractConfig", "cluster_layers", "moee_plans", "routing_stats", "matched_top_k",
           "moefication_model", "train_mlp_router", "MLPRouterNet", "expert_summary"]


@config
class ExtractConfig(Config):
    """n_tokens: recorded token sample; cluster: clustering of each layer's activations;
    p: share of the cluster's variance the kept neurons cover; selection / routing / router:
    the paper's choices (variance, cluster input means, cosine) or the ablations."""

    n_tokens: int = 20000
    cluster: ClusterConfig = ClusterConfig()
    p: float = 0.8
    selection: Literal["variance", "magnitude", "random"] = "variance"
    routing: Literal["means", "random"] = "means"
    router: Literal["cosine", "euclidean"] = "cosine"

    def validate(self) -> None:
        self._require(self.n_tokens >= 10, f"n_tokens={self.n_tokens} must be >= 10")
        self._require(0 < self.p <= 1, f"p={self.p} must be in (0, 1]")


def cluster_layers(records: dict, cfg: ClusterConfig, *, seed: int = 0,
                   n_clusters: dict[int, int] | None = None) -> dict[int, np.ndarray]:
    """Cluster labels per layer; ``n_clusters`` (per layer) overrides ``cfg.n_clusters`` for the
    methods that need a count (a layer with count 0 gets no cluster)."""
    out = {}
    for i, (_, y) in sorted(records.items()):
        k = cfg.n_clusters if n_clusters is None else n_clusters.get(i, 0)
        if cfg.method in ("kmeans", "birch", "random") and k == 0:
            out[i] = np.full(y.shape[0], -1)
            continue
        out[i] = cluster_activations(y, cfg.replace(n_clusters=max(k, 1)),
                                     seed=seed * 1000 + i)
    return out


def moee_plans(records: dict, labels: dict, cfg: ExtractConfig, *,
               seed: int = 0) -> dict[int, ExpertPlan | None]:
    """MoEE plan of every recorded layer (``None``: no cluster, the layer stays dense)."""
    return {i: moee_plan(x, y, labels[i], p=cfg.p, selection=cfg.selection,
                         routing=cfg.routing, seed=seed * 1000 + i)
            for i, (x, y) in sorted(records.items())}


def routing_stats(model, batches: Iterable[dict], n_classes: int = 0) -> dict[int, dict]:
    """Per extracted layer: ``active_neurons`` (mean per real token), ``load [C]`` (share of
    assignments) and, with labels in the batches and ``n_classes``, ``per_class [L, C]``
    (share of each class's tokens routed to each expert, first choice)."""
    layers = slot_layers(model)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, batch):
        _, aux = apply_model(nnx.merge(graphdef, state), batch)
        return {i: aux["layers"][i]["expert_ids"][..., 0] for i in layers}

    holder = ffn_holder(model)
    acc = {i: {"active": 0.0, "tokens": 0.0,
               "counts": np.zeros(holder.blocks[i].ffn.cfg.n_experts),
               "per_class": np.zeros((max(n_classes, 1), holder.blocks[i].ffn.cfg.n_experts))}
           for i in layers}
    masks = {i: np.asarray(holder.blocks[i].ffn.masks[...]) for i in layers}
    ks = {i: holder.blocks[i].ffn.cfg.top_k for i in layers}
    for batch in batches:
        ids = fwd(state, {k: jnp.asarray(v) for k, v in batch.items()})
        for i in layers:
            first = np.asarray(ids[i])
            real = (np.ones(first.shape, bool) if "mask" not in batch
                    else np.asarray(batch["mask"]) > 0)
            a = acc[i]
            a["counts"] += np.bincount(first[real], minlength=len(a["counts"]))
            a["tokens"] += real.sum()
            if ks[i] == 1:
                a["active"] += masks[i].sum(1)[first[real]].sum()
            if n_classes and "labels" in batch:
                lab = np.broadcast_to(np.asarray(batch["labels"])[:, None], first.shape)
                np.add.at(a["per_class"], (lab[real], first[real]), 1.0)
    out = {}
    for i, a in acc.items():
        if ks[i] == 1:
            active = a["active"] / max(a["tokens"], 1)
        else:  # disjoint equal experts (MoEfication): k experts of the layer's expert size
            active = ks[i] * masks[i].sum(1).mean()
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
    """MoEfication's MLP router ``relu(x W1 + b1) W2 + b2``: scores of the ``C`` experts."""

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, *, rngs: nnx.Rngs):
        n = lambda i, o: jax.random.normal(rngs.params(), (i, o)) * i ** -0.5  # noqa: E731
        self.w1, self.b1 = nnx.Param(n(d_model, d_hidden)), nnx.Param(jnp.zeros(d_hidden))
        self.w2, self.b2 = nnx.Param(n(d_hidden, n_experts)), nnx.Param(jnp.zeros(n_experts))

    def __call__(self, x_ND):
        return jax.nn.relu(x_ND @ self.w1[...] + self.b1[...]) @ self.w2[...] + self.b2[...]

    def weights(self) -> dict:
        return {k: np.asarray(getattr(self, k)[...]) for k in ("w1", "b1", "w2", "b2")}


def _router_loss(net, batch, key=None, train=True):
    logp = jax.nn.log_softmax(net(batch["inputs"]), -1)
    ce = -jnp.mean(jnp.sum(batch["targets"] * logp, -1))
    top = jnp.mean(jnp.argmax(logp, -1) == jnp.argmax(batch["targets"], -1))
    return ce, {"ce": ce, "top1_agreement": top}


def train_mlp_router(x_ND: np.ndarray, y_NF: np.ndarray, masks_CF: np.ndarray, *,
                     d_hidden: int, train_cfg: TrainConfig, seed: int = 0) -> dict:
    """Train :class:`MLPRouterNet` to predict which experts hold a token's activation mass:
    target ``t_c = sum_{f in c} relu(y_f)``, normalised to a distribution, cross-entropy.
    Returns the router weights ``{w1, b1, w2, b2}`` for :func:`extract_model`."""

    t = np.maximum(np.asarray(y_NF, np.float32), 0) @ masks_CF.T.astype(np.float32)
    t = t / np.maximum(t.sum(1, keepdims=True), 1e-9)
    net = MLPRouterNet(x_ND.shape[1], d_hidden, masks_CF.shape[0], rngs=nnx.Rngs(seed))
    src = ArrayBatches({"inputs": np.asarray(x_ND, np.float32), "targets": t},
                       batch_size=train_cfg.batch_size, seed=seed)
    train(net, src, train_cfg, loss_fn=_router_loss, progress=False, desc="mlp router")
    return net.weights()


def moefication_model(model, records: dict, layers: Iterable[int], *, n_experts: int,
                      top_k: dict[int, int], router: Literal["dot", "mlp"] = "dot",
                      router_train: TrainConfig | None = None, d_router: int = 0,
                      seed: int = 0):
    """MoEfication of ``layers``: balanced k-means experts, similarity (``"dot"``) or trained
    MLP router, ``top_k[i]`` experts per token. ``records``: :func:`record_ffn` output (the MLP
    router's training data)."""
    holder = ffn_holder(model)
    plans, mlps = {}, {}
    for i in layers:
        ffn = holder.blocks[i].ffn
        b = ffn.b_up[...] if ffn.cfg.use_bias else None
        plans[i] = moefication_plan(np.asarray(ffn.w_up[...]), None if b is None else
                                    np.asarray(b), n_experts, seed=seed * 1000 + i)
        if router == "mlp":
            x, y = records[i]
            mlps[i] = train_mlp_router(x, y, plans[i].masks_CF, d_hidden=d_router,
                                       train_cfg=router_train or TrainConfig(
                                           steps=300, batch_size=256, lr=3e-3,
                                           weight_decay=0.0, log_every=100),
                                       seed=seed * 1000 + i)
    return extract_model(model, plans, router=router, top_k=top_k,
                         router_mlps=mlps if router == "mlp" else None), plans


def expert_summary(plans: dict) -> list[dict]:
    """One row per layer: experts, mean / min / max expert size, kept neurons."""

    rows = []
    for i, p in sorted(plans.items()):
        if p is None:
            rows.append({"layer": i, "experts": 0})
            continue
        s = p.sizes_C
        rows.append({"layer": i, "experts": p.n_experts, "size_mean": float(s.mean()),
                     "size_min": int(s.min()), "size_max": int(s.max()),
                     "kept_neurons": int(len(kept_neurons(p.masks_CF))),
                     "of_neurons": int(p.masks_CF.shape[1])})
    return rows



