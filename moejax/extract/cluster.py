"""Clustering of recorded MLP activations (MoEE step 1), on the host with scikit-learn.

``labels_N = cluster_activations(y_NF, cfg, seed=...)`` gives each of ``N`` activation vectors
a cluster id ``0..C-1`` or ``-1`` (noise: no expert is built from it). Methods:

* ``"hdbscan"`` (the paper): ``sklearn.cluster.HDBSCAN(min_cluster_size=ceil(min_cluster_frac *
  N))``; the number of clusters comes from the data (0 clusters: the layer stays dense).

Neighbour search (``neighbors``, HDBSCAN / OPTICS / DBSCAN): ``"auto"`` uses the exact
all-pairs (``brute``) search up to ``brute_max_points`` points and scikit-learn's tree choice
beyond (its N^2 distance matrix would not fit in memory). Both are exact; on activations
(high-dimensional, where a tree prunes little) the trees are the slow choice, by orders of
magnitude.
* ``"dbscan"`` / ``"optics"``: the related density methods of the ablation (Sec. 5.1), with
  ``min_samples = min_cluster_size``; DBSCAN's ``eps`` is the ``dbscan_eps_quantile`` quantile of
  each point's distance to its ``min_samples``-th neighbour (the k-distance heuristic).
* ``"kmeans"`` / ``"birch"``: partition methods; they need the cluster count ``n_clusters``
  (the study passes the count HDBSCAN found in the same layer, so only the shapes differ).
* ``"random"``: every point gets a uniformly random id in ``0..n_clusters-1`` (Table 2's
  "random clusters" ablation).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from moejax.config import Config, config
from moejax.extras import require

__all__ = ["ClusterConfig", "cluster_activations", "n_clusters_of", "CLUSTER_METHODS",
           "relabel"]

ClusterMethod = Literal["hdbscan", "dbscan", "optics", "kmeans", "birch", "random"]
CLUSTER_METHODS = ("hdbscan", "dbscan", "optics", "kmeans", "birch", "random")


@config
class ClusterConfig(Config):
    """method: see the module docstring; min_cluster_frac: HDBSCAN's minimum cluster size as
    a fraction of the sample (paper: 0.6%); n_clusters: kmeans / birch / random only;
    dbscan_eps_quantile: DBSCAN's eps heuristic; neighbors / brute_max_points: the neighbour
    search (see the module docstring)."""

    method: ClusterMethod = "hdbscan"
    min_cluster_frac: float = 0.006
    n_clusters: int = 8
    dbscan_eps_quantile: float = 0.5
    neighbors: Literal["auto", "brute", "tree"] = "auto"
    brute_max_points: int = 20000

    def validate(self) -> None:
        self._require(self.method in CLUSTER_METHODS,
                      f"method={self.method!r}; use one of {CLUSTER_METHODS}")
        self._require(0 < self.min_cluster_frac < 0.5,
                      f"min_cluster_frac={self.min_cluster_frac} must be in (0, 0.5)")
        self._require(self.n_clusters >= 1, f"n_clusters={self.n_clusters} must be >= 1")
        self._require(self.brute_max_points >= 1,
                      f"brute_max_points={self.brute_max_points} must be >= 1")
        self._require(0 < self.dbscan_eps_quantile < 1,
                      f"dbscan_eps_quantile={self.dbscan_eps_quantile} must be in (0, 1)")

    def algorithm(self, n_points: int) -> str:
        """scikit-learn's ``algorithm`` argument for ``n_points`` points."""
        if self.neighbors == "brute" or (self.neighbors == "auto"
                                         and n_points <= self.brute_max_points):
            return "brute"
        return "auto"

    def min_cluster_size(self, n_points: int) -> int:
        return max(2, math.ceil(self.min_cluster_frac * n_points))


def n_clusters_of(labels_N: np.ndarray) -> int:
    """Number of clusters (ids >= 0) in a label vector."""
    labels_N = np.asarray(labels_N)
    return int(labels_N.max() + 1) if labels_N.size and labels_N.max() >= 0 else 0


def relabel(labels_N: np.ndarray) -> np.ndarray:
    """Cluster ids made contiguous ``0..C-1`` (in the order of the old ids; empty ids vanish);
    noise stays ``-1``."""
    labels_N = np.asarray(labels_N)
    if labels_N.ndim != 1 or not np.issubdtype(labels_N.dtype, np.integer):
        raise ValueError(f"cluster labels of shape {labels_N.shape} and dtype "
                         f"{labels_N.dtype}: give one integer id a point (-1: noise)")
    labels_N = labels_N.astype(np.int64)
    ids = np.unique(labels_N[labels_N >= 0])
    out = np.full_like(labels_N, -1)
    for new, old in enumerate(ids):
        out[labels_N == old] = new
    return out


def cluster_activations(y_NF: np.ndarray, cfg: ClusterConfig | None = None, *,
                        seed: int = 0) -> np.ndarray:
    """Cluster ids ``[N]`` (``-1`` = noise) of the activation rows ``y_NF`` (``cfg`` default:
    HDBSCAN with the paper's 0.6% minimum cluster size)."""
    cfg = cfg or ClusterConfig()
    y = np.asarray(y_NF, np.float32)
    if y.ndim != 2 or y.shape[0] < 2:
        raise ValueError(f"cluster_activations needs an [N, F] array with N >= 2, got {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError("cluster_activations: the activations contain NaN or inf")
    n, m = y.shape[0], cfg.method
    mcs = cfg.min_cluster_size(n)
    if m == "random":
        return relabel(np.random.default_rng(seed).integers(0, cfg.n_clusters, n))
    if m in ("kmeans", "birch"):
        # scikit-learn (the studies extra) on use: importing moejax.extract does not need it
        sk = require("sklearn.cluster", "moejax.extract.cluster (k-means, Birch)")
        k = min(cfg.n_clusters, n)
        est = (sk.KMeans(k, n_init=3, random_state=seed) if m == "kmeans"
               else sk.Birch(n_clusters=k, threshold=0.1))
        return relabel(est.fit_predict(y))
    if m == "hdbscan":
        sk = require("sklearn.cluster", "moejax.extract.cluster (HDBSCAN)")
        return relabel(sk.HDBSCAN(min_cluster_size=mcs, algorithm=cfg.algorithm(n),
                                  copy=True).fit_predict(y))
    if m == "optics":
        sk = require("sklearn.cluster", "moejax.extract.cluster (OPTICS)")
        return relabel(sk.OPTICS(min_samples=mcs, min_cluster_size=mcs,
                                 algorithm=cfg.algorithm(n)).fit_predict(y))
    sk = require("sklearn.cluster", "moejax.extract.cluster (DBSCAN)")
    nearest = require("sklearn.neighbors", "moejax.extract.cluster (DBSCAN)").NearestNeighbors
    alg = cfg.algorithm(n)
    kdist = nearest(n_neighbors=min(mcs, n), algorithm=alg).fit(y).kneighbors(y)[0][:, -1]
    eps = max(float(np.quantile(kdist, cfg.dbscan_eps_quantile)), 1e-6)
    return relabel(sk.DBSCAN(eps=eps, min_samples=mcs, algorithm=alg).fit_predict(y))
