"""The one training loop with user optax transforms, user models and plain pytree params:
exact match with a hand-written optax loop, frozen parts, inject_hyperparams, a transform that
reads the loss, a model that changes its own state (Dropout's Rngs, BatchNorm), a loss, metric
or eval result that is not a number refused by name, batched metric logging, TensorBoard,
exact resume, and non-finite parameters never saved."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moejax.optim.anchored import adamr
from moejax.train.checkpoint import latest_step
from moejax.train.hparams import TrainConfig
from moejax.train.loop import read_csv, train, train_params
from moejax.train.step import NonFiniteError, lm_loss_fn
from tests.toy_models import TinyMoELM, ToySource, tree_equal, tree_max_diff

CFG = TrainConfig(steps=6, batch_size=8, lr=1e-2, log_every=4, seed=0, grad_clip=0.0)


def _regression(position: int):
    rng = np.random.default_rng([3, position])
    x = rng.normal(size=(8, 5)).astype(np.float32)
    return {"x": x, "y": (x @ np.arange(5, dtype=np.float32)).astype(np.float32)}


def _mse(params, batch, key, train=True):
    pred = batch["x"] @ params["w"] + params["b"]
    loss = jnp.mean((pred - batch["y"]) ** 2)
    return loss, {"mse": loss}


P0 = {"w": jnp.zeros((5,)), "b": jnp.zeros(())}


def _by_hand(tx, steps):
    params, state = P0, tx.init(P0)
    for i in range(steps):
        batch = _regression(i)
        grads = jax.grad(lambda p, b=batch: _mse(p, b, None)[0])(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_custom_tx_matches_a_hand_written_optax_loop():
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamr(1e-1, 0.3, reg="l2"))
    params, hist = train_params(P0, _regression, CFG, _mse, tx=tx, progress=False)
    want = _by_hand(tx, CFG.steps)
    for k in P0:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-6)
    assert [h["step"] for h in hist] == list(range(1, 7))  # log_every=4 still logs every step
    assert hist[-1]["mse"] < hist[0]["mse"]


def test_frozen_parts_multisteps_and_injected_lr():
    frozen = optax.multi_transform({"train": optax.adam(1e-1), "freeze": optax.set_to_zero()},
                                   {"w": "train", "b": "freeze"})
    p0 = {"w": jnp.zeros((5,)), "b": jnp.ones(())}
    params, _ = train_params(p0, _regression, CFG, _mse, tx=frozen, progress=False)
    assert float(params["b"]) == 1.0 and float(jnp.abs(params["w"]).sum()) > 0
    multi = optax.MultiSteps(optax.sgd(1e-2), every_k_schedule=3)
    params, _ = train_params(P0, _regression, CFG.replace(steps=2), _mse, tx=multi,
                             progress=False)
    assert float(jnp.abs(params["w"]).sum()) == 0.0  # 2 micro-steps of 3: no update yet
    sched = optax.linear_schedule(0.1, 0.0, 6)
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=sched)
    _, hist = train_params(P0, _regression, CFG, _mse, tx=injected, progress=False)
    np.testing.assert_allclose([h["lr"] for h in hist], [sched(i) for i in range(6)], rtol=1e-6)


def test_a_transform_that_reads_the_loss_gets_it_as_value():
    """optax's extra argument ``value=``: reduce_on_plateau cuts the rate on the loop's
    losses exactly as in a hand-written loop that passes the loss."""
    tx = optax.chain(optax.sgd(3e-2),
                     optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))
    cfg = CFG.replace(steps=12)
    params, _ = train_params(P0, _regression, cfg, _mse, tx=tx, progress=False)
    want, state = P0, tx.init(P0)
    for i in range(cfg.steps):
        batch = _regression(i)
        loss, grads = jax.value_and_grad(lambda p, b=batch: _mse(p, b, None)[0])(want)
        updates, state = tx.update(grads, state, want, value=loss)
        want = optax.apply_updates(want, updates)
    assert float(state[1].scale) < 1.0  # the plateau rule cut the rate: the loss was read
    for k in P0:
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
    hist = train(full, _regression, cfg.replace(ckpt_every=0), loss_fn=_stateful_loss,
                 progress=False)  # the uninterrupted run: no run directory
    assert int(full.drop.rngs.count[...]) == cfg.steps * cfg.grad_accum
    assert float(jnp.abs(full.norm.mean[...]).max()) > 1e-3  # the statistics moved from 0
    assert len({round(h["loss"], 6) for h in hist}) == len(hist)

    def crashing(position):
        if position == 3:
            raise RuntimeError("killed")
        return _regression(position)

    with pytest.raises(RuntimeError, match="killed"):
        train(_StatefulNet(nnx.Rngs(0)), crashing, cfg, loss_fn=_stateful_loss,
              run_dir=str(tmp_path), progress=False)
    resumed = _StatefulNet(nnx.Rngs(0))
    train(resumed, _regression, cfg, loss_fn=_stateful_loss, run_dir=str(tmp_path),
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
        train_params(P0, _regression, CFG, per_row, run_dir=str(tmp_path / "run"),
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
    _, hist = train_params(P0, _regression, cfg, _mse, progress=False,
                           eval_fn=lambda p, step: {"acc": jnp.float32(0.5), "n": np.int64(3)})
    assert hist[-1]["eval/acc"] == 0.5 and hist[-1]["eval/n"] == 3.0
    with pytest.raises(TypeError, match=named):
        train_params(P0, _regression, cfg, _mse, progress=False,
                     eval_fn=lambda p, step: result)


def _two_args(params, batch):
    return _mse(params, batch, None)


@pytest.mark.parametrize("source, loss_fn, named", [
    ([1, 2], _mse, r"source is a list; give an object with \.batch\(position\)"),
    (_regression, _two_args, r"loss_fn _two_args\(params, batch\) cannot be called as "
                             r"loss_fn\(model_or_params, batch, key\)")])
def test_a_source_or_loss_the_loop_cannot_call_is_refused_before_anything(
        tmp_path, source, loss_fn, named):
    with pytest.raises(TypeError, match=named):
        train_params(P0, source, CFG, loss_fn, run_dir=str(tmp_path / "run"),
                     progress=False)
    run = tmp_path / "run"
    assert not run.exists() or not any(run.iterdir())


def test_pytree_training_resumes_exactly(tmp_path):
    cfg = CFG.replace(ckpt_every=2)
    full, _ = train_params(P0, _regression, cfg.replace(ckpt_every=0), _mse, progress=False)

    def crashing(position):
        if position == 3:
            raise RuntimeError("killed")
        return _regression(position)

    with pytest.raises(RuntimeError, match="killed"):
        train_params(P0, crashing, cfg, _mse, run_dir=str(tmp_path), progress=False)
    assert latest_step(tmp_path / "checkpoints") == 2
    resumed, hist = train_params(P0, _regression, cfg, _mse, run_dir=str(tmp_path),
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


def test_runs_of_one_recipe_share_one_jitted_step():
    from moejax.train import step_cache

    cfg = CFG.replace(steps=2)
    train_params(P0, _regression, cfg, _mse, progress=False)
    hits = step_cache.cached_step.cache_info().hits
    _, h1 = train_params(P0, _regression, cfg.replace(seed=5, log_every=1), _mse, progress=False)
    assert step_cache.cached_step.cache_info().hits == hits + 1  # seed / logging: same step
    train_params(P0, _regression, cfg.replace(lr=0.5), _mse, progress=False)
    assert step_cache.cached_step.cache_info().hits == hits + 1  # another lr: another step


def test_keep_best_returns_the_best_evaluated_parameters():
    """The evaluation peaks at step 2 of 5: keep_best ends with step 2's parameters (equal to
    a 2-step run's), not the last step's, and says so in history.best."""
    cfg = CFG.replace(steps=5, eval_every=1, log_every=1, schedule="constant")
    score = lambda params, step: {"score": -abs(step - 2.0)}  # noqa: E731
    best, hist = train_params(P0, _regression, cfg, _mse, eval_fn=score, keep_best="score",
                              progress=False)
    two, _ = train_params(P0, _regression, cfg.replace(steps=2, eval_every=0), _mse,
                          progress=False)
    assert hist.best == {"step": 2, "value": 0.0, "mode": "max"} and len(hist) == 5
    assert tree_equal(best, two)
    tie = lambda params, step: {"score": -min(abs(step - 2.0), abs(step - 4.0))}  # noqa: E731
    _, hist = train_params(P0, _regression, cfg, _mse, eval_fn=tie, keep_best="score",
                           progress=False)
    # a tie keeps the earlier evaluation
    assert hist.best == {"step": 2, "value": 0.0, "mode": "max"}
    nan_first = lambda params, step: {"score": float("nan") if step == 1 else -step}  # noqa: E731
    _, hist = train_params(P0, _regression, cfg, _mse, eval_fn=nan_first, keep_best="score",
                           progress=False)
    # a NaN evaluation is never the best
    assert hist.best == {"step": 2, "value": -2.0, "mode": "max"}
    with pytest.raises(ValueError, match="keep_best"):
        train_params(P0, _regression, cfg.replace(eval_every=0), _mse, keep_best="score",
                     progress=False)


def test_keep_best_survives_a_crash_and_a_second_call_of_the_finished_run(tmp_path):
    """The evaluation peaks at step 2 of 6; the run crashes during step 5 (checkpoints at 2
    and 4, a best step written at 2). The resumed run ends with step 2's parameters, as the
    uninterrupted run does, and so does the finished run called again (no step run); a best
    step past the resumed one is set aside, not resumed from."""
    cfg = CFG.replace(steps=6, eval_every=1, log_every=1, schedule="constant", ckpt_every=2)
    score = lambda params, step: {"score": -abs(step - 2.0)}  # noqa: E731
    want, _ = train_params(P0, _regression, cfg.replace(ckpt_every=0), _mse, eval_fn=score,
                           keep_best="score", progress=False)

    def crashing(position):
        if position == 4:
            raise RuntimeError("killed")
        return _regression(position)

    run = dict(eval_fn=score, keep_best="score", run_dir=str(tmp_path), progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train_params(P0, crashing, cfg, _mse, **run)
    assert latest_step(tmp_path / "checkpoints") == 4
    assert latest_step(tmp_path / "best") == 2
    resumed, hist = train_params(P0, _regression, cfg, _mse, **run)
    assert [h["step"] for h in hist] == [5, 6]
    assert hist.best == {"step": 2, "value": 0.0, "mode": "max"} and tree_equal(resumed, want)
    again, hist = train_params(P0, _regression, cfg, _mse, **run)
    assert len(hist) == 0 and hist.best == {"step": 2, "value": 0.0, "mode": "max"}
    assert tree_equal(again, want)
    # a best step past the resumed one (its run crashed before the step's own checkpoint)
    late = tmp_path / "late"
    with pytest.raises(RuntimeError, match="killed"):
        train_params(P0, crashing, cfg.replace(ckpt_every=3), _mse,
                     **{**run, "run_dir": str(late)})
    os.rename(late / "checkpoints" / "3", late / "checkpoints" / "moved")  # as if never saved
    resumed, hist = train_params(P0, _regression, cfg.replace(ckpt_every=3), _mse,
                                 **{**run, "run_dir": str(late)})
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6] and tree_equal(resumed, want)
    assert os.listdir(late / "best" / ".after-resume")
    with pytest.raises(ValueError, match=r"keeps the best by 'score' \(max\), this run by "
                                         r"'other' \(max\)"):
        train_params(P0, _regression, cfg, _mse, eval_fn=lambda p, s: {"other": 1.0},
                     keep_best="other", run_dir=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match=r"this run by 'score' \(min\)"):  # another mode
        train_params(P0, _regression, cfg, _mse, **run, keep_best_mode="min")


def test_keep_best_of_a_lower_is_better_metric_needs_its_mode():
    """keep_best keeps the highest evaluation by default: a loss would keep its worst step.
    A metric that reads as lower-is-better is refused before any step unless the mode is
    said; keep_best_mode="min" keeps the lowest."""
    cfg = CFG.replace(steps=5, eval_every=1, log_every=1, schedule="constant")
    loss = lambda params, step: {"loss": abs(step - 2.0), "val_kl": 1.0}  # noqa: E731
    for key in ("loss", "val_kl", "PPL", "bpb", "val_ce"):
        with pytest.raises(ValueError, match=f"keep_best='{key}' reads as a metric where "
                                             "lower is better.*keep_best_mode='min'"):
            train_params(P0, _regression, cfg, _mse, eval_fn=loss, keep_best=key,
                         progress=False)
    best, hist = train_params(P0, _regression, cfg, _mse, eval_fn=loss, keep_best="loss",
                              keep_best_mode="min", progress=False)
    two, _ = train_params(P0, _regression, cfg.replace(steps=2, eval_every=0), _mse,
                          progress=False)
    assert hist.best == {"step": 2, "value": 0.0, "mode": "min"} and tree_equal(best, two)
    _, hist = train_params(P0, _regression, cfg, _mse, eval_fn=loss, keep_best="loss",
                           keep_best_mode="max", progress=False)  # said: taken as said
    assert hist.best == {"step": 5, "value": 3.0, "mode": "max"}
    with pytest.raises(ValueError, match="keep_best_mode='lowest'; use 'max'"):
        train_params(P0, _regression, cfg, _mse, eval_fn=loss, keep_best="loss",
                     keep_best_mode="lowest", progress=False)
    with pytest.raises(ValueError, match="keep_best_mode='min' without keep_best"):
        train_params(P0, _regression, cfg, _mse, eval_fn=loss, keep_best_mode="min",
                     progress=False)


@pytest.mark.parametrize("ckpt_every", [2, 3])
def test_a_failed_evaluation_keeps_its_step_and_the_resumed_run_evaluates_it(tmp_path,
                                                                              ckpt_every):
    """An evaluation that fails (here at step 4 of 6) took the steps since the last checkpoint
    with it: the newest checkpoint stayed at step 2 (or 3, saving every 3 steps). The step is
    now saved before the error goes on, and the run resumed from it evaluates step 4 first
    (and saves its best at once), so it ends as the uninterrupted run does: the same best step
    and parameters, one evaluation row per step, also when the evaluation of the last step
    fails."""
    cfg = CFG.replace(steps=6, eval_every=2, log_every=1, schedule="constant",
                      ckpt_every=ckpt_every)
    score = lambda params, step: {"score": -abs(step - 4.0)}  # noqa: E731
    want, _ = train_params(P0, _regression, cfg.replace(ckpt_every=0), _mse, eval_fn=score,
                           keep_best="score", progress=False)

    def failing(params, step):
        if step == 4:
            raise RuntimeError("evaluator failed")
        return score(params, step)

    run = dict(keep_best="score", run_dir=str(tmp_path), progress=False)
    with pytest.raises(RuntimeError, match="evaluator failed"):
        train_params(P0, _regression, cfg, _mse, eval_fn=failing, **run)
    assert latest_step(tmp_path / "checkpoints") == 4
    got, hist = train_params(P0, _regression, cfg, _mse, eval_fn=score, **run)
    assert [h["step"] for h in hist] == [5, 6] and tree_equal(got, want)
    assert hist.best == {"step": 4, "value": 0.0, "mode": "max"}
    assert [int(r["step"]) for r in read_csv(tmp_path / "eval.csv")] == [2, 4, 6]
    last = tmp_path / "last"  # the last step's evaluation fails: the run's end is kept
    late = lambda params, step: failing(params, step + 2)  # noqa: E731 - fails at step 2
    with pytest.raises(RuntimeError, match="evaluator failed"):
        train_params(P0, _regression, cfg.replace(steps=2), _mse, eval_fn=late,
                     **{**run, "run_dir": str(last)})
    assert latest_step(last / "checkpoints") == 2
    _, hist = train_params(P0, _regression, cfg.replace(steps=2), _mse, eval_fn=score,
                           **{**run, "run_dir": str(last)})
    assert len(hist) == 0 and hist.best == {"step": 2, "value": -2.0, "mode": "max"}
    assert latest_step(last / "best") == 2  # the owed evaluation's best, saved at once


def test_keep_best_resumes_from_the_newest_best_step_that_verifies(tmp_path):
    """Two best steps before the crash (2, then the better 4): the resumed run starts from
    step 4's best, not the older one; with step 4's best damaged it falls back to step 2's
    rather than forgetting both."""
    cfg = CFG.replace(steps=6, eval_every=1, log_every=1, schedule="constant", ckpt_every=2)
    table = {1: -5.0, 2: 0.0, 3: -3.0, 4: 0.5, 5: -4.0, 6: -4.0}
    score = lambda params, step: {"score": table[step]}  # noqa: E731

    def crashing(position):
        if position == 4:
            raise RuntimeError("killed")
        return _regression(position)

    for damaged, best in ((False, {"step": 4, "value": 0.5, "mode": "max"}),
                          (True, {"step": 2, "value": 0.0, "mode": "max"})):
        run = dict(eval_fn=score, keep_best="score", run_dir=str(tmp_path / str(damaged)),
                   progress=False)
        with pytest.raises(RuntimeError, match="killed"):
            train_params(P0, crashing, cfg, _mse, **run)
        assert latest_step(tmp_path / str(damaged) / "best") == 4
        if damaged:
            os.remove(tmp_path / str(damaged) / "best" / "4" / "state" / "_METADATA")
        _, hist = train_params(P0, _regression, cfg, _mse, **run)
        assert [h["step"] for h in hist] == [5, 6] and hist.best == best


def test_nothing_silent_for_a_users_source_loss_and_transform(tmp_path):
    """A source that ignores batch_size is refused at its first batch; the default loss on a
    batch without its keys names the keys expected and found; config.json records that the
    caller's transform ran, not the config's optimizer."""
    import json

    with pytest.raises(ValueError, match="first batch has 8 rows but TrainConfig.batch_size=16"):
        train_params(P0, _regression, CFG.replace(batch_size=16), _mse, progress=False)
    with pytest.raises(ValueError, match=r"needs batch keys 'inputs' and 'targets'.*\['x', 'y'\]"):
        train(TinyMoELM(nnx.Rngs(0)), _regression, CFG, progress=False)
    tx = adamr(1e-2, weight_decay=0.1)
    train_params(P0, _regression, CFG.replace(steps=1), _mse, tx=tx, run_dir=tmp_path / "r",
                 progress=False)
    record = json.loads((tmp_path / "r" / "config.json").read_text())
    assert record["optimizer"] == CFG.optimizer  # the config as given ...
    assert "given by the caller" in record["transform"]  # ... and what ran instead
    assert "optimizer" in record["transform"]
    train_params(P0, _regression, CFG.replace(steps=1), _mse, run_dir=tmp_path / "own",
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
    _, hist = train_params(P0, _regression, cfg, _mse, progress=False,
                           eval_fn=lambda params, step: {"at": float(step)})
    assert [h["step"] for h in hist] == list(range(1, 7))
    assert {h["step"]: h["eval/at"] for h in hist if "eval/at" in h} == {2: 2.0, 4: 4.0, 6: 6.0}


def _crashing_at(position_to_fail, source):
    class Crashing:
        batch_size = source.batch_size

        def batch(self, position):
            if position == position_to_fail:
                raise RuntimeError("killed")
            return source.batch(position)

    return Crashing()


def test_a_resumed_run_checks_its_first_batch_too(tmp_path):
    """The first batch of a resumed call is checked like a fresh run's first batch: its rows
    against the batch size and its token ids (a negative id here)."""
    cfg = TrainConfig(steps=4, batch_size=4, ckpt_every=2, log_every=1)
    with pytest.raises(RuntimeError, match="killed"):
        train(TinyMoELM(nnx.Rngs(0)), _crashing_at(2, ToySource(batch_size=4)), cfg,
              run_dir=str(tmp_path), progress=False)
    assert latest_step(tmp_path / "checkpoints") == 2

    class BadFrom2(ToySource):
        def batch(self, position):
            b = super().batch(position)
            if position >= 2:
                b["inputs"][0, 0] = -1
            return b

    with pytest.raises(ValueError, match="negative token id -1"):
        train(TinyMoELM(nnx.Rngs(0)), BadFrom2(batch_size=4), cfg, run_dir=str(tmp_path),
              progress=False)
    assert latest_step(tmp_path / "checkpoints") == 2

    class ShortFrom2:
        batch_size = 4

        def batch(self, position):
            b = ToySource(batch_size=4).batch(position)
            return {k: v[:2] for k, v in b.items()} if position >= 2 else b

    with pytest.raises(ValueError, match="first batch has 2 rows"):
        train(TinyMoELM(nnx.Rngs(0)), ShortFrom2(), cfg, run_dir=str(tmp_path),
              progress=False)


def test_a_users_optimizer_counts_every_update_of_a_resumed_run(tmp_path):
    """A run resumed from its checkpoint hands the caller's optimizer the run's state: its
    step count is the updates that state has seen (the transform's own count), not only
    those of this call."""
    cfg = CFG.replace(steps=5, ckpt_every=2, grad_clip=0.0)
    model = TinyMoELM(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(RuntimeError, match="killed"):
        train(model, _crashing_at(3, ToySource(batch_size=8)), cfg, tx=opt,
              run_dir=str(tmp_path), progress=False)
    assert int(opt.step[...]) == 0  # a failed call leaves the caller's optimizer alone
    train(model, ToySource(batch_size=8), cfg, tx=opt, run_dir=str(tmp_path), progress=False)
    assert int(opt.opt_state[0].count[...]) == 5  # adam's count: the restored run's
    assert int(opt.step[...]) == 5


def test_a_run_cut_to_a_few_rows_by_a_capture_saves_no_checkpoint(tmp_path):
    """Inside capture_steps(rows=...) each step trains on the first rows of its batch: a
    checkpoint of it would be resumed later as the configured run's, so none is written (nor
    a best); a run cut to a few steps only keeps the real steps' checkpoints."""
    from moejax.capture import capture_steps

    cfg = TrainConfig(steps=3, batch_size=4, ckpt_every=1, log_every=1, eval_every=1)
    score = lambda model, step: {"score": float(step)}  # noqa: E731
    with capture_steps(rows=2):
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, run_dir=str(tmp_path / "r"),
              eval_fn=score, keep_best="score", progress=False)
    assert latest_step(tmp_path / "r" / "checkpoints") is None
    assert latest_step(tmp_path / "r" / "best") is None
    with capture_steps(steps=2):
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg.replace(eval_every=0),
              run_dir=str(tmp_path / "s"), progress=False)
    assert latest_step(tmp_path / "s" / "checkpoints") == 2


def test_a_resumed_run_keeps_one_evaluation_row_per_step(tmp_path):
    """Evaluations written after the checkpoint a run resumes from are run again, and
    eval.csv keeps one row per evaluated step, the resumed run's."""
    cfg = CFG.replace(ckpt_every=2, eval_every=1)

    def crashing(position):
        if position == 3:
            raise RuntimeError("killed")
        return _regression(position)

    with pytest.raises(RuntimeError, match="killed"):
        train_params(P0, crashing, cfg, _mse, run_dir=str(tmp_path), progress=False,
                     eval_fn=lambda p, step: {"at": float(step)})
    assert [int(r["step"]) for r in read_csv(tmp_path / "eval.csv")] == [1, 2, 3]
    train_params(P0, _regression, cfg, _mse, run_dir=str(tmp_path), progress=False,
                 eval_fn=lambda p, step: {"at": float(step) + 0.5})
    rows = read_csv(tmp_path / "eval.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert [float(r["at"]) for r in rows] == [1, 2, 3.5, 4.5, 5.5, 6.5]


def test_a_captured_run_whose_first_batch_fails_lets_go_of_its_directory(tmp_path):
    """Inside a capture the first batch is read before the first step, to record the step:
    a source failing there ends the run with the directory unlocked, as a failure while
    opening it does."""
    from moejax.capture import capture_steps
    from moejax.train.run_lock import is_held

    cfg = TrainConfig(steps=2, batch_size=4, log_every=1)
    with capture_steps(steps=1), pytest.raises(RuntimeError, match="killed"):
        train(TinyMoELM(nnx.Rngs(0)), _crashing_at(0, ToySource(batch_size=4)), cfg,
              run_dir=str(tmp_path), progress=False)
    assert not is_held(tmp_path)
    with capture_steps(steps=1):  # the same process runs it again at once
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, run_dir=str(tmp_path),
              progress=False)
