"""The DAREx studies' setups: what is pruned (every delta but the task head, as the official
``drop()``, or the matrices), the geometric q grid that holds the paper's optima, the
per-layer q with vectors among the pruned leaves, and bad grids, masks and drop rates refused
before any fine-tuning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.darex import controlled, decoder, encoder
from moejax import delta as dl
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.delta import MatrixInputStats, PruneContext, run_one
from moejax.delta.analytic_q import fill_other_leaves
from moejax.nn.encoder import SequenceClassifier, bert_encoder_config
from moejax.pytree import path_str


def _selected(D, mask):
    return {path_str(p) for (p, _), m in zip(jax.tree_util.tree_leaves_with_path(D),
                                             jax.tree_util.tree_leaves(mask)) if m}


def test_encoder_prunes_every_delta_but_the_head_by_default():
    cfg = bert_encoder_config(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_hidden=32,
                              max_position=8)
    clf = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
    D = nnx.state(clf, nnx.Param)
    every = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(D)}
    head = {p for p in every if not p.startswith("encoder/")}
    assert head  # the classifier head lives outside the encoder
    assert encoder.make_config("quick").prune == "all"
    assert _selected(D, encoder.pruned_mask(D, "all")) == every - head
    mats = _selected(D, encoder.pruned_mask(D, "matrices"))
    assert mats and all("/w_" in p for p in mats) and len(mats) < len(every - head)
    assert any("norm" in p or "embed" in p for p in every - head - mats)


def test_controlled_and_decoder_default_to_every_delta():
    D = {"w1": jnp.ones((4, 3)), "b1": jnp.ones(3), "norm": jnp.ones(4),
         "wo": jnp.ones((3, 2)), "bo": jnp.ones(2)}
    assert _selected(D, controlled.pruned_mask(D, "all")) == set(D)
    assert _selected(D, controlled.pruned_mask(D, "matrices")) == {"w1", "wo"}
    assert controlled.make_config("quick").prune == "all"
    assert decoder.make_config("quick").prune == "all"


def test_geometric_q_grid_holds_the_papers_optima():
    g = dl.q_grid(0.99, 20, spacing="geometric")
    assert g[0] == pytest.approx(0.01) and g[-1] == pytest.approx(0.1)  # 1/q 100 -> 10
    inv = 1 / g
    assert np.sum((inv >= 30) & (inv <= 55)) >= 3  # the paper's optima, 1/q = 30..55
    lin = dl.q_grid(0.99, 20)
    assert np.sum((1 / lin >= 30) & (1 / lin <= 55)) == 0  # the linear grid jumps past them
    assert dl.q_grid(0.5, 4, spacing="geometric")[-1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="num"):
        dl.q_grid(0.9, 0, spacing="geometric")


@pytest.mark.parametrize("p", [0.5, 0.7, 0.8, 0.9, 0.95, 0.96, 0.97, 0.975, 0.98, 0.99, 0.999])
def test_the_geometric_grid_never_collapses_onto_vanilla_dare(p):
    """Every drop rate's grid starts at 1 - p (vanilla DARE) and spans at least a factor of
    4 in q with distinct points: at p = 0.9, where 1 - p is 1/inv_q_min itself, a grid
    narrowed to 1/q >= 10 would be 21 copies of 0.1, and DAREx-q would be DARE by
    construction."""
    g = dl.q_grid(p, 20, spacing="geometric")
    assert g[0] == pytest.approx(1 - p) and len(np.unique(np.round(g, 12))) == 21
    assert g[-1] / g[0] >= 4 - 1e-9 or g[-1] == pytest.approx(1.0)


def _ctx(mask_vectors=True, **kw):
    r = np.random.default_rng(0)
    D = {"w_a": jnp.asarray(r.normal(0, 0.01, (8, 6))), "b_a": jnp.asarray(r.normal(0, 0.01, 6)),
         "w_o": jnp.asarray(r.normal(0, 0.01, (6, 3))), "scale": jnp.asarray(r.normal(0, 0.01, 8))}
    pre = jax.tree.map(jnp.zeros_like, D)
    x, h = r.normal(size=8), r.normal(size=6)
    stats = {"w_a": MatrixInputStats(np.abs(x), np.abs(x) * 3, 10, x),
             "w_o": MatrixInputStats(np.abs(h), np.abs(h) * 3, 10, h)}
    mask = {k: mask_vectors or k.startswith("w_") for k in D}
    score = lambda prm: -float(sum(jnp.sum(jnp.abs(v)) for v in jax.tree.leaves(prm)))  # noqa
    return PruneContext(pretrained=pre, delta=D, mask=mask, key=jax.random.key(0),
                        val_metric=score, test_metric=score,
                        outputs_fn=lambda prm: (x @ prm["w_a"]) @ prm["w_o"],
                        x_stats=stats, q_num=3, eta_num=3, **kw)


def test_per_layer_q_and_wanda_with_vectors_among_the_pruned_leaves():
    """The official rescale_q for leaves without an analytic q: a bias b_X takes its weight
    w_X's q, a norm scale the mean of the layers' q."""
    ctx = _ctx()
    assert [k for k, v in zip(sorted(ctx.delta), jax.tree.leaves(ctx.stats_mask)) if v] == [
        "w_a", "w_o"]
    qs = fill_other_leaves({"w_a": 0.2, "w_o": 0.4, "b_a": 0.1, "scale": 0.1}, ctx.delta,
                           ctx.mask, ctx.stats_mask)
    assert qs == {"w_a": 0.2, "w_o": 0.4, "b_a": 0.2, "scale": pytest.approx(0.3)}
    r = run_one(ctx, "DAREx-q (per-layer q_v)", 0.9)
    assert r["q"] and float(r["q"].partition("..")[0]) >= 0.1
    run_one(ctx, "WANDA", 0.9)  # the vectors by |Delta| alone, the matrices by WANDA


def test_prune_context_refuses_empty_grids_masks_and_unknown_forms():
    with pytest.raises(ValueError, match="q_num"):
        PruneContext(**{**_ctx().__dict__, "q_num": 0})
    with pytest.raises(ValueError, match="eta_num"):
        PruneContext(**{**_ctx().__dict__, "eta_num": 0})
    with pytest.raises(ValueError, match="nothing to prune"):
        PruneContext(**{**_ctx().__dict__, "mask": {k: False for k in _ctx().delta}})
    with pytest.raises(ValueError, match="analytic_form"):
        PruneContext(**{**_ctx().__dict__, "analytic_form": "pooled"})
    with pytest.raises(ValueError, match="q_spacing"):
        PruneContext(**{**_ctx().__dict__, "q_spacing": "log"})


@pytest.mark.parametrize("mod,override,key", [
    (encoder, "q_num=0", "q_num"), (encoder, "eta_num=0", "eta_num"),
    (encoder, "p=1.0", "drop rate"), (encoder, "p=0.0", "drop rate"),
    (encoder, "per_layer_form=pooled", "per_layer_form"), (encoder, "prune=head", "prune"),
    (decoder, "ps=(0.0,)", "ps"), (decoder, "q_num=0", "q_num"),
    (decoder, "corpus_bytes=0", "corpus_bytes"), (decoder, "corpus_bytes=64", "one window"),
    (decoder, "corpus_bytes=65", "random offset"),
    (controlled, "ps=(1.0,)", "ps"), (controlled, "lora_ps=()", "lora_ps"),
    (controlled, "sweep_ps=()", "sweep_ps"), (controlled, "large_ps=()", "large_ps"),
    (controlled, "q_spacing=log", "q_spacing"),
])
def test_darex_studies_refuse_bad_grids_and_rates_before_fine_tuning(mod, override, key):
    with pytest.raises(ConfigError, match=key):
        apply_overrides(mod.make_config("quick"), [override])


def test_structural_dpp_with_vectors_among_the_pruned_leaves():
    """A plain MLP pruned whole (prune=all): structural DPP takes its matrices, DARE its
    vectors (biases, norm scales), instead of refusing the vectors."""
    ctx = _ctx()
    r = run_one(ctx, "structural DPP + q_v", 0.9)
    assert r["q"] != ""
