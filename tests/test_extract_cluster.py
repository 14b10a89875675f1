"""Expert extraction's clustering and neuron selection (MoEE) and MoEfication's balanced
k-means: separated blobs recovered, noise left unclustered, the variance and magnitude
selections by hand, brute and tree neighbour search agreeing, and balanced k-means's equal
sizes, scale invariance and fixed point."""

import numpy as np
import pytest

from moejax import extras
from moejax.extract import (
    ClusterConfig,
    balanced_kmeans_partition,
    cluster_activations,
    moee_plan,
    n_clusters_of,
    select_neurons,
)
from moejax.extract.pipeline import cluster_layers
from moejax.extract.plan import balanced_assignment, param_centres
from moejax.extras import LATE_BAR_S
from tests.bars import Bars


def blobs(n_per=100, n_blobs=3, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(n_blobs, dim)) * 10
    y = np.concatenate([c + rng.normal(size=(n_per, dim)) * 0.5 for c in centers])
    return y.astype(np.float32), np.repeat(np.arange(n_blobs), n_per)


def same_partition(a, b):
    """True when two labelings group the points identically (ids may differ)."""
    return all(len(set(b[a == i])) == 1 for i in set(a)) and len(set(a)) == len(set(b))


@pytest.mark.parametrize("method", ["hdbscan", "dbscan", "optics", "kmeans", "birch"])
def test_clustering_recovers_separated_blobs(method):
    y, truth = blobs()
    labels = cluster_activations(y, ClusterConfig(method=method, min_cluster_frac=0.05,
                                                  n_clusters=3))
    core = labels >= 0
    assert core.mean() > 0.9 and n_clusters_of(labels) == 3
    assert same_partition(labels[core], truth[core])


def test_clustering_the_layers_shows_a_bar_of_them_once_it_has_run_a_while(monkeypatch):
    (y0, _), (y1, _) = blobs(seed=0), blobs(seed=1)
    records, cfg = {3: (None, y1), 0: (None, y0)}, ClusterConfig(method="kmeans", n_clusters=3)
    labels, bars = cluster_layers(records, cfg), Bars()
    monkeypatch.setattr(extras, "progress", bars)
    again = cluster_layers(records, cfg)
    assert list(again) == [0, 3] and all((again[i] == labels[i]).all() for i in (0, 3))
    (bar,) = bars.made
    assert (bar.kw["desc"], bar.kw["delay"], bar.done, bar.closed) == (
        "clustering (kmeans)", LATE_BAR_S, 2, True)


def test_hdbscan_finds_no_cluster_in_uniform_noise_and_random_labels_are_in_range():
    y = np.random.default_rng(1).uniform(size=(400, 6)).astype(np.float32)
    assert n_clusters_of(cluster_activations(y, ClusterConfig(min_cluster_frac=0.3))) <= 1
    r = cluster_activations(y, ClusterConfig(method="random", n_clusters=5), seed=3)
    assert set(r) == set(range(5))
    with pytest.raises(ValueError, match="NaN"):
        cluster_activations(np.full((5, 2), np.nan), ClusterConfig())


def test_variance_selection_hand_case_and_minimality():
    # one cluster whose neurons have variances 1, 4, 2, 3 (times 0.25): cumulative 4, 7, 9 >= 8
    signs = np.array([1.0, -1.0] * 50)[:, None]
    y = signs * np.sqrt(np.array([1.0, 4.0, 2.0, 3.0]))[None] * 0.5
    m = select_neurons(y, np.zeros(100, int), 1, p=0.8)
    assert m.tolist() == [[False, True, True, True]]
    assert select_neurons(y, np.zeros(100, int), 1, p=0.4).tolist() == [[False, True, False,
                                                                         False]]
    # magnitude: mean |activation| of the cluster; random: as many neurons as variance takes
    y2 = np.tile([[5.0, 1.0, 0.0, 4.0]], (10, 1))
    assert select_neurons(y2, np.zeros(10, int), 1, p=0.8,
                          selection="magnitude").tolist() == [[True, False, False, True]]
    # another selection name, or labels that are not one integer id a row, are refused (a
    # misspelt selection ran variance selection, silently)
    with pytest.raises(ValueError, match="selection='varience'; use one of"):
        select_neurons(y2, np.zeros(10, int), 1, selection="varience")
    for bad in (np.zeros(9, int), np.zeros(10) + 0.5):
        with pytest.raises(ValueError, match="give one integer cluster id a row"):
            select_neurons(y2, bad, 1)
    with pytest.raises(ValueError, match="give one integer id a point"):
        moee_plan(y2, y2, np.zeros(10) + 0.5)
    rng = np.random.default_rng(0)
    for seed in range(5):
        yy = rng.gamma(1.0, size=(200, 30)) * rng.uniform(0.1, 3, size=30)
        lab = rng.integers(0, 3, 200)
        for p in (0.5, 0.8, 0.95):
            masks = select_neurons(yy, lab, 3, p=p)
            rnd = select_neurons(yy, lab, 3, p=p, selection="random", seed=seed)
            assert (rnd.sum(1) == masks.sum(1)).all()
            for c in range(3):
                v = yy[lab == c].var(0)
                kept = np.sort(v[masks[c]])
                assert kept.sum() >= p * v.sum() - 1e-9  # covers p ...
                assert kept.sum() - kept[0] < p * v.sum()  # ... and no neuron is spare
                assert kept[0] >= v[~masks[c]].max(initial=0)  # the largest first


def test_balanced_kmeans_partition_is_equal_size_and_finds_directions():
    rng = np.random.default_rng(0)
    dirs = rng.normal(size=(4, 16))
    cols = np.concatenate([d + 0.05 * rng.normal(size=(8, 16)) for d in dirs])  # 32 neurons
    perm = rng.permutation(32)
    expert_of = balanced_kmeans_partition(cols[perm].T, 4, seed=1)
    assert np.bincount(expert_of).tolist() == [8, 8, 8, 8]
    assert same_partition(expert_of, np.repeat(np.arange(4), 8)[perm])
    with pytest.raises(ValueError, match="divide"):
        balanced_kmeans_partition(cols.T, 5)


@pytest.mark.parametrize("method", ["hdbscan", "optics", "dbscan"])
def test_brute_and_tree_neighbour_search_give_the_same_clusters(method):
    y, _ = blobs(n_per=60, n_blobs=4, dim=5, seed=2)
    y = np.concatenate([y, np.random.default_rng(3).uniform(-20, 20, size=(30, 5))])  # noise
    cfg = ClusterConfig(method=method, min_cluster_frac=0.04)
    brute = cluster_activations(y, cfg.replace(neighbors="brute"))
    tree = cluster_activations(y, cfg.replace(neighbors="tree"))
    np.testing.assert_array_equal(brute, tree)
    assert cfg.algorithm(100) == "brute"
    assert cfg.replace(brute_max_points=50).algorithm(100) == "auto"


def test_magnitude_selection_ranks_neurons_by_the_size_of_their_mean_activation():
    # means -5, 1, 0.5, 4: by size 5 and 4 cover 9 of 10.5 >= 0.8; by signed value 4, 1, 0.5
    y = np.tile([[-5.0, 1.0, 0.5, 4.0]], (10, 1))
    got = select_neurons(y, np.zeros(10, int), 1, p=0.8, selection="magnitude")
    assert got.tolist() == [[True, False, False, True]]


def test_balanced_kmeans_ignores_each_neurons_scale_and_ends_at_a_fixed_point():
    rng = np.random.default_rng(0)
    w_DF = rng.normal(size=(6, 24))  # the first assignment (to the k-means++ seeds) moves
    g = balanced_kmeans_partition(w_DF, 4, seed=2)
    # the columns are normalised first: rescaling a neuron cannot move it to another expert
    scaled = w_DF * rng.uniform(0.01, 100.0, size=24)
    np.testing.assert_array_equal(balanced_kmeans_partition(scaled, 4, seed=2), g)
    # Lloyd's iteration ran to convergence: the best balanced assignment to the centres of g
    # is g itself
    cols = w_DF.T / np.linalg.norm(w_DF.T, axis=1, keepdims=True)
    np.testing.assert_array_equal(balanced_assignment(cols, param_centres(w_DF, g, 4)), g)
