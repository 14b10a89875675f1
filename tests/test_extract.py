"""Expert extraction (MoEE) and MoEfication: the extracted slot against a per-token numpy
oracle, surgery, routing statistics, MAC / parameter hand counts (clustering, neuron selection
and balanced experts: test_extract_cluster.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.data.batches import ArrayBatches
from moejax.evaluate import classifier_kd_loss_fn
from moejax.extract import (
    ClusterConfig,
    ExpertPlan,
    extract_model,
    ffn_macs,
    model_macs,
    moee_plan,
    moefication_plan,
    param_counts,
    record_ffn,
)
from moejax.extract.layer_surgery import compact_model, shared_neurons
from moejax.extract.pipeline import (
    cluster_layers,
    layer_seed,
    matched_top_k,
    moefication_model,
    routing_stats,
)
from moejax.nn.encoder import SequenceClassifier, ViT, bert_encoder_config, vit_config
from moejax.nn.extracted import ExtractedFFN, ExtractedFFNConfig
from moejax.nn.ffn import DenseFFN, DenseFFNConfig
from moejax.ops.activations import activation_fn
from tests.toy_models import logits_of


def tiny_vit(seed=0, n_layers=2):
    cfg = vit_config(image_size=8, patch_size=4, d_model=8, n_layers=n_layers, n_heads=2,
                     d_hidden=16, n_classes=3, n_channels=1)
    m = ViT(cfg, rngs=nnx.Rngs(seed))
    for b in m.blocks:  # non-zero biases, so the oracle checks them
        b.ffn.b_up[...] = jax.random.normal(jax.random.key(seed + 7), (16,)) * 0.3
        b.ffn.b_down[...] = jax.random.normal(jax.random.key(seed + 8), (8,)) * 0.3
    return m


def images(n=6, seed=0):
    return np.random.default_rng(seed).uniform(size=(n, 8, 8, 1)).astype(np.float32)


def oracle_slot(dense: DenseFFN, plan: ExpertPlan, x_ND, router: str, top_k: int):
    """Per token: score the experts, take the top ones, run the union of their neurons."""
    w_up, b_up = np.asarray(dense.w_up[...]), np.asarray(dense.b_up[...])
    w_down, b_down = np.asarray(dense.w_down[...]), np.asarray(dense.b_down[...])
    out = []
    for x in np.asarray(x_ND, np.float64):
        r = plan.router_ED.astype(np.float64)
        if router == "cosine":
            s = r @ x / np.linalg.norm(r, axis=1) / np.linalg.norm(x)
        elif router == "euclidean":
            s = -np.linalg.norm(x[None] - r, axis=1)
        else:
            s = r @ x + plan.router_bias_E
        chosen = np.argsort(-s, kind="stable")[:top_k]
        m = np.any(plan.masks_EF[chosen], axis=0)
        h = np.asarray(activation_fn("gelu")(jnp.asarray(x @ w_up[:, m] + b_up[m], jnp.float32)))
        out.append(h @ w_down[m] + b_down)
    return np.stack(out)


@pytest.mark.parametrize("router,top_k", [("cosine", 1), ("euclidean", 1), ("dot", 2)])
def test_extracted_slot_matches_per_token_oracle(router, top_k):
    model = tiny_vit()
    rng = np.random.default_rng(1)
    masks = rng.uniform(size=(3, 16)) < 0.4
    masks[:, 5] = False  # neuron 5 is used by no expert: removed
    plan = ExpertPlan(masks, rng.normal(size=(3, 8)).astype(np.float32),
                      rng.normal(size=3).astype(np.float32))
    new = extract_model(model, {1: plan}, router=router, top_k=top_k)
    assert isinstance(new.blocks[1].ffn, ExtractedFFN) and isinstance(new.blocks[0].ffn, DenseFFN)
    assert new.blocks[1].ffn.cfg.d_hidden == int(np.any(masks, 0).sum()) <= 15
    assert new.cfg.ffn_slots[1] == new.blocks[1].ffn.cfg
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    y, aux = new.blocks[1].ffn(x)
    want = oracle_slot(model.blocks[1].ffn, plan, np.asarray(x).reshape(10, 8), router, top_k)
    np.testing.assert_allclose(np.asarray(y).reshape(10, 8), want, rtol=2e-5, atol=2e-5)
    assert aux["expert_ids"].shape == (2, 5, top_k)
    np.testing.assert_allclose(float(jnp.sum(aux["load"])), 1.0, rtol=1e-6)
    # the source model is untouched
    assert isinstance(model.blocks[1].ffn, DenseFFN)
    n_layers = len(model.cfg.ffn_slots)
    for layer in (-1, n_layers, 1.0):  # -1 reached the last layer's slot but no block
        with pytest.raises(ValueError, match=f"the model's 0..{n_layers - 1}"):
            extract_model(model, {layer: plan}, router=router, top_k=top_k)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("router,top_k,disjoint", [("cosine", 1, False), ("dot", 2, True)])
def test_compact_layout_equals_the_per_token_oracle_and_masked_layout(router, top_k, disjoint,
                                                                     shared):
    model = tiny_vit()
    rng = np.random.default_rng(2)
    if disjoint:  # a partition, as MoEfication builds
        masks = np.zeros((4, 16), bool)
        masks[rng.integers(0, 4, 16), np.arange(16)] = True
    else:  # overlapping experts of different sizes, as MoEE builds
        masks = rng.uniform(size=(4, 16)) < [[0.2], [0.4], [0.6], [0.3]]
    plan = ExpertPlan(masks, rng.normal(size=(4, 8)).astype(np.float32),
                      rng.normal(size=4).astype(np.float32))
    masked = extract_model(model, {0: plan, 1: plan}, router=router, top_k=top_k)
    load = np.array([0.1, 0.1, 0.7, 0.1])  # expert 2 dominant: its neurons are shared
    compact = compact_model(masked, loads={0: load, 1: load} if shared else None)
    slot = compact.blocks[1].ffn
    routed = masks & ~masks[2] if shared else masks
    assert slot.cfg.d_shared == (masks[2].sum() if shared else 0) and (
        not shared or slot.cfg.d_shared > 0)
    assert slot.cfg.layout == "compact" and slot.cfg.d_expert == routed.sum(1).max()
    assert slot.w_up[...].shape == (4, 8 + 1, routed.sum(1).max())  # + the folded up bias
    assert slot.w_down[...].shape == (4, routed.sum(1).max(), 8 + 1)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    y, aux = slot(x)
    want = oracle_slot(model.blocks[1].ffn, plan, np.asarray(x).reshape(10, 8), router, top_k)
    np.testing.assert_allclose(np.asarray(y).reshape(10, 8), want, rtol=2e-5, atol=2e-5)
    y_masked, aux_masked = masked.blocks[1].ffn(x)
    np.testing.assert_allclose(float(aux["active_neurons"]), float(aux_masked["active_neurons"]),
                               rtol=1e-6)
    if not disjoint:
        with pytest.raises(ValueError, match="share routed neurons"):
            compact_model(extract_model(model, {1: plan}, router=router, top_k=2))


def test_shared_neurons_takes_the_cheapest_prefix_of_the_most_used_experts():
    masks = np.zeros((2, 10), bool)
    masks[0, :6], masks[1, 4:8] = True, True
    # per token: k=0 2 (0.9 x 6 + 0.1 x 4) = 11.6; k=1 6 + 2 (0.1 x 2) = 6.4; k=2 8
    np.testing.assert_array_equal(shared_neurons(masks, [0.9, 0.1]), masks[0])
    # k=1 puts expert 1 first: 4 + 2 (0.1 x 4) = 4.8 beats 8.4 (k=0) and 8 (k=2)
    np.testing.assert_array_equal(shared_neurons(masks, [0.1, 0.9]), masks[1])
    even = np.zeros((2, 8), bool)
    even[0, :4], even[1, 4:] = True, True  # disjoint, equal loads: 8, 8, 8 -> nothing shared
    assert not shared_neurons(even, [0.5, 0.5]).any()
    np.testing.assert_array_equal(shared_neurons(masks, [0.5, 0.5], grouped_cost=3.0),
                                  masks.any(0))  # 15, 6 + 3 (0.5 x 2) = 9, 8: everything
    assert not shared_neurons(masks, [0.9, 0.1], grouped_cost=1.0).any()  # 5.8 < 6.2 < 8
    with pytest.raises(ValueError, match="load_E"):
        shared_neurons(masks, [1.0])


def test_compact_model_only_touches_the_given_layers():
    model = tiny_vit()
    rng = np.random.default_rng(3)
    plans = {i: ExpertPlan(rng.uniform(size=(3, 16)) < 0.5, rng.normal(size=(3, 8)).astype(
        np.float32), np.zeros(3, np.float32)) for i in (0, 1)}
    masked = extract_model(model, plans, router="cosine")
    served = compact_model(masked, layers=[1], loads={1: np.array([0.8, 0.1, 0.1])})
    assert [served.blocks[i].ffn.cfg.layout for i in (0, 1)] == ["masked", "compact"]
    assert served.blocks[1].ffn.cfg.d_shared == plans[1].masks_EF[0].sum()
    x = jnp.asarray(images())
    np.testing.assert_allclose(np.asarray(logits_of(served, x)), np.asarray(logits_of(masked, x)),
                               rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="not extracted"):
        compact_model(extract_model(model, {1: plans[1]}), layers=[0])
    with pytest.raises(ValueError, match="loads has no entry for layers \\[0\\]"):
        compact_model(masked, loads={1: np.ones(3) / 3})


def test_one_expert_with_every_neuron_is_the_dense_model_and_cfg_rebuilds():
    model = tiny_vit()
    plan = ExpertPlan(np.ones((1, 16), bool), np.ones((1, 8), np.float32), np.zeros(1, np.float32))
    new = extract_model(model, {0: plan, 1: plan})
    x = jnp.asarray(images())
    np.testing.assert_allclose(np.asarray(logits_of(new, x)), np.asarray(logits_of(model, x)),
                               rtol=1e-5, atol=1e-6)
    # the config describes the new model: build from it and load the state
    rebuilt = ViT(new.cfg, rngs=nnx.Rngs(0))
    nnx.update(rebuilt, nnx.state(new))
    np.testing.assert_allclose(np.asarray(logits_of(rebuilt, x)), np.asarray(logits_of(new, x)))


def test_record_ffn_pairs_inputs_with_hidden_and_skips_padding():
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=2, n_heads=2, d_hidden=16,
                              max_position=8, pooling="mean")
    clf = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
    toks = np.random.default_rng(0).integers(1, 20, (4, 6)).astype(np.int32)
    mask = np.ones((4, 6), np.float32)
    mask[:, 4:] = 0  # 16 real tokens
    rec = record_ffn(clf, [{"inputs": toks, "mask": mask}], n_tokens=16, seed=0)
    assert set(rec) == {0, 1}
    for i, (x, h) in rec.items():
        assert x.shape == (16, 8) and h.shape == (16, 16)
        np.testing.assert_allclose(h, np.asarray(clf.encoder.blocks[i].ffn.hidden(jnp.asarray(x))),
                                   rtol=1e-5, atol=1e-6)
    # layer 0's inputs: with the padded positions filled differently, the real tokens' FFN
    # inputs change only through attention, which masks the padding: same records
    toks2 = toks.copy()
    toks2[:, 4:] = 1
    rec2 = record_ffn(clf, [{"inputs": toks2, "mask": mask}], n_tokens=16, seed=0)
    np.testing.assert_allclose(rec2[0][0], rec[0][0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="fewer than n_tokens"):
        record_ffn(clf, [{"inputs": toks, "mask": mask}], n_tokens=17)


def test_mac_and_parameter_hand_count():
    model = tiny_vit()
    # T = 1 + 4 patches = 5, D = 8, F = 16, 2 layers; patch dim 16; 3 classes
    attn = 4 * 5 * 8 * 8 + 2 * 5 * 5 * 8  # 1680 per layer
    ffn = 2 * 5 * 8 * 16  # 1280 per layer
    other = 4 * 16 * 8 + 8 * 3  # 536
    m = model_macs(model)
    assert m["total"] == 2 * (attn + ffn) + other and m["other"] == other
    masks = np.zeros((2, 16), bool)
    masks[0, :6] = masks[1, 4:10] = True  # 10 kept neurons
    plan = ExpertPlan(masks, np.ones((2, 8), np.float32), np.zeros(2, np.float32))
    new = extract_model(model, {1: plan})
    me = model_macs(new, active_neurons={1: 5.5})
    assert me["per_layer"][1] == {"router": 5 * 2 * 8, "experts": 2 * 5 * 8 * 5.5}
    assert me["total"] == 2 * attn + ffn + 80 + 440 + other
    with pytest.raises(ValueError, match="active_neurons"):
        model_macs(new)
    # MoEfication layer with a trained MLP router (hidden 4): router D*4 + 4*C per token

    mlp_slot = ExtractedFFNConfig(d_hidden=16, n_experts=4, top_k=2, router="mlp", d_router=4)
    assert ffn_macs(mlp_slot, 8, 5, active_neurons=8.0) == {"router": 5 * (8 * 4 + 4 * 4),
                                                            "experts": 2 * 5 * 8 * 8.0}
    dense_p = param_counts(model)["params"]
    # layer 1 loses 6 neurons (6 up columns, 6 biases, 6 down rows) and gains 2x8 + 2 router
    assert param_counts(new) == {"params": dense_p - 6 * (8 + 1 + 8) + 18, "mask_entries": 20}


def test_routing_stats_match_plan_sizes_and_matched_top_k():
    model = tiny_vit(n_layers=1)
    x = images(8)
    rec = record_ffn(model, [{"inputs": x}], n_tokens=40)
    lab = np.arange(40) % 2
    plan = moee_plan(*rec[0], lab, p=0.8)
    new = extract_model(model, {0: plan})
    st = routing_stats(new, [{"inputs": x, "labels": np.arange(8) % 3}], n_classes=3)[0]
    assert st["load"].sum() == pytest.approx(1.0)
    assert st["active_neurons"] == pytest.approx(float(st["load"] @ plan.sizes_E))
    np.testing.assert_allclose(st["per_class"].sum(1), 1.0)
    assert matched_top_k({0: 7.0, 1: 1.0}, {0: 4, 1: 4}, 4) == {0: 2, 1: 1}


def test_moefication_model_disjoint_experts_cover_the_dense_layer():
    model = tiny_vit(n_layers=1)
    x = images(16)
    rec = record_ffn(model, [{"inputs": x}], n_tokens=80)
    plan = moefication_plan(np.asarray(model.blocks[0].ffn.w_up[...]), 4)
    assert (plan.masks_EF.sum(0) == 1).all()  # a partition
    # top_k = every expert: the dense model again
    full, _ = moefication_model(model, rec, [0], n_experts=4, top_k={0: 4})
    np.testing.assert_allclose(np.asarray(full(jnp.asarray(x))[0]),
                               np.asarray(model(jnp.asarray(x))[0]), rtol=1e-5, atol=1e-6)
    st = routing_stats(full, [{"inputs": x}])[0]
    assert st["active_neurons"] == 16
    # -1 reached sklearn's k-means with seed -1, 1 had no top_k: refused before any k-means
    for layers, top_k, why in (([-1], {-1: 1}, "layers of the model's 0..0"),
                               ([1], {1: 1}, "layers of the model's 0..0"),
                               ([0, 0], {0: 1}, "distinct layers"), ([0], {}, "no top_k")):
        with pytest.raises(ValueError, match=why):
            moefication_model(model, rec, layers, n_experts=4, top_k=top_k)
    # a run seed past 4294967 made a layer seed past 2**32, which k-means refused after the
    # recording; the layer seeds of smaller run seeds are unchanged
    assert layer_seed(7, 3) == 7003 and layer_seed(2**32 - 1, 5) < 2**32
    moefication_model(model, rec, [0], n_experts=4, top_k={0: 1}, seed=5_000_000)
    cluster_layers(rec, ClusterConfig(method="kmeans", n_clusters=2), seed=5_000_000)
    with pytest.raises(ValueError, match="record_ffn: layers \\[-1\\]"):
        record_ffn(model, [{"inputs": x}], n_tokens=80, layers=[-1])


def test_kd_loss_and_array_batches():
    model = tiny_vit(n_layers=1)
    x = images(4)
    t = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    lab = np.array([0, 1, 2, 0], np.int32)
    src = ArrayBatches({"inputs": x, "labels": lab, "teacher_logits": t}, batch_size=4, seed=0)
    b = src.batch(0)
    assert set(b) == {"inputs", "labels", "teacher_logits"}
    b2 = src.batch(0)
    np.testing.assert_array_equal(b["labels"], b2["labels"])
    s = np.asarray(model(jnp.asarray(b["inputs"]))[0], np.float64)
    T = 2.0
    p = jax.nn.softmax(b["teacher_logits"] / T)
    kl = np.mean(np.sum(p * (np.log(p) - jax.nn.log_softmax(s / T)), -1)) * T * T
    ce = -np.mean(jax.nn.log_softmax(s)[np.arange(4), b["labels"]])
    loss, m = classifier_kd_loss_fn(alpha=0.3, temperature=T)(model, b)
    np.testing.assert_allclose(float(loss), 0.3 * kl + 0.7 * ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["kd"]), kl, rtol=1e-5)

    class WithAux:  # a student whose router adds an auxiliary loss: it joins the objective
        def __call__(self, x, **kw):
            return model(x, **kw)[0], {"aux_loss": jnp.float32(0.25)}

    loss_aux, _ = classifier_kd_loss_fn(alpha=0.3, temperature=T)(WithAux(), b)
    np.testing.assert_allclose(float(loss_aux), float(loss) + 0.25, rtol=1e-5)
    with pytest.raises(ValueError, match="common length"):
        ArrayBatches({"a": np.zeros(3), "b": np.zeros(4)}, batch_size=2)


def test_extract_model_on_a_bert_classifier():
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=2, n_heads=2, d_hidden=16,
                              max_position=8, pooling="mean")
    clf = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
    toks = jnp.asarray(np.random.default_rng(0).integers(1, 20, (3, 6)), jnp.int32)
    full = ExpertPlan(np.ones((1, 16), bool), np.ones((1, 8), np.float32), np.zeros(1, np.float32))
    new = extract_model(clf, {1: full})
    assert isinstance(new.encoder.blocks[1].ffn, ExtractedFFN) and new.b_cls.shape == (3,)
    np.testing.assert_allclose(np.asarray(new(toks)[0]), np.asarray(clf(toks)[0]), rtol=1e-5,
                               atol=1e-6)


def test_a_layer_without_clusters_stays_dense_and_noise_forms_no_expert():
    x = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    y = np.abs(x @ np.random.default_rng(1).normal(size=(8, 16))).astype(np.float32)
    assert moee_plan(x, y, np.full(20, -1)) is None
    lab = np.full(20, -1)
    lab[:5], lab[10:14] = 3, 7  # two clusters (ids relabelled), the rest noise
    plan = moee_plan(x, y, lab, p=0.8)
    assert plan.n_experts == 2
    np.testing.assert_allclose(plan.router_ED[0], x[:5].mean(0), rtol=1e-6)
    np.testing.assert_allclose(plan.router_ED[1], x[10:14].mean(0), rtol=1e-6)
    model = tiny_vit()
    new = extract_model(model, {0: None, 1: plan})
    assert isinstance(new.blocks[0].ffn, DenseFFN) and isinstance(new.blocks[1].ffn, ExtractedFFN)


def test_mac_count_of_a_gated_dense_ffn_and_of_a_random_router():
    assert ffn_macs(DenseFFNConfig(d_hidden=16, activation="swiglu"), 8, 5) == {
        "router": 0.0, "experts": 3 * 5 * 8 * 16}
    assert ffn_macs(DenseFFNConfig(d_hidden=16, activation="gelu"), 8, 5) == {
        "router": 0.0, "experts": 2 * 5 * 8 * 16}
    rnd = ExtractedFFNConfig(d_hidden=16, n_experts=4, router="random")
    assert ffn_macs(rnd, 8, 5, active_neurons=4.0) == {"router": 0.0, "experts": 2 * 5 * 8 * 4}


def test_record_ffn_draws_distinct_tokens_from_every_batch_by_seed():
    model = tiny_vit(n_layers=1)
    batches = [{"inputs": images(4, seed=s)} for s in range(3)]  # 3 x 4 images x 5 tokens
    every = record_ffn(model, batches, n_tokens=60, seed=0)[0][0]
    rows = {tuple(r) for r in every}
    assert len(rows) == 60
    picks = [record_ffn(model, batches, n_tokens=20, seed=s)[0][0] for s in (0, 1)]
    for x in picks:
        at = [next(j for j, r in enumerate(every) if np.array_equal(r, row)) for row in x]
        assert len(set(at)) == 20 and at == sorted(at)  # distinct tokens, in stream order
        assert max(at) >= 40 or min(at) < 20 <= max(at)  # not just the first batch's tokens
    assert not np.array_equal(picks[0], picks[1])


def test_shared_neurons_refuses_a_routed_mac_cheaper_than_a_dense_one():
    masks = np.ones((2, 4), bool)
    with pytest.raises(ValueError, match="grouped_cost"):
        shared_neurons(masks, [0.5, 0.5], grouped_cost=0.5)


def _bert_classifier():
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=1, n_heads=2, d_hidden=16,
                              max_position=8, pooling="mean")
    return SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))


def test_routing_stats_and_the_slots_aux_count_real_tokens_only():
    clf = _bert_classifier()
    rng = np.random.default_rng(5)
    masks = rng.uniform(size=(3, 16)) < 0.5
    masks[:, 0] = True
    plan = ExpertPlan(masks, rng.normal(size=(3, 8)).astype(np.float32), np.zeros(3, np.float32))
    new = extract_model(clf, {0: plan})
    toks = rng.integers(1, 20, (4, 6)).astype(np.int32)
    lens = [6, 2, 4, 3]
    mask = (np.arange(6)[None] < np.array(lens)[:, None]).astype(np.float32)
    labels = np.array([0, 1, 2, 1])
    got = routing_stats(new, [{"inputs": toks, "mask": mask, "labels": labels}], n_classes=3)[0]
    # oracle: every row alone at its real length (no padding anywhere), counts pooled by token
    counts, per_class, active = np.zeros(3), np.zeros((3, 3)), 0.0
    aux_of = nnx.jit(lambda m, t: m(t)[1])  # one program per row length, not one per op
    for b, n in enumerate(lens):
        aux = aux_of(new, jnp.asarray(toks[b:b + 1, :n]))
        first = np.asarray(aux["layers"][0]["expert_ids"])[0, :, 0]
        counts += np.bincount(first, minlength=3)
        np.add.at(per_class, (labels[b], first), 1.0)
        active += float(masks[first].sum())
    np.testing.assert_allclose(got["load"], counts / sum(lens), rtol=1e-6)
    np.testing.assert_allclose(got["active_neurons"], active / sum(lens), rtol=1e-6)
    np.testing.assert_allclose(got["per_class"], per_class / per_class.sum(1, keepdims=True),
                               rtol=1e-6)
    # the slot's own aux: the padded batch's load and active neurons are those of its real
    # tokens alone, whatever the padding holds
    slot = new.encoder.blocks[0].ffn
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    real = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    _, aux = slot(x, mask_BT=real)
    _, alone = slot(jnp.concatenate([x[0, :3], x[1]])[None])
    np.testing.assert_allclose(np.asarray(aux["load"]), np.asarray(alone["load"]), rtol=1e-6)
    np.testing.assert_allclose(float(aux["active_neurons"]), float(alone["active_neurons"]),
                               rtol=1e-6)


def test_routing_stats_count_the_union_of_a_tokens_overlapping_experts():
    model = tiny_vit(n_layers=1)
    rng = np.random.default_rng(6)
    masks = rng.uniform(size=(4, 16)) < 0.5  # overlapping experts, two per token
    masks[:, 0] = True
    plan = ExpertPlan(masks, rng.normal(size=(4, 8)).astype(np.float32), np.zeros(4, np.float32))
    new = extract_model(model, {0: plan}, router="dot", top_k=2)
    x = images(6, seed=2)
    st = routing_stats(new, [{"inputs": x}])[0]
    _, aux = new(jnp.asarray(x))
    ids = np.asarray(aux["layers"][0]["expert_ids"]).reshape(-1, 2)
    union = np.mean([np.any(masks[pair], axis=0).sum() for pair in ids])
    assert union < 2 * masks.sum(1).mean()  # the overlap counts once
    assert st["active_neurons"] == pytest.approx(union, rel=1e-12)
    assert st["active_neurons"] == pytest.approx(float(aux["layers"][0]["active_neurons"]),
                                                 rel=1e-6)


def test_text_macs_are_the_mean_of_every_examples_macs():
    """Attention's scores grow with T^2: the mean example's MACs take the mean of T^2 over
    the examples' real lengths, not the square of their mean length."""
    clf = _bert_classifier()  # 1 block, D 8, F 16, a 3-class head
    lens = np.array([2, 6, 3, 5])

    def one(t):  # a single example of t real tokens, by hand
        return 4 * t * 8 * 8 + 2 * t * t * 8 + 2 * t * 8 * 16 + 8 * 3

    got = model_macs(clf, lens)
    assert got["total"] == pytest.approx(np.mean([one(t) for t in lens]), rel=1e-12)
    assert model_macs(clf, 4.0)["total"] == one(4)  # one length for every example
    assert got["total"] > model_macs(clf, lens.mean())["total"]
    with pytest.raises(ValueError, match="lengths >= 0"):
        model_macs(clf, [])
