"""moejax.delta.methods: the structural DPP method prunes the MLP matrices by input dimension
(the paper) and the other selected matrices element-wise at the same rate."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax import delta as dl
from moejax.delta import PruneContext, run_one


def _ctx(delta):
    pre = jax.tree.map(jnp.zeros_like, delta)
    mask = dl.select_leaves(delta)
    score = lambda prm: -float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(prm)))  # noqa
    return PruneContext(pretrained=pre, delta=delta, mask=mask, key=jax.random.key(0),
                        val_metric=score, test_metric=score, outputs_fn=lambda prm: prm,
                        q_num=3, structural_a=0.25)


def _kept_columns(w):
    return np.flatnonzero(np.any(np.asarray(w) != 0, axis=1))  # input dims (rows, in_axis -2)


def test_structural_dpp_prunes_mlp_input_dims_and_dare_elsewhere():
    rng = np.random.default_rng(0)
    delta = {"blocks": {"0": {"attn": {"w_q": jnp.asarray(rng.normal(size=(64, 64)))},
                              "ffn": {"w_up": jnp.asarray(rng.normal(size=(64, 128)))}}}}
    ctx = _ctx(delta)
    pruner = dl.methods._structural_mlp_pruner(ctx, 0.25, 0.4, 0.9)
    out = pruner(jax.random.key(1), delta, 0.1)
    up, wq = out["blocks"]["0"]["ffn"]["w_up"], out["blocks"]["0"]["attn"]["w_q"]
    assert len(_kept_columns(up)) == 16  # a = 25% of the 64 input dimensions
    assert len(_kept_columns(wq)) > 40  # attention: element-wise DARE, every row touched
    kept = float(jnp.mean(wq != 0))
    assert 0.05 < kept < 0.15  # p = 0.9 there too
    r = run_one(ctx, "structural DPP + q_v", 0.9)
    assert r["q"] != ""
    assert run_one(ctx, "structural DPP + q_v", 0.5)["q"] != ""  # a raised to 1 - p, b = 1


def test_structural_dpp_on_a_plain_mlp_treats_every_matrix_as_mlp():
    rng = np.random.default_rng(1)
    delta = {"w1": jnp.asarray(rng.normal(size=(40, 16))),
             "wo": jnp.asarray(rng.normal(size=(16, 4)))}
    ctx = _ctx(delta)
    out = dl.methods._structural_mlp_pruner(ctx, 0.25, 0.4, 0.9)(jax.random.key(2), delta, 0.1)
    assert len(_kept_columns(out["w1"])) == 10 and len(_kept_columns(out["wo"])) == 4


def test_a_search_with_no_finite_score_gets_a_nan_row_and_the_others_still_run():
    rng = np.random.default_rng(2)
    delta = {"w1": jnp.asarray(rng.normal(size=(8, 8)))}
    ctx = _ctx(delta)
    ctx.val_metric = lambda prm: float("nan")  # e.g. a diverged model's loss
    rows = dl.run_methods(ctx, ["DARE", "DAREx-q (q_v)"], [0.9])
    assert np.isfinite(rows[0]["metric"]) and rows[0]["q"] == "0.1"
    assert np.isnan(rows[1]["metric"]) and rows[1]["q"] == "none: no finite validation score"
