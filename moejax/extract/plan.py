"""Expert plans of one MLP layer: which hidden neurons each expert keeps, and its router.

An :class:`ExpertPlan` is a pure description, independent of any model::

    masks_EF    bool [E, F]   expert c uses hidden neuron f (experts may overlap)
    router_ED   float [E, D]  routing vectors (MoEE: mean input token of each cluster)
    router_bias_E float [E]   added to the routing scores (0 for MoEE)

MoEE (step 2 and 3 of the paper, :func:`moee_plan`): for each cluster ``c`` of the recorded
hidden activations ``y_NF``, the neurons are taken in decreasing within-cluster variance until
their cumulative variance reaches ``p`` of the cluster's total (``selection="magnitude"``: mean
activation instead of variance; ``"random"``: as many neurons as variance selection would
take, drawn at random, Table 2's ablation); the router vector is the mean *input* ``x`` of the
cluster's tokens.

MoEfication (Zhang et al. 2022, Sec. 3.1-3.2; :func:`moefication_plan`): the neurons' input
weight vectors (the columns of ``W_up``) are L2-normalised and split into ``E`` equal experts
by constrained (balanced) k-means, as the authors' code does with ``KMeansConstrained``: k-means++
centres, then alternately the exactly balanced assignment of minimum total squared distance
(a minimum-cost assignment in which each centre has ``F / E`` seats, SciPy's
``linear_sum_assignment``) and the centres' update, until the assignment repeats. The router
vectors are the parameter centres (``ParamCenter``): the mean of each expert's normalised
columns, used by the ``"param"`` router (nearest centre to the normalised input) and as the
initialisation of the MLP router.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from moejax.extract.cluster import n_clusters_of, relabel
from moejax.extras import require

__all__ = ["ExpertPlan", "select_neurons", "cluster_means", "moee_plan", "moefication_plan",
           "balanced_kmeans_partition", "balanced_assignment", "param_centres", "kept_neurons",
           "SELECTIONS"]

Selection = Literal["variance", "magnitude", "random"]
SELECTIONS = ("variance", "magnitude", "random")


class ExpertPlan(NamedTuple):
    masks_EF: np.ndarray
    router_ED: np.ndarray
    router_bias_E: np.ndarray

    @property
    def n_experts(self) -> int:
        return int(self.masks_EF.shape[0])

    @property
    def sizes_E(self) -> np.ndarray:
        return self.masks_EF.sum(axis=1)


def kept_neurons(masks_EF: np.ndarray) -> np.ndarray:
    """Indices of the hidden neurons at least one expert uses (the others are removed)."""
    return np.flatnonzero(np.any(masks_EF, axis=0))


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
                   selection: Selection = "variance",
                   seed: int = 0) -> np.ndarray:
    """``masks_EF``: per cluster, the neurons covering ``p`` of its total within-cluster
    variance (or mean activation magnitude), largest first."""
    if not 0 < p <= 1:
        raise ValueError(f"p={p} must be in (0, 1]")
    if selection not in SELECTIONS:  # another name would run variance selection, silently
        raise ValueError(f"selection={selection!r}; use one of {SELECTIONS}")
    y = np.asarray(y_NF, np.float64)
    labels_N = np.asarray(labels_N)
    if labels_N.shape != y.shape[:1] or not np.issubdtype(labels_N.dtype, np.integer):
        raise ValueError(f"labels_N of shape {labels_N.shape} and dtype {labels_N.dtype} for "
                         f"activations of shape {y.shape}: give one integer cluster id a row")
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
    """Mean input ``[E, D]`` of each cluster's tokens."""
    x = np.asarray(x_ND, np.float64)
    return np.stack([x[labels_N == c].mean(0) for c in range(n_clusters)]).astype(np.float32)


def moee_plan(x_ND, y_NF, labels_N, *, p: float = 0.8,
              selection: Selection = "variance",
              seed: int = 0) -> ExpertPlan | None:
    """The MoEE plan of one layer from its cluster labels; ``None`` when there is no cluster
    (the layer stays dense)."""
    labels_N = relabel(labels_N)  # contiguous ids, no empty cluster
    E = n_clusters_of(labels_N)
    if E == 0:
        return None
    masks = select_neurons(y_NF, labels_N, E, p=p, selection=selection, seed=seed)
    return ExpertPlan(masks, cluster_means(x_ND, labels_N, E), np.zeros((E,), np.float32))


def _normalise_rows(w: np.ndarray) -> np.ndarray:
    return w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)


def balanced_assignment(points_FD: np.ndarray, centres_ED: np.ndarray) -> np.ndarray:
    """``group_of_F [F]``: the assignment of the points to the centres, each centre taking
    exactly ``F / E`` points, of minimum total squared distance (exact: a minimum-cost
    assignment over ``F / E`` replicas of every centre)."""
    # on use, as in moejax.extract.cluster: SciPy and scikit-learn are the studies extra's
    linear_sum_assignment = require("scipy.optimize", "moejax.extract.plan (balanced "
                                    "assignment)").linear_sum_assignment

    F, E = points_FD.shape[0], centres_ED.shape[0]
    cost_FE = ((points_FD[:, None, :] - centres_ED[None]) ** 2).sum(-1)
    seats = np.repeat(np.arange(E), F // E)
    rows, cols = linear_sum_assignment(cost_FE[:, seats])
    out = np.empty(F, np.int64)
    out[rows] = seats[cols]
    return out


def balanced_kmeans_partition(w_up_DF: np.ndarray, n_experts: int, *, seed: int = 0,
                              max_iter: int = 100) -> np.ndarray:
    """``expert_of_F [F]``: constrained k-means of the L2-normalised columns of ``w_up`` into
    ``n_experts`` groups of exactly ``F / n_experts`` (``F % n_experts == 0``): k-means++
    centres, then :func:`balanced_assignment` and centre updates until the assignment
    repeats (or ``max_iter`` rounds)."""
    kmeans_plusplus = require("sklearn.cluster", "moejax.extract.plan (k-means++)"
                              ).kmeans_plusplus

    w = _normalise_rows(np.asarray(w_up_DF, np.float64).T)  # [F, D]: one point per neuron
    F = w.shape[0]
    if n_experts < 1 or F % n_experts:
        raise ValueError(f"n_experts={n_experts} must divide the hidden width F={F}")
    centres, _ = kmeans_plusplus(w, n_experts, random_state=seed)
    groups = None
    for _ in range(max_iter):
        new = balanced_assignment(w, centres)
        if groups is not None and np.array_equal(new, groups):
            break
        groups = new
        centres = np.stack([w[groups == c].mean(0) for c in range(n_experts)])
    return groups


def param_centres(w_up_DF: np.ndarray, expert_of_F: np.ndarray, n_experts: int) -> np.ndarray:
    """``[E, D]``: each expert's mean L2-normalised input weight vector (MoEfication's
    parameter centres)."""
    w = _normalise_rows(np.asarray(w_up_DF, np.float64).T)
    return np.stack([w[expert_of_F == c].mean(0) for c in range(n_experts)]).astype(np.float32)


def moefication_plan(w_up_DF, n_experts: int, *, seed: int = 0) -> ExpertPlan:
    """MoEfication's experts (constrained balanced k-means of the normalised ``W_up``
    columns) with their parameter centres as router vectors (no bias)."""
    w = np.asarray(w_up_DF, np.float32)
    expert_of = balanced_kmeans_partition(w, n_experts, seed=seed)
    masks = np.stack([expert_of == c for c in range(n_experts)])
    return ExpertPlan(masks, param_centres(w, expert_of, n_experts),
                      np.zeros((n_experts,), np.float32))
