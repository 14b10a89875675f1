"""Expert plans of one MLP layer: which hidden neurons each expert keeps, and its router.

An :class:`ExpertPlan` is a pure description, independent of any model::

    masks_CF    bool [C, F]   expert c uses hidden neuron f (experts may overlap)
    router_CD   float [C, D]  routing vectors (MoEE: mean input token of each cluster)
    router_bias_C float [C]   added to the routing scores (0 for MoEE)

MoEE (step 2 and 3 of the paper, :func:`moee_plan`): for each cluster ``c`` of the recorded
hidden activations ``y_NF``, the neurons are taken in decreasing within-cluster variance until
their cumulative variance reaches ``p`` of the cluster's total (``selection="magnitude"``: mean
activation instead of variance; ``"random"``: as many neurons as variance selection would
take, drawn at random, Table 2's ablation); the router vector is the mean *input* ``x`` of the
cluster's tokens (``routing="random"``: Gaussian vectors instead, Table 2's random routing).

MoEfication (:func:`moefication_plan`): a balanced k-means partition of the columns of
``W_up`` into ``C`` equal experts (scikit-learn's k-means for the centres, then SciPy's optimal
assignment with each centre repeated ``F / C`` times as the balancing step); similarity router
vectors ``mean_{f in c} W_up[:, f]`` with bias ``mean_{f in c} b_up[f]``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from moejax.extract.cluster import n_clusters_of, relabel

__all__ = ["ExpertPlan", "select_neurons", "cluster_means", "moee_plan", "moefication_plan",
           "balanced_kmeans_partition", "kept_neurons"]


class ExpertPlan(NamedTuple):
    masks_CF: np.ndarray
    router_CD: np.ndarray
    router_bias_C: np.ndarray

    @property
    def n_experts(self) -> int:
        return int(self.masks_CF.shape[0])

    @property
    def sizes_C(self) -> np.ndarray:
        return self.masks_CF.sum(axis=1)


def kept_neurons(masks_CF: np.ndarray) -> np.ndarray:
    """Indices of the hidden neurons at least one expert uses (the others are removed)."""
    return np.flatnonzero(np.any(masks_CF, axis=0))


def _take_until(scores_F: np.ndarray, p: float) -> np.ndarray:
    """Indices of the largest scores, in decreasing order, until their cumulative sum reaches
    ``p`` of the total (at least one)."""
    order = np.argsort(-scores_F, kind="stable")
    total = float(np.sum(scores_F))
    if total <= 0:
        return order[:1]
    csum = np.cumsum(scores_F[order])
    n = int(np.searchsorted(csum, p * total - 1e-12 * total)) + 1
    return order[:min(n, len(order))]


def select_neurons(y_NF: np.ndarray, labels_N: np.ndarray, n_clusters: int, *, p: float = 0.8,
                   selection: Literal["variance", "magnitude", "random"] = "variance",
                   seed: int = 0) -> np.ndarray:
    """``masks_CF``: per cluster, the neurons covering ``p`` of its total within-cluster
    variance (or mean activation magnitude), largest first."""
    if not 0 < p <= 1:
        raise ValueError(f"p={p} must be in (0, 1]")
    y = np.asarray(y_NF, np.float64)
    rng = np.random.default_rng(seed)
    masks = np.zeros((n_clusters, y.shape[1]), bool)
    for c in range(n_clusters):
        yc = y[labels_N == c]
        if yc.shape[0] == 0:
            raise ValueError(f"cluster {c} has no points")
        score = np.abs(yc.mean(0)) if selection == "magnitude" else yc.var(0)
        idx = _take_until(score, p)
        if selection == "random":
            idx = rng.choice(y.shape[1], size=len(idx), replace=False)
        masks[c, idx] = True
    return masks


def cluster_means(x_ND: np.ndarray, labels_N: np.ndarray, n_clusters: int) -> np.ndarray:
    """Mean input ``[C, D]`` of each cluster's tokens."""
    x = np.asarray(x_ND, np.float64)
    return np.stack([x[labels_N == c].mean(0) for c in range(n_clusters)]).astype(np.float32)


def moee_plan(x_ND, y_NF, labels_N, *, p: float = 0.8,
              selection: Literal["variance", "magnitude", "random"] = "variance",
              routing: Literal["means", "random"] = "means", seed: int = 0) -> ExpertPlan | None:
    """The MoEE plan of one layer from its cluster labels; ``None`` when there is no cluster
    (the layer stays dense)."""
    labels_N = relabel(labels_N)  # contiguous ids, no empty cluster
    C = n_clusters_of(labels_N)
    if C == 0:
        return None
    masks = select_neurons(y_NF, labels_N, C, p=p, selection=selection, seed=seed)
    if routing == "random":
        r = np.random.default_rng([seed, 1]).normal(size=(C, np.shape(x_ND)[1]))
        router = r.astype(np.float32)
    else:
        router = cluster_means(x_ND, labels_N, C)
    return ExpertPlan(masks, router, np.zeros((C,), np.float32))


def balanced_kmeans_partition(w_up_DF: np.ndarray, n_experts: int, *, seed: int = 0) -> np.ndarray:
    """``expert_of_F [F]``: equal-size groups of the columns of ``w_up`` (``F % n_experts ==
    0``): k-means centres on the unit-normalised columns, then each column assigned to a
    centre by a minimum-cost assignment in which every centre has ``F / n_experts`` seats."""
    from scipy.optimize import linear_sum_assignment
    from sklearn.cluster import KMeans

    w = np.asarray(w_up_DF, np.float64).T  # [F, D]: one point per neuron
    F = w.shape[0]
    if n_experts < 1 or F % n_experts:
        raise ValueError(f"n_experts={n_experts} must divide the hidden width F={F}")
    w = w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)
    km = KMeans(n_experts, n_init=3, random_state=seed).fit(w)
    cost_FC = ((w[:, None, :] - km.cluster_centers_[None]) ** 2).sum(-1)
    seats = np.repeat(np.arange(n_experts), F // n_experts)
    rows, cols = linear_sum_assignment(cost_FC[:, seats])
    out = np.empty(F, np.int64)
    out[rows] = seats[cols]
    return out


def moefication_plan(w_up_DF, b_up_F, n_experts: int, *, seed: int = 0) -> ExpertPlan:
    """MoEfication's experts (balanced k-means over ``W_up`` columns) and similarity router."""
    w = np.asarray(w_up_DF, np.float32)
    b = np.zeros(w.shape[1], np.float32) if b_up_F is None else np.asarray(b_up_F, np.float32)
    expert_of = balanced_kmeans_partition(w, n_experts, seed=seed)
    masks = np.stack([expert_of == c for c in range(n_experts)])
    router = np.stack([w[:, m].mean(1) for m in masks]).astype(np.float32)
    bias = np.asarray([b[m].mean() for m in masks], np.float32)
    return ExpertPlan(masks, router, bias)
