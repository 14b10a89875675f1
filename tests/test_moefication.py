"""MoEfication's baselines as the authors' code builds them, against hand-worked cases and
numpy transcriptions: constrained balanced k-means (exact balanced assignment), parameter
centres and their router, the Linear-Tanh-Linear MLP router and its BCE target; MoEE's random
routing; the parameter breakdown."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.extract import (
    ExpertPlan,
    balanced_kmeans_partition,
    extract_model,
    moefication_plan,
    param_breakdown,
    param_counts,
)
from moejax.extract.pipeline import (
    MLPRouterNet,
    router_bce,
    router_targets,
    router_train_config,
    train_mlp_router,
)
from moejax.extract.plan import balanced_assignment, param_centres
from moejax.nn.encoder import ViT, vit_config
from moejax.nn.extracted import ExtractedFFNConfig, random_scores
from moejax.train.hparams import TrainConfig


def test_balanced_assignment_is_the_best_of_all_balanced_assignments():
    rng = np.random.default_rng(0)
    pts, cen = rng.normal(size=(6, 3)), rng.normal(size=(3, 3))
    got = balanced_assignment(pts, cen)
    assert np.bincount(got).tolist() == [2, 2, 2]
    cost = lambda g: sum(((pts[f] - cen[c]) ** 2).sum() for f, c in enumerate(g))  # noqa: E731
    best = min(cost(g) for g in itertools.product(range(3), repeat=6)
               if np.bincount(g, minlength=3).tolist() == [2, 2, 2])
    assert cost(got) == pytest.approx(best)


def test_balanced_kmeans_splits_a_lopsided_cloud_into_equal_groups():
    # 6 neurons point along +x, 2 along +y: plain k-means (2 groups) would split 6 / 2; the
    # constrained version must give 4 / 4, the two +y neurons together
    w_DF = np.array([[1, 1, 1, 1, 1, 1, 0, 0], [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 1, 1]])
    g = balanced_kmeans_partition(w_DF, 2, seed=0)
    assert np.bincount(g).tolist() == [4, 4]
    assert g[6] == g[7]
    # the hand-worked normalised centres of that split: the mean of each group's unit columns
    cols = w_DF.T / np.linalg.norm(w_DF.T, axis=1, keepdims=True)
    c = param_centres(w_DF, g, 2)
    for e in range(2):
        np.testing.assert_allclose(c[e], cols[g == e].mean(0), rtol=1e-6)


def test_param_centres_by_hand():
    w_DF = np.array([[3.0, 0.0, 1.0, 1.0], [4.0, 2.0, 0.0, 1.0]])
    c = param_centres(w_DF, np.array([0, 0, 1, 1]), 2)
    s = 1 / np.sqrt(2)
    np.testing.assert_allclose(c, [[(0.6 + 0) / 2, (0.8 + 1) / 2], [(1 + s) / 2, (0 + s) / 2]],
                               rtol=1e-6)


def _slot_scores(kind, n_experts, x, **weights):
    cfg = ExtractedFFNConfig(d_hidden=4, n_experts=n_experts, router=kind,
                             d_router=weights["w1"].shape[1] if "w1" in weights else 0)
    slot = cfg.build(x.shape[1], rngs=nnx.Rngs(0))
    for k, v in weights.items():
        getattr(slot, k if k.startswith("router") else f"router_{k}")[...] = jnp.asarray(v)
    return np.asarray(slot.scores(jnp.asarray(x)))


def test_param_and_mlp_routers_equal_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 6)).astype(np.float32) * 3
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    r = rng.normal(size=(3, 6)).astype(np.float32) * 0.3
    want = -np.linalg.norm(xn[:, None] - r[None], axis=-1)
    np.testing.assert_allclose(_slot_scores("param", 3, x, router=r), want, rtol=1e-5,
                               atol=1e-6)
    w1, w2 = rng.normal(size=(6, 3)), rng.normal(size=(3, 3))
    np.testing.assert_allclose(_slot_scores("mlp", 3, x, w1=w1, w2=w2), np.tanh(xn @ w1) @ w2,
                               rtol=1e-5, atol=1e-6)
    net = MLPRouterNet(r)  # starts at the centres and the identity
    np.testing.assert_allclose(np.asarray(net(jnp.asarray(x))), np.tanh(xn @ r.T), rtol=1e-5,
                               atol=1e-6)


def test_router_target_and_bce_equal_numpy():
    y = np.array([[1.0, -2.0, 3.0, 0.5], [0.0, 4.0, -1.0, 2.0]], np.float32)
    masks = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], bool)
    mass = router_targets(y, masks)
    np.testing.assert_allclose(mass, [[1.0, 3.5], [4.0, 2.0]])
    logits = np.array([[0.3, -1.2], [2.0, 0.1]], np.float32)
    t = mass / 4.0  # the batch's largest mass
    want = np.mean(-(t * np.log(1 / (1 + np.exp(-logits)))
                     + (1 - t) * np.log(1 - 1 / (1 + np.exp(-logits)))))
    assert float(router_bce(jnp.asarray(logits), jnp.asarray(mass))) == pytest.approx(
        want, rel=1e-5)


def test_mlp_router_learns_which_expert_holds_the_mass():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(1024, 8)).astype(np.float32)
    masks = np.eye(4, dtype=bool).repeat(2, axis=1)  # 4 experts of 2 neurons over F = 8
    y = np.zeros((1024, 8), np.float32)
    y[np.arange(1024), 2 * np.argmax(xs[:, :4], 1)] = 1.0  # expert = argmax of x[:4]
    plan = ExpertPlan(masks, rng.normal(size=(4, 8)).astype(np.float32) * 0.1,
                      np.zeros(4, np.float32))
    before = MLPRouterNet(plan.router_ED)(jnp.asarray(xs))
    w = train_mlp_router(xs, y, plan, train_cfg=TrainConfig(
        steps=300, batch_size=128, lr=1e-2, optimizer="adam", weight_decay=0.0,
        schedule="constant", warmup_steps=0, log_every=100))
    xn = xs / np.linalg.norm(xs, axis=1, keepdims=True)
    pred = np.argmax(np.tanh(xn @ w["w1"]) @ w["w2"], 1)
    truth = np.argmax(xs[:, :4], 1)
    assert (np.argmax(np.asarray(before), 1) == truth).mean() < 0.5
    assert (pred == truth).mean() > 0.9


def test_random_routing_is_uniform_and_ignores_what_tokens_mean():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8000, 16)), jnp.float32)
    ids = np.argmax(np.asarray(random_scores(x, 4)), 1)
    counts = np.bincount(ids, minlength=4)
    assert np.abs(counts - 2000).max() < 5 * np.sqrt(8000 * 0.25 * 0.75)  # 5 sigma
    # a neighbour one float step away is routed independently: it agrees about 1/4 of the time
    near = np.argmax(np.asarray(random_scores(jnp.nextafter(x, x + 1), 4)), 1)
    assert abs((near == ids).mean() - 0.25) < 0.03
    # and the same token always goes to the same expert
    np.testing.assert_array_equal(np.argmax(np.asarray(random_scores(x, 4)), 1), ids)
    # k > 1: distinct random experts, pairs uniform over the 6 possible ones
    top2 = np.argsort(-np.asarray(random_scores(x, 4)), 1)[:, :2]
    pairs = np.bincount([4 * min(a, b) + max(a, b) for a, b in top2], minlength=16)
    assert (pairs[[0, 5, 10, 15]] == 0).all()
    assert np.abs(pairs[pairs > 0] - 8000 / 6).max() < 5 * np.sqrt(8000 / 6)


def test_param_breakdown_counts_what_extraction_removes():
    model = ViT(vit_config(image_size=8, patch_size=4, d_model=8, n_layers=2, n_heads=2,
                           d_hidden=16, n_classes=3, n_channels=1), rngs=nnx.Rngs(0))
    w = np.asarray(model.blocks[1].ffn.w_up[...])
    plan = moefication_plan(w, 4)
    masks = plan.masks_EF.copy()
    masks[:, :6] = False  # 6 neurons in no expert
    plan = ExpertPlan(masks, plan.router_ED, plan.router_bias_E)
    rows = {r["layer"]: r for r in param_breakdown(model, {1: plan})}
    assert rows[0]["kept_neurons"] == 16 and rows[0]["params_removed"] == 0
    assert rows[1]["kept_neurons"] == 10
    # 6 neurons: 6 up columns, 6 up biases, 6 down rows; 4 router vectors of 8 + 4 biases back
    assert rows[1]["params_removed"] == 6 * (8 + 1 + 8) - (4 * 8 + 4)
    dense = param_counts(model)["params"]
    new = param_counts(extract_model(model, {1: plan}, router="param"))["params"]
    assert rows["whole model"]["total_params"] == dense
    assert dense - rows["whole model"]["params_removed"] == new
    assert rows["FFNs only"]["total_params"] == 2 * (16 * (2 * 8 + 1) + 8)


def test_router_training_runs_the_authors_epochs_over_the_tokens():
    cfg = router_train_config(1000)  # 30 epochs of 1000 tokens in batches of 512: 58.6 -> 59
    assert (cfg.steps, cfg.batch_size, cfg.lr, cfg.optimizer) == (59, 512, 1e-2, "adam")
    assert router_train_config(512, epochs=2).steps == 2
    assert router_train_config(10).steps == 1


def test_param_breakdown_without_embeddings_leaves_out_the_embedding_tables():
    model = ViT(vit_config(image_size=8, patch_size=4, d_model=8, n_layers=1, n_heads=2,
                           d_hidden=16, n_classes=3, n_channels=1), rngs=nnx.Rngs(0))
    rows = {r["layer"]: r for r in param_breakdown(model, {})}
    # the ViT's only parameter named "embed" is its position table, 5 positions x 8
    assert (rows["whole model"]["total_params"]
            - rows["without embeddings"]["total_params"]) == 5 * 8
