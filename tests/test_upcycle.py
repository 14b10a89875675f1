"""Upcycling surgery (moejax.upcycle) and DeRS upcycling slots (moejax.nn.ders_moe)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.config import ConfigError
from moejax.distill.routing_modes import RoutingMode, with_routing
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.nn.ders_moe import (
    DeRSFrozen,
    DeRSIndex,
    DeRSMoE,
    DeRSMoEConfig,
    ders_param_counts,
    expert_bytes_per_token,
    sm_num_kept,
)
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoE, MoEConfig
from moejax.pytree import named_leaves
from moejax.train.budget import compiled_memory
from moejax.train.hparams import TrainConfig, make_optimizer
from moejax.train.step import init_train_state, lm_loss_fn, make_train_step
from moejax.upcycle import (
    UPCYCLE_MOE,
    UpcycleConfig,
    model_variables,
    moe_slot_config,
    param_report,
    upcycle_model,
    upcycled_layers,
)
from tests.toy_models import logits_of

D, F, L = 16, 32, 4


_DENSE = {}


def _dense(seed=0):
    if seed not in _DENSE:
        cfg = dense_decoder_config(vocab_size=64, d_model=D, n_layers=L, n_heads=2,
                                   d_hidden=F, max_seq_len=32)
        _DENSE[seed] = DecoderLM(cfg, rngs=nnx.Rngs(seed))
    return _DENSE[seed]


def _tokens(seed=1, B=2, T=12):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, 64)


RULES = {
    "vanilla_every_other": UpcycleConfig(),
    "vanilla_list_top1_universal": UpcycleConfig(
        blocks="list", block_list=(0, 3), scale_outputs=True,
        moe=UPCYCLE_MOE.replace(top_k=1, universal_ffn=True)),
    "vanilla_shared_noisy": UpcycleConfig(
        scale_outputs=True,
        moe=UPCYCLE_MOE.replace(n_shared_experts=2, router="noisy", n_experts=3)),
    "lm_all_dense_dispatch": UpcycleConfig(expert_form="lm", lm_rank=3, blocks="all",
                                           moe=UPCYCLE_MOE.replace(dispatch="dense")),
    "sm_extended": UpcycleConfig(expert_form="sm", extended=True, scale_outputs=True,
                                 moe=UPCYCLE_MOE.replace(universal_ffn=True, top_k=1)),
    "lm_frozen_shared_ragged": UpcycleConfig(expert_form="lm", freeze_shared=True,
                                             moe=UPCYCLE_MOE.replace(dispatch="ragged")),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_upcycled_model_equals_dense_at_step_zero(name):
    rule = RULES[name]
    dense = _dense()
    moe = upcycle_model(dense, rule, jax.random.key(7))
    x = _tokens()
    np.testing.assert_allclose(np.asarray(logits_of(moe, x)), np.asarray(logits_of(dense, x)),
                               rtol=2e-5, atol=2e-5)
    chosen = upcycled_layers(L, rule)
    kinds = [type(b.ffn).__name__ for b in moe.blocks]
    want = "MoE" if rule.expert_form == "vanilla" else "DeRSMoE"
    assert kinds == [want if i in chosen else "DenseFFN" for i in range(L)]


def test_layer_selection_rules():
    assert upcycled_layers(6, UpcycleConfig()) == (1, 3, 5)
    assert upcycled_layers(6, UpcycleConfig(offset=0)) == (0, 2, 4)
    assert upcycled_layers(3, UpcycleConfig(blocks="all")) == (0, 1, 2)
    assert upcycled_layers(6, UpcycleConfig(blocks="list", block_list=(4, 2))) == (2, 4)
    with pytest.raises(ConfigError, match="block_list"):
        UpcycleConfig(blocks="list")
    with pytest.raises(ConfigError, match="expert_form"):
        UpcycleConfig(freeze_shared=True)
    # a DeRS-SM delta with no trainable position: refused with the rule, not when built
    with pytest.raises(ConfigError, match=r"sm_rate=1.0 must be in \[0, 1\)"):
        UpcycleConfig(expert_form="sm", sm_rate=1.0)


def test_a_rule_that_would_upcycle_nothing_is_refused():
    """Every other block from offset 1 of a one-block model, or an offset past the last
    block, chooses no block: the "MoE" would be the dense model, compared with itself. A
    block_list that blocks='all' or 'every_other' would ignore is refused too."""
    with pytest.raises(ValueError, match="offset=1 chooses no block of a 1-layer model"):
        upcycled_layers(1, UpcycleConfig())
    with pytest.raises(ValueError, match="offset=5 chooses no block of a 4-layer model"):
        upcycled_layers(4, UpcycleConfig(offset=5))
    assert upcycled_layers(1, UpcycleConfig(offset=0)) == (0,)
    for blocks in ("all", "every_other"):
        with pytest.raises(ConfigError, match=r"block_list=\(1,\) is read only with "
                                              "blocks='list'"):
            UpcycleConfig(blocks=blocks, block_list=(1,))


@pytest.mark.parametrize("scale", [False, True])
def test_vanilla_surgery_copies_dense_ffn_and_router_is_new(scale):
    dense = _dense()
    rule = UpcycleConfig(scale_outputs=scale,
                         moe=UPCYCLE_MOE.replace(universal_ffn=True, n_shared_experts=1))
    a = upcycle_model(dense, rule, jax.random.key(0))
    b = upcycle_model(dense, rule, jax.random.key(1))
    s = 1.0 / 3.0 if scale else 1.0  # default: plain copies, as in the papers
    for i in (1, 3):
        dffn, m = dense.blocks[i].ffn, a.blocks[i].ffn
        for w in ("w_gate", "w_up", "w_down"):
            ref = np.asarray(getattr(dffn, w)[...]) * (s if w == "w_down" else 1.0)
            got = np.asarray(getattr(m.experts, w)[...])
            assert got.shape == (4,) + ref.shape
            np.testing.assert_allclose(got, np.broadcast_to(ref, got.shape), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(getattr(m.universal, w)[...]), ref, rtol=1e-6)
        r_a, r_b = np.asarray(m.router.w_g[...]), np.asarray(b.blocks[i].ffn.router.w_g[...])
        assert r_a.shape == (D, 4) and not np.allclose(r_a, r_b)
    # non-FFN leaves are shared unchanged; the dense model is untouched
    np.testing.assert_array_equal(np.asarray(a.embed[...]), np.asarray(dense.embed[...]))
    np.testing.assert_array_equal(np.asarray(a.blocks[1].attn.w_q[...]),
                                  np.asarray(dense.blocks[1].attn.w_q[...]))
    assert type(dense.blocks[1].ffn).__name__ == "DenseFFN"
    # the layer at step 0: experts + universal + shared = (1 + 1 + 1) x FFN (plain copies)
    x = jax.random.normal(jax.random.key(5), (2, 5, D))
    y_dense = np.asarray(dense.blocks[1].ffn(x)[0])
    y_moe = np.asarray(a.blocks[1].ffn(x)[0])
    np.testing.assert_allclose(y_moe, y_dense * (1.0 if scale else 3.0), rtol=1e-4, atol=1e-5)


def test_fresh_optimizer_state_after_upcycling():
    moe = upcycle_model(_dense(), UpcycleConfig(), jax.random.key(0))
    tx = optax.adam(1e-3)
    _, state = init_train_state(moe, tx)
    mu = jax.tree.leaves(state.opt_state[0].mu)
    assert mu and all(float(jnp.abs(m).max()) == 0.0 for m in mu)
    assert int(state.step) == 0


def test_sm_indices_are_unique_fixed_buffers_and_only_values_train():
    rule = UpcycleConfig(expert_form="sm", sm_rate=0.75, freeze_shared=True)
    moe = upcycle_model(_dense(), rule, jax.random.key(3))
    ffn = moe.blocks[1].ffn
    idx = np.asarray(ffn.experts.idx_up[...])
    K = round(D * F * 0.25)
    assert idx.shape == (4, K) and idx.dtype == np.int32
    for row in idx:
        assert len(np.unique(row)) == K and row.min() >= 0 and row.max() < D * F
    assert not np.array_equal(idx[0], idx[1])  # a fresh draw per expert
    assert isinstance(ffn.experts.idx_up, DeRSIndex) and isinstance(ffn.base.w_up, DeRSFrozen)
    # one training step: values move, indices and the frozen shared weight do not
    tcfg = TrainConfig(steps=1, batch_size=2, lr=1e-2, weight_decay=0.1)
    tx = make_optimizer(tcfg)
    graphdef, state = init_train_state(moe, tx)
    step = make_train_step(graphdef, lm_loss_fn, tx, tcfg)
    x = np.asarray(_tokens(B=2, T=9))
    new, _ = step(state, {"inputs": x[:, :-1], "targets": x[:, 1:]})
    m2 = nnx.merge(graphdef, new.params, new.rest)
    f2 = m2.blocks[1].ffn
    assert float(jnp.abs(f2.experts.v_up[...]).max()) > 0
    np.testing.assert_array_equal(np.asarray(f2.experts.idx_up[...]), idx)
    np.testing.assert_array_equal(np.asarray(f2.base.w_up[...]), np.asarray(ffn.base.w_up[...]))


def _moe_oracle(ders: DeRSMoE, x_BTD):
    """Vanilla MoE with the DeRS-synthesised weights written in (numpy synthesis)."""
    cfg = ders.cfg.moe.replace(dispatch="dense")
    ref = MoE(cfg, D, rngs=nnx.Rngs(0))
    ref.router.w_g[...] = ders.router.w_g[...]
    for name in ("gate", "up", "down"):
        base = np.asarray(ders.base.get(name))
        ws = []
        for e in range(cfg.n_experts):
            if ders.cfg.form == "sm":
                flat = base.reshape(-1).copy()
                flat[np.asarray(ders.experts.__dict__[f"idx_{name}"][...][e])] += np.asarray(
                    getattr(ders.experts, f"v_{name}")[...][e])
                ws.append(flat.reshape(base.shape))
            else:
                a = np.asarray(getattr(ders.experts, f"a_{name}")[...][e])
                b = np.asarray(getattr(ders.experts, f"b_{name}")[...][e])
                ws.append(base + a @ b)
        getattr(ref.experts, f"w_{name}")[...] = jnp.asarray(np.stack(ws))
    return ref(x_BTD)[0]


@pytest.mark.parametrize("form", ["sm", "lm"])
def test_ders_forward_matches_numpy_synthesis(form):
    cfg = DeRSMoEConfig(moe=MoEConfig(n_experts=3, top_k=2, d_expert=F, dispatch="capacity",
                                      capacity_factor=3.0), form=form, sm_rate=0.5, lm_rank=2)
    m = DeRSMoE(cfg, D, rngs=nnx.Rngs(4))
    key = jax.random.key(5)
    for j, name in enumerate(("gate", "up", "down")):  # non-zero increments
        v = getattr(m.experts, f"{'v' if form == 'sm' else 'b'}_{name}")
        v[...] = 0.3 * jax.random.normal(jax.random.fold_in(key, j), v[...].shape)
    x = jax.random.normal(jax.random.key(6), (2, 5, D))
    np.testing.assert_allclose(np.asarray(m(x)[0]), np.asarray(_moe_oracle(m, x)),
                               rtol=1e-4, atol=1e-5)


def test_exact_parameter_counts():
    dense = _dense()
    n_dense = 64 * D + L * (4 * D * D + 2 * D + 3 * D * F) + D
    mats = 3 * D * F
    router = 2 * D * 4  # two MoE layers, 4 experts
    van = param_report(dense, upcycle_model(dense, UpcycleConfig(), jax.random.key(0)))
    assert van["dense"] == n_dense
    assert van["added"] == 2 * (3 * mats) + router and van["index"] == 0
    K = round(D * F * 0.1)
    sm_rule = UpcycleConfig(expert_form="sm", sm_rate=0.9)
    sm = param_report(dense, upcycle_model(dense, sm_rule, jax.random.key(0)))
    assert sm["added"] == 2 * (4 * 3 * K) + router
    assert sm["index"] == 2 * 4 * 3 * K and sm["added_with_index"] == sm["added"] + sm["index"]
    assert sm["stored"] == sm["weights"] + sm["index"] == n_dense + sm["added_with_index"]
    assert sm["trainable"] == n_dense + sm["added"]
    lm_rule = UpcycleConfig(expert_form="lm", lm_rank=2, freeze_shared=True)
    lm = param_report(dense, upcycle_model(dense, lm_rule, jax.random.key(0)))
    inc = 4 * 2 * 3 * (D + F)
    assert lm["added"] == 2 * inc + router
    assert lm["trainable"] == n_dense - 2 * mats + 2 * inc + router  # shared weight frozen
    c = ders_param_counts(DeRSMoEConfig(moe=MoEConfig(d_expert=F), form="lm", lm_rank=2,
                                        freeze_shared=True), D)
    assert c == {"shared": mats, "increments": inc, "index": 0, "trainable": inc,
                 "vanilla": 4 * mats}


def _sizes(layer, kind, *prefixes) -> int:
    return sum(int(np.size(x)) for k, x in named_leaves(nnx.state(layer, kind))
               if k.startswith(prefixes))


@pytest.mark.parametrize("cfg", [
    DeRSMoEConfig(moe=MoEConfig(n_experts=4, d_expert=F, universal_ffn=True), form="sm",
                  sm_rate=0.93, extended=True),
    DeRSMoEConfig(moe=MoEConfig(n_experts=3, d_expert=F, activation="gelu"), form="sm",
                  sm_rate=0.5, freeze_shared=True),
    DeRSMoEConfig(moe=MoEConfig(n_experts=4, d_expert=F, universal_ffn=True), form="lm",
                  lm_rank=3, extended=True),
])
def test_ders_param_counts_are_the_layers_own_arrays(cfg):
    """The exact counts (DeRS Sec. 3.4) against the arrays a built layer holds: W_shared, the
    N (+1 extended) increments, the SM index vectors, N (+1) dense copies for vanilla."""
    layer = cfg.build(D, rngs=nnx.Rngs(0))
    shared = _sizes(layer, ...,  "base/")
    inc = _sizes(layer, nnx.Param, "experts/", "universal/")
    index = _sizes(layer, DeRSIndex, "experts/", "universal/")
    trainable = _sizes(layer, nnx.Param, "base/", "experts/", "universal/")
    n = cfg.moe.n_experts + cfg.extended
    assert ders_param_counts(cfg, D) == {"shared": shared, "increments": inc, "index": index,
                                         "trainable": trainable, "vanilla": n * shared}
    assert (index > 0) == (cfg.form == "sm") and (trainable == inc) == cfg.freeze_shared


def test_ders_starting_weights_have_their_stated_scales():
    """DeRS-SM keeps round(d_in d_out (1 - p)) positions (7 x 7 x 0.1 = 4.9 -> 5); a
    DeRS-LM A starts at std d_in^-1/2 and a from-scratch W_shared at fan-in^-1/2, for the
    up (d_in = D) and the down (d_in = F) matrices alike."""
    assert sm_num_kept(7, 7, 0.9) == 5
    cfg = DeRSMoEConfig(moe=MoEConfig(n_experts=8, d_expert=4 * F), form="lm", lm_rank=16)
    layer = cfg.build(D, rngs=nnx.Rngs(0))
    for name, d_in in (("up", D), ("down", 4 * F)):
        a = np.asarray(getattr(layer.experts, f"a_{name}")[...])
        w = np.asarray(layer.base.get(name))
        np.testing.assert_allclose(a.std(), d_in ** -0.5, rtol=0.1)
        np.testing.assert_allclose(w.std(), d_in ** -0.5, rtol=0.1)


def test_split_upcycling_partitions_neurons():
    """Llama-MoE neuron split: N experts of F/N neurons each (total FFN parameters unchanged);
    with uniform gates (zero router) the ALL-experts mixture is the dense model exactly, and
    every hidden neuron lands in exactly one expert."""
    rule = UpcycleConfig(expert_form="split", blocks="all", router_init="zeros",
                         moe=UPCYCLE_MOE.replace(n_experts=4, top_k=2, dispatch="dense"))
    dense = _dense()
    moe = upcycle_model(dense, rule, jax.random.key(3))
    x = _tokens()
    ref, _ = dense(x)
    out, _ = with_routing(moe, RoutingMode(mode="all"))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    up = np.asarray(moe.blocks[0].ffn.experts.w_up[...])  # [E, D, F/E]
    assert up.shape == (4, D, F // 4)
    dense_up = np.asarray(dense.blocks[0].ffn.w_up[...])
    cols = [int(np.flatnonzero((dense_up == up[e][:, j:j + 1]).all(0))[0])
            for e in range(4) for j in range(F // 4)]
    assert sorted(cols) == list(range(F))
    assert cols != list(range(F))  # a random partition (Llama-MoE), drawn from the key
    other = upcycle_model(dense, rule, jax.random.key(4)).blocks[0].ffn.experts.w_up[...]
    assert not np.array_equal(np.asarray(other), up)
    # only the routers are added: 4 layers x D x N
    assert param_report(dense, moe)["added"] == L * D * 4
    # a universal FFN and a shared expert are whole copies of the dense FFN (width F, not
    # F/N); with scale_outputs every w_down is scaled by s = 1/3 (N s for the split experts),
    # so the ALL-experts mixture plus both copies is still the dense model
    uni = rule.replace(scale_outputs=True, moe=rule.moe.replace(universal_ffn=True,
                                                                n_shared_experts=1))
    both = upcycle_model(dense, uni, jax.random.key(3))
    assert both.blocks[0].ffn.universal.w_up[...].shape == (D, F)
    assert both.blocks[0].ffn.shared.w_up[...].shape == (D, F)
    out, _ = with_routing(both, RoutingMode(mode="all"))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="equal groups"):
        upcycle_model(dense, rule.replace(moe=rule.moe.replace(n_experts=5)), jax.random.key(0))


def test_ders_lm_increments_start_at_a_random_a_and_a_zero_b():
    """DeRS-LM: ``A ~ N(0, 1/d_in)`` by default (``lm_init_std`` otherwise), ``B = 0``, so the
    upcycled model is the dense one at step 0 while A's gradient path is open."""
    for std, want in ((None, D ** -0.5), (0.1, 0.1)):
        rule = UpcycleConfig(expert_form="lm", lm_rank=4, blocks="all", lm_init_std=std,
                             moe=UPCYCLE_MOE.replace(n_experts=8))
        ffn = upcycle_model(_dense(), rule, jax.random.key(0)).blocks[0].ffn.experts
        a = np.concatenate([np.asarray(ffn.a_up[...]).ravel(), np.asarray(ffn.a_gate[...]).ravel()])
        assert abs(a.std() / want - 1) < 0.1 and abs(a.mean()) < 0.1 * want
        assert not np.asarray(ffn.b_up[...]).any() and not np.asarray(ffn.b_down[...]).any()


def test_expert_bytes_per_token_by_hand():
    """Batch-1 expert bytes: vanilla reads its k experts; DeRS "selected" reads W_shared once
    and k increments (SM: K float32 values and K int32 positions per matrix); "all" reads
    W_shared and N increments and writes then reads N dense copies."""
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=F, activation="swiglu")
    dense = 3 * D * F * 4
    assert expert_bytes_per_token(moe, D) == 2 * dense
    K = sm_num_kept(D, F, 0.9)
    sm = DeRSMoEConfig(moe=moe, form="sm", sm_rate=0.9, synthesis="selected")
    assert expert_bytes_per_token(sm, D) == dense + 2 * 3 * K * 8
    lm = DeRSMoEConfig(moe=moe, form="lm", lm_rank=2, synthesis="all")
    assert expert_bytes_per_token(lm, D) == dense + 4 * (2 * 3 * (D + F) * 4) + 2 * 4 * dense


@pytest.mark.parametrize("kw, words", [
    (dict(sm_rate=1.0), "sm_rate=1.0 must be in"),
    (dict(extended=True, moe=MoEConfig(d_expert=F, universal_ffn=True, d_universal=2 * F)),
     "extended=True needs d_universal == d_expert"),
])
def test_ders_settings_it_cannot_build_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        DeRSMoEConfig(**kw)


def test_each_layer_and_matrix_draws_its_own_new_weights():
    """The new router ~ N(0, router_init_std^2) (a noisy router's noise weights 0), drawn per
    layer; DeRS increments drawn per matrix (SM positions, LM A's)."""
    rule = UpcycleConfig(blocks="all", router_init_std=0.5,
                         moe=UPCYCLE_MOE.replace(n_experts=8, router="noisy"))
    moe = upcycle_model(_dense(), rule, jax.random.key(0))
    w = [np.asarray(moe.blocks[i].ffn.router.w_g[...]) for i in range(L)]
    np.testing.assert_allclose(np.std(np.stack(w)), 0.5, rtol=0.1)
    assert not np.array_equal(w[0], w[1])
    assert not np.asarray(moe.blocks[0].ffn.router.w_noise[...]).any()
    for form in ("sm", "lm"):
        ders = upcycle_model(_dense(), UpcycleConfig(expert_form=form,
                                                     **({"sm_rate": 0.5} if form == "sm" else {})),
                             jax.random.key(0))
        ex = ders.blocks[1].ffn.experts
        drawn = "idx" if form == "sm" else "a"
        gate, up = (np.asarray(getattr(ex, f"{drawn}_{n}")[...]) for n in ("gate", "up"))
        assert not np.array_equal(gate, up), form


def test_model_variables_sort_every_element_into_one_kind():
    frozen = upcycle_model(_dense(), UpcycleConfig(expert_form="sm", sm_rate=0.5,
                                                   freeze_shared=True), jax.random.key(0))
    v = model_variables(frozen)
    assert v["frozen"] > 0 and v["index"] > 0 and v["other"] == 0


def test_a_negative_layer_offset_is_refused():
    with pytest.raises(ConfigError, match="offset=-1 must be >= 0"):
        UpcycleConfig(offset=-1)


@pytest.mark.parametrize("kw, words", [
    ({"blocks": "all", "offset": 0}, "offset=0 is read only with blocks='every_other'"),
    ({"blocks": "list", "block_list": (1,), "offset": 3}, "offset=3 is read only with"),
    ({"expert_form": "split", "sm_rate": 0.9}, "sm_rate=0.9 is read only with expert_form='sm'"),
    ({"expert_form": "sm", "lm_rank": 8}, "lm_rank=8 is read only with expert_form='lm'"),
    ({"expert_form": "vanilla", "lm_init_std": 0.1}, "lm_init_std=0.1 is read only with"),
    ({"router_init": "zeros", "router_init_std": 0.5},
     "router_init_std=0.5 is read only with router_init='normal'"),
    ({"moe": UPCYCLE_MOE.replace(d_expert=64)}, "moe.d_expert=64: the experts take it from "
                                                "the dense FFN"),
    ({"moe": UPCYCLE_MOE.replace(activation="gelu")}, "moe.activation='gelu': the experts"),
])
def test_a_setting_only_another_rule_reads_is_refused(kw, words):
    """As block_list outside blocks='list': a setting the rule ignores, changed from its
    default, is refused (moe_kd's upcycle.sm_rate=0.9 with its split experts was taken and
    recorded, and did nothing); at its default, or under the rule that reads it, it is taken."""
    with pytest.raises(ConfigError, match=words):
        UpcycleConfig(**kw)
    UpcycleConfig(**{k: v for k, v in kw.items()
                     if k in ("blocks", "block_list", "expert_form", "router_init")})
    if "moe" in kw:  # the dense FFN's width and activation, whatever the slot's defaults
        slot = moe_slot_config(UpcycleConfig(), DenseFFNConfig(d_hidden=24, activation="gelu"))
        assert (slot.d_expert, slot.activation) == (24, "gelu")
    assert UpcycleConfig(offset=0).offset == 0 and UpcycleConfig(
        expert_form="lm", lm_rank=8, lm_init_std=0.1).lm_rank == 8


@pytest.mark.parametrize("form, extended", [("lm", False), ("sm", True)])
def test_ders_inference_holds_one_layers_synthesised_experts_at_a_time(form, extended):
    """DeRS synthesises each layer's experts on the fly (Sec. 3.4): the compiled forward's
    peak memory stays under vanilla upcycling's, whose every expert copy is stored. Were
    every layer's copies synthesised up front (they depend on the parameters alone), all
    of them would be live at once beside the stored model: more than vanilla's weights
    (8 MoE layers of 4 SwiGLU experts of 64 x 256, 6.3 MB of copies)."""
    cfg = dense_decoder_config(vocab_size=64, d_model=64, n_layers=8, n_heads=2,
                               d_hidden=256, max_seq_len=32)
    dense = DecoderLM(cfg, rngs=nnx.Rngs(0))
    moe = UPCYCLE_MOE.replace(n_experts=4, top_k=2, universal_ffn=extended)
    tokens = _tokens(B=2, T=16)

    def peak(rule):
        g, p, r = nnx.split(upcycle_model(dense, rule, jax.random.key(0)), nnx.Param, ...)
        forward = jax.jit(lambda p, r: nnx.merge(g, p, r)(tokens)[0])
        return compiled_memory(forward.lower(p, r).compile())["peak_bytes"]

    rule = UpcycleConfig(blocks="all", moe=moe, extended=False)
    vanilla = peak(rule)
    ders = peak(rule.replace(expert_form=form, extended=extended, sm_rate=0.99))
    assert ders < vanilla, (ders, vanilla)
