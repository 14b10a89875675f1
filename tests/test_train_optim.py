"""Losses (masked CE / accuracy), TrainConfig validation, schedules, optimizer chain."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.config import ConfigError, from_json, to_json
from moejax.ops.losses import accuracy, cross_entropy
from moejax.train.hparams import TrainConfig, decay_mask, make_optimizer, make_schedule
from tests.toy_models import TinyMoELM


def test_cross_entropy_masked_mean_matches_numpy_and_bf16_is_fp32():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32) * 3
    targets = rng.integers(0, 5, size=(2, 3))
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    lse = np.log(np.exp(logits).sum(-1))
    ce = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    want = (ce * mask).sum() / mask.sum()
    got = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # padding positions do not matter at all
    logits2 = logits.copy()
    logits2[0, 2] = 1e4
    np.testing.assert_allclose(cross_entropy(logits2, targets, mask), want, rtol=1e-6)
    # bf16 logits: the reduction runs in fp32
    got16 = cross_entropy(jnp.asarray(logits, jnp.bfloat16), targets, mask)
    assert got16.dtype == jnp.float32
    np.testing.assert_allclose(got16, want, rtol=2e-2)
    # all-padding batch: 0, not NaN
    assert float(cross_entropy(logits, targets, np.zeros_like(mask))) == 0.0
    acc = accuracy(logits, targets, mask)
    hit = (logits.argmax(-1) == targets).astype(np.float32)
    np.testing.assert_allclose(acc, (hit * mask).sum() / mask.sum())


def test_config_validation_names_field_and_roundtrips():
    with pytest.raises(ConfigError, match="schedule"):
        TrainConfig(schedule="exponential")
    with pytest.raises(ConfigError, match="grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)
    with pytest.raises(ConfigError, match="optimizer='adamw'"):
        TrainConfig(optimizer="adam", weight_decay=0.1)
    with pytest.raises(ConfigError, match="mesh_data and mesh_expert"):
        TrainConfig(mesh_data=-1, mesh_expert=-1)
    with pytest.raises(ConfigError, match="wsd"):
        TrainConfig(schedule="wsd", steps=10, warmup_steps=5, decay_fraction=0.8)
    # a schedule setting the schedule never reads (taken before: recorded and ignored)
    with pytest.raises(ConfigError, match="decay_fraction=0.2 is read only with schedule='wsd'"):
        TrainConfig(schedule="cosine", decay_fraction=0.2)
    with pytest.raises(ConfigError, match="min_lr_ratio=0.0: schedule='constant' never decays"):
        TrainConfig(schedule="constant", min_lr_ratio=0.0)
    assert TrainConfig(schedule="linear", min_lr_ratio=0.0).min_lr_ratio == 0.0
    cfg = TrainConfig(steps=7, schedule="wsd", precision="bfloat16")
    assert from_json(to_json(cfg)) == cfg


def test_cosine_schedule_formula():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    s = make_schedule(cfg)
    for t in [0, 4, 9, 10, 30, 55, 99, 100, 150]:
        if t < 10:
            want = 1e-3 * (t + 1) / 10
        else:
            frac = min(1.0, (t - 10) / 90)
            want = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        np.testing.assert_allclose(float(s(t)), want, rtol=1e-5, err_msg=f"t={t}")
    assert float(s(10)) == pytest.approx(1e-3)
    assert float(s(100)) == pytest.approx(1e-4)


def test_wsd_schedule_formula():
    cfg = TrainConfig(
        steps=100, lr=2e-3, warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0
    )
    s = make_schedule(cfg)
    decay_start = 80
    for t in [0, 5, 9, 10, 50, 79, 80, 85, 90, 99, 100]:
        if t < 10:
            want = 2e-3 * (t + 1) / 10
        elif t < decay_start:
            want = 2e-3
        else:
            want = 2e-3 * (1 - (t - decay_start) / 20)
        np.testing.assert_allclose(float(s(t)), want, rtol=1e-5, atol=1e-9, err_msg=f"t={t}")
    lin = make_schedule(TrainConfig(steps=20, warmup_steps=4, schedule="linear", lr=1.0,
                                    min_lr_ratio=0.1))
    for t in [0, 3, 4, 12, 20, 30]:
        want = (t + 1) / 4 if t < 4 else 1.0 - 0.9 * min(1.0, (t - 4) / 16)
        np.testing.assert_allclose(float(lin(t)), want, rtol=1e-5, err_msg=f"linear t={t}")
    with pytest.raises(ConfigError, match="lr=inf"):
        TrainConfig(lr=float("inf"))
    const = make_schedule(TrainConfig(steps=10, warmup_steps=0, schedule="constant", lr=0.5))
    assert [float(const(t)) for t in (0, 9)] == [0.5, 0.5]


def test_optimizer_decay_mask_clip_and_lr():
    model = TinyMoELM(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = dict(
        (("/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p[:-1])), v)
        for p, v in jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]
    )
    assert mask["experts/w_up"] and mask["head/kernel"] and mask["router/kernel"]
    assert not mask["experts/bias"]  # [E, D] bias is 2-D but still skipped
    assert not mask["norm/scale"] and not mask["head/bias"]

    # pure weight decay (zero grads, sgd): only masked leaves shrink
    cfg = TrainConfig(
        optimizer="sgd",
        b1=0.0,
        lr=0.1,
        weight_decay=0.5,
        warmup_steps=0,
        schedule="constant",
        grad_clip=0.0,
    )
    tx = make_optimizer(cfg)
    zeros = jax.tree.map(jnp.zeros_like, params)
    upd, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, upd)
    np.testing.assert_allclose(
        new["head"]["kernel"][...], params["head"]["kernel"][...] * 0.95, rtol=1e-6
    )
    np.testing.assert_array_equal(new["experts"]["bias"][...], params["experts"]["bias"][...])

    # clipping: a huge gradient gives an update of norm lr * clip with plain sgd
    cfg = cfg.replace(weight_decay=0.0, grad_clip=1.0)
    tx = make_optimizer(cfg)
    big = jax.tree.map(lambda x: jnp.full_like(x, 100.0), params)
    upd, _ = tx.update(big, tx.init(params), params)
    np.testing.assert_allclose(float(optax.tree.norm(upd)), 0.1, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamr_l1", "adamr_l2"])
def test_decay_paths_restricts_every_optimizers_decay(optimizer):
    """``decay_paths`` narrows the decay: a leaf outside the regex gets the update it would get
    with ``weight_decay=0``; a leaf inside it gets the decayed one."""
    rng = np.random.default_rng(0)
    params = {"encoder": {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)},
              "head": {"kernel": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    # AdamR anchors at the init params: move them so its decay term is not zero
    start = jax.tree.map(lambda x: x + 0.3, params)
    cfg = TrainConfig(optimizer=optimizer, lr=0.1, weight_decay=0.5, schedule="constant",
                      grad_clip=0.0, b1=0.0 if optimizer == "sgd" else 0.9,
                      decay_paths="^encoder/")

    def step(c):
        tx = make_optimizer(c)
        state = tx.init(params)
        return tx.update(grads, state, start)[0]

    got, plain = step(cfg), step(cfg.replace(weight_decay=0.0))
    full = step(cfg.replace(decay_paths=""))
    np.testing.assert_allclose(got["head"]["kernel"], plain["head"]["kernel"], rtol=1e-6)
    np.testing.assert_allclose(got["encoder"]["w"], full["encoder"]["w"], rtol=1e-6)
    assert not np.allclose(got["encoder"]["w"], plain["encoder"]["w"])
    assert not np.allclose(full["head"]["kernel"], plain["head"]["kernel"])
    with pytest.raises(ConfigError, match="decay_paths"):
        TrainConfig(decay_paths="(")
    # a pattern that selects nothing would switch the decay off: refused, paths shown
    with pytest.raises(ValueError, match=r"decay_paths='\^encoder/w_' selects no parameter .*"
                                         r"paths look like encoder/w, head/kernel"):
        step(cfg.replace(decay_paths="^encoder/w_"))
