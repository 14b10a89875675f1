"""The one training loop with user optax transforms, user models and plain pytree params:
exact match with a hand-written optax loop, frozen parts, inject_hyperparams, a transform that
reads the loss, a model that changes its own state (Dropout's Rngs, BatchNorm), a loss, metric
or eval result that is not a number refused by name, batched metric logging, TensorBoard,
exact resume, and non-finite parameters never saved (keep_best and resume in detail:
test_train_loop_resume.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.optim.anchored import adamr
from moejax.train import step_cache
from moejax.train.checkpoint import latest_step
from moejax.train.hparams import TrainConfig
from moejax.train.loop import read_csv, train, train_params
from moejax.train.step import NonFiniteError, lm_loss_fn
from tests.toy_models import (
    LIN_P0,
    TinyMoELM,
    ToySource,
    lin_batch,
    lin_mse,
    tree_equal,
    tree_max_diff,
)

CFG = TrainConfig(steps=6, batch_size=8, lr=1e-2, log_every=4, seed=0, grad_clip=0.0)


def _by_hand(tx, steps):
    params, state = LIN_P0, tx.init(LIN_P0)
    for i in range(steps):
        batch = lin_batch(i)
        grads = jax.grad(lambda p, b=batch: lin_mse(p, b, None)[0])(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_custom_tx_matches_a_hand_written_optax_loop():
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamr(1e-1, 0.3, reg="l2"))
    params, hist = train_params(LIN_P0, lin_batch, CFG, lin_mse, tx=tx, progress=False)
    want = _by_hand(tx, CFG.steps)
    for k in LIN_P0:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-6)
    assert [h["step"] for h in hist] == list(range(1, 7))  # log_every=4 still logs every step
    assert hist[-1]["mse"] < hist[0]["mse"]


def test_frozen_parts_multisteps_and_injected_lr():
    frozen = optax.multi_transform({"train": optax.adam(1e-1), "freeze": optax.set_to_zero()},
                                   {"w": "train", "b": "freeze"})
    p0 = {"w": jnp.zeros((5,)), "b": jnp.ones(())}
    params, _ = train_params(p0, lin_batch, CFG, lin_mse, tx=frozen, progress=False)
    assert float(params["b"]) == 1.0 and float(jnp.abs(params["w"]).sum()) > 0
    multi = optax.MultiSteps(optax.sgd(1e-2), every_k_schedule=3)
    params, _ = train_params(LIN_P0, lin_batch, CFG.replace(steps=2), lin_mse, tx=multi,
                             progress=False)
    assert float(jnp.abs(params["w"]).sum()) == 0.0  # 2 micro-steps of 3: no update yet
    sched = optax.linear_schedule(0.1, 0.0, 6)
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=sched)
    _, hist = train_params(LIN_P0, lin_batch, CFG, lin_mse, tx=injected, progress=False)
    np.testing.assert_allclose([h["lr"] for h in hist], [sched(i) for i in range(6)], rtol=1e-6)


def test_a_transform_that_reads_the_loss_gets_it_as_value():
    """optax's extra argument ``value=``: reduce_on_plateau cuts the rate on the loop's
    losses exactly as in a hand-written loop that passes the loss."""
    tx = optax.chain(optax.sgd(3e-2),
                     optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))
    cfg = CFG.replace(steps=12)
    params, _ = train_params(LIN_P0, lin_batch, cfg, lin_mse, tx=tx, progress=False)
    want, state = LIN_P0, tx.init(LIN_P0)
    for i in range(cfg.steps):
        batch = lin_batch(i)
        loss, grads = jax.value_and_grad(lambda p, b=batch: lin_mse(p, b, None)[0])(want)
        updates, state = tx.update(grads, state, want, value=loss)
        want = optax.apply_updates(want, updates)
    assert float(state[1].scale) < 1.0  # the plateau rule cut the rate: the loss was read
    for k in LIN_P0:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-6)


class _StatefulNet(nnx.Module):
    """A user's model that updates its own state in training: nnx.Dropout with its own Rngs
    (the count advances every call) and nnx.BatchNorm (running statistics)."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.BatchNorm(5, rngs=rngs)
        self.linear = nnx.Linear(5, 1, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, train: bool):
        return self.drop(self.linear(self.norm(x, use_running_average=not train)),
                         deterministic=not train)[..., 0]


def _stateful_loss(model, batch, key, train=True):
    return jnp.mean((model(batch["x"], train) - batch["y"]) ** 2)


def test_a_model_that_updates_its_own_state_trains_and_resumes_exactly(tmp_path):
    """Variables a model changes in its forward (Dropout's Rngs count, BatchNorm's running
    statistics) come back from each step, and a resumed run equals an uninterrupted one."""
    cfg = CFG.replace(ckpt_every=2, grad_accum=2)
    full = _StatefulNet(nnx.Rngs(0))
    hist = train(full, lin_batch, cfg.replace(ckpt_every=0), loss_fn=_stateful_loss,
                 progress=False)  # the uninterrupted run: no run directory
    assert int(full.drop.rngs.count[...]) == cfg.steps * cfg.grad_accum
    assert float(jnp.abs(full.norm.mean[...]).max()) > 1e-3  # the statistics moved from 0
    assert len({round(h["loss"], 6) for h in hist}) == len(hist)

    def crashing(position):
        if position == 3:
            raise RuntimeError("killed")
        return lin_batch(position)

    with pytest.raises(RuntimeError, match="killed"):
        train(_StatefulNet(nnx.Rngs(0)), crashing, cfg, loss_fn=_stateful_loss,
              run_dir=str(tmp_path), progress=False)
    resumed = _StatefulNet(nnx.Rngs(0))
    train(resumed, lin_batch, cfg, loss_fn=_stateful_loss, run_dir=str(tmp_path),
          progress=False)
    data = lambda m: jax.tree.map(  # key arrays as their data, to compare
        lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else x, nnx.state(m))
    assert tree_equal(data(resumed), data(full))


@pytest.mark.parametrize("what", ["metric", "loss"])
def test_a_loss_or_metric_that_is_not_a_scalar_is_refused_before_any_step(tmp_path, what):
    """A per-row metric (or loss) is refused naming it while the step is traced: nothing runs
    and nothing is written to the run directory."""
    def per_row(params, batch, key, train=True):
        err = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2
        return (jnp.mean(err), {"per_row": err}) if what == "metric" else err

    name = "per_row" if what == "metric" else "loss"
    with pytest.raises(ValueError, match=rf"loss_fn returned {name} of shape \(8,\).*reduce"):
        train_params(LIN_P0, lin_batch, CFG, per_row, run_dir=str(tmp_path / "run"),
                     progress=False)
    run = tmp_path / "run"
    assert not run.exists() or not any(run.iterdir())


@pytest.mark.parametrize("result, named", [
    ({"acc": np.array([0.1, 0.2])}, r"acc=an array of shape \(2,\) at step 2"),
    ({"acc": "high"}, r"acc='high' at step 2"),
    (None, r"returned NoneType at step 2; it must return a dict of numbers")])
def test_an_eval_result_that_is_not_numbers_is_refused_naming_the_key(result, named):
    """An eval_fn's dict of numbers (Python, numpy or jax scalars) becomes eval rows; any
    other value is refused in one line naming its key and the step."""
    cfg = CFG.replace(eval_every=2, steps=4)
    _, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, progress=False,
                           eval_fn=lambda p, step: {"acc": jnp.float32(0.5), "n": np.int64(3)})
    assert hist[-1]["eval/acc"] == 0.5 and hist[-1]["eval/n"] == 3.0
    with pytest.raises(TypeError, match=named):
        train_params(LIN_P0, lin_batch, cfg, lin_mse, progress=False,
                     eval_fn=lambda p, step: result)


def _two_args(params, batch):
    return lin_mse(params, batch, None)


@pytest.mark.parametrize("source, loss_fn, named", [
    ([1, 2], lin_mse, r"source is a list; give an object with \.batch\(position\)"),
    (lin_batch, _two_args, r"loss_fn _two_args\(params, batch\) cannot be called as "
                             r"loss_fn\(model_or_params, batch, key\)")])
def test_a_source_or_loss_the_loop_cannot_call_is_refused_before_anything(
        tmp_path, source, loss_fn, named):
    with pytest.raises(TypeError, match=named):
        train_params(LIN_P0, source, CFG, loss_fn, run_dir=str(tmp_path / "run"),
                     progress=False)
    run = tmp_path / "run"
    assert not run.exists() or not any(run.iterdir())


def test_pytree_training_resumes_exactly(tmp_path):
    cfg = CFG.replace(ckpt_every=2)
    full, _ = train_params(LIN_P0, lin_batch, cfg.replace(ckpt_every=0), lin_mse, progress=False)

    def crashing(position):
        if position == 3:
            raise RuntimeError("killed")
        return lin_batch(position)

    with pytest.raises(RuntimeError, match="killed"):
        train_params(LIN_P0, crashing, cfg, lin_mse, run_dir=str(tmp_path), progress=False)
    assert latest_step(tmp_path / "checkpoints") == 2
    resumed, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, run_dir=str(tmp_path),
                                 progress=False)
    assert [h["step"] for h in hist] == [3, 4, 5, 6]
    assert tree_equal(resumed, full)
    assert [int(r["step"]) for r in read_csv(tmp_path / "metrics.csv")] == list(range(1, 7))


# the update is scaled past float32's range on purpose: the cast's overflow is the point
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_non_finite_parameters_are_never_saved(tmp_path):
    cfg = TrainConfig(steps=3, batch_size=4, ckpt_every=1, grad_clip=0.0, log_every=1)
    with pytest.raises(NonFiniteError, match="nothing was saved"):
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, tx=optax.scale(1e39),
              run_dir=str(tmp_path), progress=False)
    assert latest_step(tmp_path / "checkpoints") is None


def test_tensorboard_events_and_memory_analysis(tmp_path):
    pytest.importorskip("tensorboardX")
    cfg = TrainConfig(steps=2, batch_size=4, tensorboard=True, log_every=1)
    hist = train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, run_dir=str(tmp_path),
                 progress=False, measure_memory=True)
    events = [f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out")]
    assert events and os.path.getsize(tmp_path / "tb" / events[0]) > 0
    assert hist.memory["peak_bytes"] >= hist.memory["argument_bytes"] > 0


class _TwoLengths(ToySource):
    """Every other batch is cut to 5 tokens (a source of varying sequence lengths)."""

    def batch(self, position: int):
        b = super().batch(position)
        return {k: v[:, :5] for k, v in b.items()} if position % 2 else b


def test_measuring_memory_leaves_batches_of_other_shapes_trainable():
    """measure_memory reuses the step compiled for the first batch's shapes; a batch of other
    shapes failed with XLA's "Argument types differ" error. It now runs, with the losses of a
    run that does not measure."""
    cfg = TrainConfig(steps=3, batch_size=4, log_every=1)
    runs = [train(TinyMoELM(nnx.Rngs(0)), _TwoLengths(batch_size=4), cfg, progress=False,
                  measure_memory=m) for m in (False, True)]
    assert [h["loss"] for h in runs[0]] == [h["loss"] for h in runs[1]]
    assert runs[1].memory["peak_bytes"] > 0 and runs[0].memory is None


def test_runs_of_one_recipe_share_one_jitted_step(monkeypatch):
    """A second run of a recipe (another seed or logging) reuses the first one's jitted step;
    another learning rate builds another."""
    monkeypatch.setattr(step_cache, "LOW_MEMORY_FRACTION", 0.0)  # kept on a host short of memory
    cfg = CFG.replace(steps=2)
    train_params(LIN_P0, lin_batch, cfg, lin_mse, progress=False)
    hits = step_cache.cached_step.cache_info().hits
    _, h1 = train_params(LIN_P0, lin_batch, cfg.replace(seed=5, log_every=1), lin_mse,
                         progress=False)
    assert step_cache.cached_step.cache_info().hits == hits + 1  # seed / logging: same step
    train_params(LIN_P0, lin_batch, cfg.replace(lr=0.5), lin_mse, progress=False)
    assert step_cache.cached_step.cache_info().hits == hits + 1  # another lr: another step


def test_nothing_silent_for_a_users_source_loss_and_transform(tmp_path):
    """A source that ignores batch_size is refused at its first batch; the default loss on a
    batch without its keys names the keys expected and found; config.json records that the
    caller's transform ran, not the config's optimizer."""
    import json

    with pytest.raises(ValueError, match="first batch has 8 rows but TrainConfig.batch_size=16"):
        train_params(LIN_P0, lin_batch, CFG.replace(batch_size=16), lin_mse, progress=False)
    with pytest.raises(ValueError, match=r"needs batch keys 'inputs' and 'targets'.*\['x', 'y'\]"):
        train(TinyMoELM(nnx.Rngs(0)), lin_batch, CFG, progress=False)
    tx = adamr(1e-2, weight_decay=0.1)
    train_params(LIN_P0, lin_batch, CFG.replace(steps=1), lin_mse, tx=tx, run_dir=tmp_path / "r",
                 progress=False)
    record = json.loads((tmp_path / "r" / "config.json").read_text())
    assert record["optimizer"] == CFG.optimizer  # the config as given ...
    assert "given by the caller" in record["transform"]  # ... and what ran instead
    assert "optimizer" in record["transform"]
    train_params(LIN_P0, lin_batch, CFG.replace(steps=1), lin_mse, run_dir=tmp_path / "own",
                 progress=False)
    assert "transform" not in json.loads((tmp_path / "own" / "config.json").read_text())


def test_train_takes_a_users_nnx_optimizer_as_given():
    """train(model, ..., tx=nnx.Optimizer): its transform continues from its state (the
    same parameters as the user's own loop continuing), and the optimizer ends with the
    state and step count of the run, so the user's loop can go on."""
    def loss(model, batch, key, train=True):  # deterministic: the same in both loops
        return lm_loss_fn(model, batch, key, train=False)

    src = ToySource(batch_size=8)
    mine, ref = TinyMoELM(nnx.Rngs(0)), TinyMoELM(nnx.Rngs(0))
    opt_mine = nnx.Optimizer(mine, optax.adam(1e-2), wrt=nnx.Param)
    opt_ref = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit  # the user's step compiled once (run op by op, each op compiles on its own)
    def step(model, opt, batch):
        grads = nnx.grad(lambda m: loss(m, batch, None)[0])(model)
        opt.update(model, grads)

    def by_hand(model, opt, position):
        step(model, opt, src.batch(position))

    for position in range(2):  # both start with two steps of the user's own loop
        by_hand(mine, opt_mine, position)
        by_hand(ref, opt_ref, position)
    for position in range(2, 5):
        by_hand(ref, opt_ref, position)

    class From2:  # the loop's positions 0.. are the user's batches 2..
        batch_size = 8

        def batch(self, i):
            return src.batch(2 + i)

    train(mine, From2(), CFG.replace(steps=3, grad_clip=0.0), loss_fn=loss, tx=opt_mine,
          progress=False)
    assert tree_max_diff(nnx.state(mine, nnx.Param), nnx.state(ref, nnx.Param)) < 1e-6
    assert int(opt_mine.step[...]) == 5
    by_hand(mine, opt_mine, 5)  # and the user's loop goes on from where the run left it
    by_hand(ref, opt_ref, 5)
    assert tree_max_diff(nnx.state(mine, nnx.Param), nnx.state(ref, nnx.Param)) < 1e-6


def test_each_evaluation_joins_the_row_of_its_own_step():
    """An evaluation between two log flushes is written into its own step's row of the
    history, not into the last row flushed before it."""
    cfg = CFG.replace(steps=6, eval_every=2, log_every=100)
    _, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, progress=False,
                           eval_fn=lambda params, step: {"at": float(step)})
    assert [h["step"] for h in hist] == list(range(1, 7))
    assert {h["step"]: h["eval/at"] for h in hist if "eval/at" in h} == {2: 2.0, 4: 4.0, 6: 6.0}
