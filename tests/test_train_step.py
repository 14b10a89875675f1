"""Train step: gradient accumulation == big batch, bf16 compute with fp32 master params,
non-finite guard (no update applied, NonFiniteError with step/what/fix), lm_loss_fn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.ops.losses import cross_entropy
from moejax.train import train
from moejax.train.collectives import collective_bytes
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import (
    NonFiniteError,
    _split_micro,
    check_finite,
    init_state,
    init_train_state,
    injected_lr,
    lm_loss_fn,
    make_eval_step,
    make_step_fn,
    make_train_step,
    per_step_schedule,
    tree_all_finite,
    updates_per_batch,
)
from tests.toy_models import TinyMoELM, ToySource, tree_equal, tree_max_diff

CFG = TrainConfig(steps=10, batch_size=8, lr=1e-2, warmup_steps=2, schedule="cosine")


def _setup(cfg, noise=0.0):
    tx = make_optimizer(cfg)
    graphdef, state = init_train_state(TinyMoELM(nnx.Rngs(0), noise=noise), tx, seed=0)
    step = make_train_step(graphdef, lm_loss_fn, tx, cfg, schedule=make_schedule(cfg))
    return graphdef, state, step


def test_grad_accumulation_equals_big_batch_step():
    src = ToySource(batch_size=8)
    _, s_big, step_big = _setup(CFG)
    _, s_acc, step_acc = _setup(CFG.replace(grad_accum=4))
    for pos in range(2):
        s_big, m_big = step_big(s_big, src.batch(pos))
        s_acc, m_acc = step_acc(s_acc, src.batch(pos))
        np.testing.assert_allclose(m_acc["loss"], m_big["loss"], rtol=1e-5)
        np.testing.assert_allclose(m_acc["grad_norm"], m_big["grad_norm"], rtol=1e-4)
        np.testing.assert_allclose(m_acc["ce"], m_big["ce"], rtol=1e-5)
    assert tree_max_diff(s_acc.params, s_big.params) < 1e-5
    assert tree_max_diff(s_acc.opt_state, s_big.opt_state) < 1e-5
    assert int(s_acc.step) == 2 and float(m_big["lr"]) == pytest.approx(1e-2)


def test_bf16_compute_keeps_fp32_master_params_and_opt_state():
    cfg = CFG.replace(precision="bfloat16")
    graphdef, state, step = _setup(cfg, noise=0.1)
    src = ToySource(batch_size=8)
    losses = []
    for pos in range(4):
        state, m = step(state, src.batch(pos))
        losses.append(float(m["loss"]))
        assert bool(m["finite"])
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    # the forward really ran in bf16: the loss differs from the fp32 forward at step 0
    _, s32, step32 = _setup(CFG, noise=0.1)
    _, m32 = step32(s32, src.batch(0))
    assert abs(float(m32["loss"]) - losses[0]) > 0
    assert abs(float(m32["loss"]) - losses[0]) < 0.05
    assert losses[-1] < losses[0]  # and it trains
    ev = make_eval_step(graphdef, lm_loss_fn, "bfloat16")(
        state.params, state.rest, src.batch(0), jax.random.key(0)
    )
    assert np.isfinite(float(ev["loss"]))


def test_non_finite_step_is_not_applied_and_error_names_step_and_fix():
    graphdef, state, step = _setup(CFG)
    src = ToySource(batch_size=8)
    state, _ = step(state, src.batch(0))
    # inject a NaN into one parameter's forward via the loss: a NaN mask weight
    bad = dict(src.batch(1))
    bad["mask"] = bad["mask"].copy()
    bad["mask"][0, 0] = np.nan
    new, m = step(state, bad)
    assert not bool(m["finite"])
    assert tree_equal(new.params, state.params)  # corrupt update NOT applied
    assert tree_equal(new.opt_state, state.opt_state)
    assert int(new.step) == int(state.step)
    with pytest.raises(NonFiniteError) as e:
        check_finite(jax.device_get(m), step=1, data_position=1)
    msg = str(e.value)
    assert "step 1" in msg and "loss=nan" in msg and "grad_clip" in msg and "lr" in msg
    assert "data position 1" in msg
    # a finite batch afterwards proceeds normally
    new2, m2 = step(new, src.batch(1))
    assert bool(m2["finite"]) and int(new2.step) == 2


def test_explicit_keys_make_steps_deterministic_and_key_advances():
    _, s0, step = _setup(CFG, noise=0.5)
    b = ToySource(batch_size=8).batch(0)
    a1, ma = step(s0, b)
    a2, mb = step(s0, b)
    assert float(ma["loss"]) == float(mb["loss"]) and tree_equal(a1.params, a2.params)
    assert not np.array_equal(np.asarray(a1.key), np.asarray(s0.key))
    assert a1.key.dtype == jnp.uint32


class _SpyLM(nnx.Module):
    """Records the keyword arguments of its last call; logits = 0."""

    def __init__(self):
        self.seen = {}

    def __call__(self, tokens_BT, *, train=False, key=None, mask_BT=None, **kw):
        object.__setattr__(self, "seen", dict(kw, mask_BT=mask_BT))
        return jnp.zeros(tokens_BT.shape + (8,), jnp.float32), {}


def test_lm_loss_fn_passes_segment_ids_and_positions_only_when_present():
    toks = np.arange(12, dtype=np.int32).reshape(2, 6) % 8
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    pos = np.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]], np.int32)
    mask = (seg > 0).astype(np.float32)
    spy = _SpyLM()
    loss, m = lm_loss_fn(spy, {"inputs": toks, "targets": toks, "mask": mask,
                               "segment_ids": seg, "positions": pos}, None, train=False)
    np.testing.assert_array_equal(np.asarray(spy.seen["segment_ids_BT"]), seg)
    np.testing.assert_array_equal(np.asarray(spy.seen["positions_BT"]), pos)
    np.testing.assert_array_equal(np.asarray(spy.seen["mask_BT"]), seg > 0)
    np.testing.assert_allclose(float(loss), np.log(8.0), rtol=1e-6)  # uniform logits
    lm_loss_fn(spy, {"inputs": toks, "targets": toks}, None, train=False)
    assert spy.seen == {"mask_BT": None}


def test_lm_loss_fn_never_shows_the_loss_mask_to_the_model():
    """A prompt/response batch's loss mask covers only the response: the model must still
    attend to the prompt, so the loss equals the CE of the unmasked forward's logits on the
    response positions (the mask hiding the prompt keys gives a different loss)."""
    lm = DecoderLM(dense_decoder_config(vocab_size=16, d_model=16, n_layers=2, n_heads=2,
                                        d_hidden=24, max_seq_len=16, init_std=0.5),
                   rngs=nnx.Rngs(0))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 9)), jnp.int32)
    mask = np.zeros((2, 8), np.float32)
    mask[:, 5:] = 1  # the response: the last three targets
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": mask}
    loss, _ = lm_loss_fn(lm, batch, None, train=False)
    want = cross_entropy(lm(toks[:, :-1])[0], toks[:, 1:], mask)
    hidden = cross_entropy(lm(toks[:, :-1], mask_BT=mask > 0)[0], toks[:, 1:], mask)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert abs(float(hidden) - float(want)) > 1e-3  # the test can tell the two apart
    spy = _SpyLM()
    lm_loss_fn(spy, {**batch, "token_mask": np.ones((2, 8), np.float32)}, None, train=False)
    np.testing.assert_array_equal(np.asarray(spy.seen["mask_BT"]), np.ones((2, 8), bool))


def test_lm_loss_fn_on_packed_batch_equals_documents_alone():
    """A packed row of two documents (segment ids + restarted positions) has the same
    token-summed CE as the two documents run as separate rows."""
    cfg = dense_decoder_config(vocab_size=16, d_model=16, n_layers=2, n_heads=2, d_hidden=24,
                               max_seq_len=16, init_std=0.5)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    d1, d2 = rng.integers(0, 16, 5).astype(np.int32), rng.integers(0, 16, 6).astype(np.int32)
    # inputs: d1[:-1], d2[:-1], one padding token; targets: the next token within the
    # document (the last token of each document predicts nothing)
    inputs = np.concatenate([d1[:-1], d2[:-1], [0]])[None].astype(np.int32)
    targets = np.concatenate([d1[1:], d2[1:], [0]])[None].astype(np.int32)
    seg = np.array([[1] * 4 + [2] * 5 + [0]], np.int32)
    pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0]], np.int32)
    mask = (seg > 0).astype(np.float32)
    packed = {"inputs": inputs, "targets": targets, "mask": mask, "segment_ids": seg,
              "positions": pos}
    loss = nnx.jit(lambda m, b: lm_loss_fn(m, b, None, train=False))  # whole, not op by op
    _, m = loss(model, packed)
    ce_sum = 0.0
    for d in (d1, d2):
        _, md = loss(model, {"inputs": d[None, :-1], "targets": d[None, 1:]})
        ce_sum += float(md["ce"]) * (len(d) - 1)
    np.testing.assert_allclose(float(m["ce"]) * float(mask.sum()), ce_sum, rtol=1e-5)
    # dropping the ids (plain causal attention across the boundary) changes the loss
    _, m_leak = loss(model, {k: v for k, v in packed.items()
                             if k not in ("segment_ids", "positions")})
    assert abs(float(m_leak["ce"]) - float(m["ce"])) > 1e-5


def test_collective_bytes_reads_result_shapes_and_skips_single_device_groups():
    hlo = "\n".join([
        "  %a = f32[2,4]{1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1}}",
        "  %b = (f32[8]{0}, bf16[4,2]{1,0}) all-reduce(%p, %q), replica_groups={{0},{1}}",
        "  %c = bf16[16]{0} all-reduce-start(%r), replica_groups={{0,1},{2,3}}",
        "  %d = s32[3]{0} all-gather(%s), dimensions={0}",
        "  %e = f32[2]{0} add(%u, %v)",
    ])
    assert collective_bytes(hlo) == {"all-to-all": 32, "all-reduce": 32, "all-gather": 12}
    # the iota and mesh-axis notations of newer XLA: groups of one device move nothing
    hlo = "\n".join([
        "  %f = f32[4]{0} all-reduce(%w), replica_groups=[8,1]<=[8], to_apply=%add",
        "  %g = f32[2]{0} all-reduce(%w), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add",
        "  %h = (f32[2,3]{1,0}, f32[5]{0}) all-reduce(%p, %q), channel_id=1, "
        "replica_groups=mesh['data'=1,'expert'=8] {'data'}, use_global_device_ids=true",
        "  %i = s32[10]{0} all-to-all(%x), replica_groups=mesh['data'=1,'expert'=8] {'expert'}",
        "  %j = f32[3]{0} all-gather(%x), replica_groups=mesh['data'=2,'expert'=4] "
        "{'data','expert'}, dimensions={0}",
    ])
    assert collective_bytes(hlo) == {"all-reduce": 8, "all-to-all": 40, "all-gather": 12}


class _ThreeUpdates:
    """A toy loss taking three updates per batch on one prepared batch: the target is the
    batch's ``y`` shifted by a key-dependent offset (prepare), and each update's key adds
    its own term (so a reused key would show)."""

    updates_per_batch = 3

    def prepare(self, params, batch, key):
        return {**batch, "y": batch["y"] + jax.random.normal(key, batch["y"].shape)}

    def __call__(self, params, batch, key):
        r = jax.random.normal(key, ())
        return jnp.sum((params["w"] - batch["y"]) ** 2) + r * jnp.sum(params["w"])


def test_several_updates_per_batch_equal_sequential_sgd_on_one_prepared_batch():
    """The oracle: prepare once with the step's first key, then three plain SGD updates, the
    m-th with fold_in(key, m); the step's metrics are the updates' mean."""
    import optax

    lr = 0.1
    cfg = TrainConfig(steps=4, lr=lr, schedule="constant", warmup_steps=0)
    tx = optax.sgd(lr)
    params = {"w": jnp.arange(3.0)}
    batch = {"y": jnp.ones(3)}
    state = init_state(params, None, tx, seed=7)
    new, metrics = jax.jit(make_step_fn(None, _ThreeUpdates(), tx, cfg))(state, batch)
    _, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
    prep_key, step_key = jax.random.split(step_key)
    prepared = _ThreeUpdates().prepare(params, batch, prep_key)
    w, losses = params["w"], []
    for m in range(3):
        k = jax.random.fold_in(step_key, m)
        loss, g = jax.value_and_grad(lambda w, k=k: _ThreeUpdates()({"w": w}, prepared, k))(w)
        losses.append(loss)
        w = w - lr * g
    np.testing.assert_allclose(new.params["w"], w, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-5)
    assert int(new.step) == 1 and updates_per_batch(_ThreeUpdates()) == 3
    sched = per_step_schedule(lambda t: 10.0 * t, 3)  # every update of a step at its lr
    assert [sched(c) for c in range(6)] == [0, 0, 0, 10, 10, 10]
    with pytest.raises(ValueError, match="updates_per_batch"):
        updates_per_batch(type("L", (), {"updates_per_batch": 0})())
    # the updates are one loop: the step's program is the same size for 3 updates as for 30
    many = type("Many", (_ThreeUpdates,), {"updates_per_batch": 30})()
    sizes = [len(jax.make_jaxpr(make_step_fn(None, loss, tx, cfg))(state, batch).eqns)
             for loss in (_ThreeUpdates(), many)]
    assert sizes[0] == sizes[1], sizes


def test_lm_loss_fn_adds_the_models_aux_loss_and_scores_accuracy_on_the_mask():
    """loss = masked CE + the model's aux loss; accuracy counts the masked positions only
    (here every unmasked position is right and every masked one wrong)."""

    class Fixed(nnx.Module):
        def __call__(self, tokens_BT, *, train=False, key=None, mask_BT=None, **kw):
            logits = jax.nn.one_hot(tokens_BT, 8) * 5.0
            return logits, {"aux_loss": jnp.asarray(0.25), "balance": jnp.asarray(2.0)}

    toks = np.arange(12, dtype=np.int32).reshape(2, 6) % 8
    targets = toks.copy()
    mask = np.zeros((2, 6), np.float32)
    mask[:, 4:] = 1
    targets[:, 4:] = (toks[:, 4:] + 1) % 8  # wrong where scored
    loss, m = lm_loss_fn(Fixed(), {"inputs": toks, "targets": targets, "mask": mask}, None)
    assert float(m["accuracy"]) == 0.0 and float(m["aux_loss"]) == 0.25
    np.testing.assert_allclose(float(loss), float(m["ce"]) + 0.25, rtol=1e-6)
    assert float(m["aux/balance"]) == 2.0


def test_a_non_finite_gradient_of_a_finite_loss_is_not_applied():
    """sqrt at 0 has a finite value and an infinite gradient: the step is flagged and not
    applied, like a non-finite loss."""
    cfg = TrainConfig(steps=2, batch_size=1, lr=1e-2, grad_clip=0.0)
    tx = make_optimizer(cfg)
    loss = lambda p, batch, key: jnp.sum(jnp.sqrt(p["w"]))  # noqa: E731
    params = {"w": jnp.zeros(3)}
    state = init_state(params, None, tx)
    step = make_train_step(None, loss, tx, cfg)
    new, m = step(state, {"x": np.zeros((1, 1), np.float32)})
    assert np.isfinite(float(m["loss"])) and not bool(m["finite"])
    assert tree_equal(new.params, state.params) and int(new.step) == 0


def test_the_logged_rate_is_the_one_the_update_used():
    """Warmup over 4 steps: step t's update uses lr (t + 1) / 4, and logs it."""
    cfg = CFG.replace(warmup_steps=4, schedule="constant")
    _, state, step = _setup(cfg)
    src = ToySource(batch_size=8)
    for t in range(3):
        state, m = step(state, src.batch(t))
        assert float(m["lr"]) == pytest.approx(1e-2 * (t + 1) / 4)


def test_each_micro_batch_draws_its_own_randomness():
    """A loss that is one uniform draw: two micro-batches average two draws, which differ
    from the one draw of the whole batch (the same key twice would give that draw back)."""
    loss = lambda p, batch, key: jnp.sum(p["w"]) * jax.random.uniform(key)  # noqa: E731
    params = {"w": jnp.ones(3)}
    batch = {"x": np.zeros((2, 1), np.float32)}
    out = {}
    for n in (1, 2):
        cfg = TrainConfig(steps=2, batch_size=2, lr=1e-2, grad_accum=n)
        tx = make_optimizer(cfg)
        _, m = make_train_step(None, loss, tx, cfg)(init_state(params, None, tx), batch)
        out[n] = float(m["loss"])
    assert abs(out[2] - out[1]) > 1e-4, out


def test_a_non_finite_loss_with_finite_gradients_is_not_applied():
    """A loss whose non-finite part carries no gradient: the step is still flagged and not
    applied."""
    cfg = TrainConfig(steps=2, batch_size=1, lr=1e-2, grad_clip=0.0)
    tx = make_optimizer(cfg)
    loss = lambda p, batch, key: jnp.sum(p["w"] ** 2) + jax.lax.stop_gradient(  # noqa: E731
        jnp.inf)
    state = init_state({"w": jnp.ones(3)}, None, tx)
    new, m = make_train_step(None, loss, tx, cfg)(state, {"x": np.zeros((1, 1), np.float32)})
    assert np.isfinite(float(m["grad_norm"])) and not bool(m["finite"])
    assert tree_equal(new.params, state.params) and int(new.step) == 0


class _FirstUpdateNotFinite:
    """Two updates per batch; the first (at w = 0) reports an infinite loss that carries no
    gradient, the second (w moved away from 0) a finite one."""

    updates_per_batch = 2

    def __call__(self, params, batch, key):
        w = params["w"]
        bad = jax.lax.stop_gradient(jnp.where(jnp.all(w == 0), jnp.inf, 0.0))
        return jnp.sum((w - 1.0) ** 2) + bad


def test_a_step_of_several_updates_is_not_applied_when_any_update_is_not_finite():
    import optax

    cfg = TrainConfig(steps=2, lr=0.1, schedule="constant", warmup_steps=0)
    tx = optax.sgd(0.1)
    state = init_state({"w": jnp.zeros(3)}, None, tx)
    new, m = jax.jit(make_step_fn(None, _FirstUpdateNotFinite(), tx, cfg))(state, {})
    assert not bool(m["finite"])
    assert tree_equal(new.params, state.params) and int(new.step) == 0


def test_micro_batches_interleave_the_rows():
    """Micro-batch i of A holds rows i, i + A, i + 2A, ... (a batch sharded over devices keeps
    each micro-batch spread over all of them)."""
    micro = _split_micro({"x": jnp.arange(8)[:, None]}, 2)["x"]
    np.testing.assert_array_equal(micro[:, :, 0], [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_the_logged_rate_is_left_out_when_several_transforms_inject_one():
    import optax

    tx = optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                     optax.inject_hyperparams(optax.sgd)(learning_rate=0.2))
    params = {"w": jnp.ones(2)}
    assert injected_lr(tx.init(params)) is None
    one = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)
    assert float(injected_lr(one.init(params))) == pytest.approx(0.3)


def test_only_scalar_float_aux_entries_become_metrics():
    class WithAux(nnx.Module):
        def __call__(self, tokens_BT, *, train=False, key=None, mask_BT=None, **kw):
            return jax.nn.one_hot(tokens_BT, 8), {
                "load": jnp.ones(4), "count": jnp.asarray(3), "balance": jnp.asarray(2.0)}

    toks = np.zeros((1, 4), np.int32)
    _, m = lm_loss_fn(WithAux(), {"inputs": toks, "targets": toks}, None)
    assert sorted(m) == ["accuracy", "aux/balance", "aux_loss", "ce"]


def test_every_floating_leaf_is_checked_for_finiteness():
    good = {"a": jnp.ones(3), "b": jnp.zeros(2), "i": jnp.arange(2)}
    assert bool(tree_all_finite(good))
    for leaf in ("a", "b"):
        bad = {**good, leaf: good[leaf].at[-1].set(jnp.nan)}
        assert not bool(tree_all_finite(bad)), leaf
    assert bool(tree_all_finite({"i": jnp.arange(2)}))


def test_a_loss_mask_of_another_shape_than_the_targets_is_refused_before_a_step(tmp_path):
    """A ``[B, 1]`` loss mask broadcast over the targets counted every token of a row and
    divided by the rows: the loss was T times too large, silently. The loop now stops at the
    first step's trace, naming both shapes."""
    model = TinyMoELM(rngs=nnx.Rngs(0))
    src = ToySource()
    b = src.batch(0)

    class OneWeightPerRow:
        def batch(self, position):
            return dict(src.batch(position), mask=np.ones((b["targets"].shape[0], 1),
                                                          np.float32))

    with pytest.raises(ValueError, match=r"cross_entropy: a mask of shape \(\d+, 1\) for "
                       r"positions of shape \(\d+, \d+\)"):
        train(model, OneWeightPerRow(), TrainConfig(steps=1, batch_size=b["targets"].shape[0]),
              run_dir=str(tmp_path / "run"))
