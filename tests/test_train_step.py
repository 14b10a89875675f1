"""Train step: gradient accumulation == big batch, bf16 compute with fp32 master params,
non-finite guard (no update applied, NonFiniteError with step/what/fix), lm_loss_fn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.train.optim import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import (
    NonFiniteError,
    check_finite,
    init_train_state,
    lm_loss_fn,
    make_eval_step,
    make_train_step,
)
from tests.test_train_utils import TinyMoELM, ToySource, tree_equal, tree_max_diff

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
