"""The training loop's keep_best and resume: the best evaluated parameters kept across a crash,
a failed evaluation and a damaged best step; a resumed run's first batch checked, its
optimizer's count, its evaluation rows; and a run cut by a capture saving no checkpoint."""

import os

import optax
import pytest
from flax import nnx

from moejax.capture import capture_steps
from moejax.train.checkpoint import latest_step
from moejax.train.hparams import TrainConfig
from moejax.train.loop import read_csv, train, train_params
from moejax.train.run_lock import is_held
from tests.test_train_loop_tx import CFG
from tests.toy_models import LIN_P0, TinyMoELM, ToySource, lin_batch, lin_mse, tree_equal


def test_keep_best_returns_the_best_evaluated_parameters():
    """The evaluation peaks at step 2 of 5: keep_best ends with step 2's parameters (equal to
    a 2-step run's), not the last step's, and says so in history.best."""
    cfg = CFG.replace(steps=5, eval_every=1, log_every=1, schedule="constant")
    score = lambda params, step: {"score": -abs(step - 2.0)}  # noqa: E731
    best, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=score, keep_best="score",
                              progress=False)
    two, _ = train_params(LIN_P0, lin_batch, cfg.replace(steps=2, eval_every=0), lin_mse,
                          progress=False)
    assert hist.best == {"step": 2, "value": 0.0, "mode": "max"} and len(hist) == 5
    assert tree_equal(best, two)
    tie = lambda params, step: {"score": -min(abs(step - 2.0), abs(step - 4.0))}  # noqa: E731
    _, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=tie, keep_best="score",
                           progress=False)
    # a tie keeps the earlier evaluation
    assert hist.best == {"step": 2, "value": 0.0, "mode": "max"}
    nan_first = lambda params, step: {"score": float("nan") if step == 1 else -step}  # noqa: E731
    _, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=nan_first, keep_best="score",
                           progress=False)
    # a NaN evaluation is never the best
    assert hist.best == {"step": 2, "value": -2.0, "mode": "max"}
    with pytest.raises(ValueError, match="keep_best"):
        train_params(LIN_P0, lin_batch, cfg.replace(eval_every=0), lin_mse, keep_best="score",
                     progress=False)


def test_keep_best_survives_a_crash_and_a_second_call_of_the_finished_run(tmp_path):
    """The evaluation peaks at step 2 of 6; the run crashes during step 5 (checkpoints at 2
    and 4, a best step written at 2). The resumed run ends with step 2's parameters, as the
    uninterrupted run does, and so does the finished run called again (no step run); a best
    step past the resumed one is set aside, not resumed from."""
    cfg = CFG.replace(steps=6, eval_every=1, log_every=1, schedule="constant", ckpt_every=2)
    score = lambda params, step: {"score": -abs(step - 2.0)}  # noqa: E731
    want, _ = train_params(LIN_P0, lin_batch, cfg.replace(ckpt_every=0), lin_mse, eval_fn=score,
                           keep_best="score", progress=False)

    def crashing(position):
        if position == 4:
            raise RuntimeError("killed")
        return lin_batch(position)

    run = dict(eval_fn=score, keep_best="score", run_dir=str(tmp_path), progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train_params(LIN_P0, crashing, cfg, lin_mse, **run)
    assert latest_step(tmp_path / "checkpoints") == 4
    assert latest_step(tmp_path / "best") == 2
    resumed, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, **run)
    assert [h["step"] for h in hist] == [5, 6]
    assert hist.best == {"step": 2, "value": 0.0, "mode": "max"} and tree_equal(resumed, want)
    again, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, **run)
    assert len(hist) == 0 and hist.best == {"step": 2, "value": 0.0, "mode": "max"}
    assert tree_equal(again, want)
    # a best step past the resumed one (its run crashed before the step's own checkpoint)
    late = tmp_path / "late"
    with pytest.raises(RuntimeError, match="killed"):
        train_params(LIN_P0, crashing, cfg.replace(ckpt_every=3), lin_mse,
                     **{**run, "run_dir": str(late)})
    os.rename(late / "checkpoints" / "3", late / "checkpoints" / "moved")  # as if never saved
    resumed, hist = train_params(LIN_P0, lin_batch, cfg.replace(ckpt_every=3), lin_mse,
                                 **{**run, "run_dir": str(late)})
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6] and tree_equal(resumed, want)
    assert os.listdir(late / "best" / ".after-resume")
    with pytest.raises(ValueError, match=r"keeps the best by 'score' \(max\), this run by "
                                         r"'other' \(max\)"):
        train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=lambda p, s: {"other": 1.0},
                     keep_best="other", run_dir=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match=r"this run by 'score' \(min\)"):  # another mode
        train_params(LIN_P0, lin_batch, cfg, lin_mse, **run, keep_best_mode="min")


def test_keep_best_of_a_lower_is_better_metric_needs_its_mode():
    """keep_best keeps the highest evaluation by default: a loss would keep its worst step.
    A metric that reads as lower-is-better is refused before any step unless the mode is
    said; keep_best_mode="min" keeps the lowest."""
    cfg = CFG.replace(steps=5, eval_every=1, log_every=1, schedule="constant")
    loss = lambda params, step: {"loss": abs(step - 2.0), "val_kl": 1.0}  # noqa: E731
    for key in ("loss", "val_kl", "PPL", "bpb", "val_ce"):
        with pytest.raises(ValueError, match=f"keep_best='{key}' reads as a metric where "
                                             "lower is better.*keep_best_mode='min'"):
            train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=loss, keep_best=key,
                         progress=False)
    best, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=loss, keep_best="loss",
                              keep_best_mode="min", progress=False)
    two, _ = train_params(LIN_P0, lin_batch, cfg.replace(steps=2, eval_every=0), lin_mse,
                          progress=False)
    assert hist.best == {"step": 2, "value": 0.0, "mode": "min"} and tree_equal(best, two)
    _, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=loss, keep_best="loss",
                           keep_best_mode="max", progress=False)  # said: taken as said
    assert hist.best == {"step": 5, "value": 3.0, "mode": "max"}
    with pytest.raises(ValueError, match="keep_best_mode='lowest'; use 'max'"):
        train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=loss, keep_best="loss",
                     keep_best_mode="lowest", progress=False)
    with pytest.raises(ValueError, match="keep_best_mode='min' without keep_best"):
        train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=loss, keep_best_mode="min",
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
    want, _ = train_params(LIN_P0, lin_batch, cfg.replace(ckpt_every=0), lin_mse, eval_fn=score,
                           keep_best="score", progress=False)

    def failing(params, step):
        if step == 4:
            raise RuntimeError("evaluator failed")
        return score(params, step)

    run = dict(keep_best="score", run_dir=str(tmp_path), progress=False)
    with pytest.raises(RuntimeError, match="evaluator failed"):
        train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=failing, **run)
    assert latest_step(tmp_path / "checkpoints") == 4
    got, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, eval_fn=score, **run)
    assert [h["step"] for h in hist] == [5, 6] and tree_equal(got, want)
    assert hist.best == {"step": 4, "value": 0.0, "mode": "max"}
    assert [int(r["step"]) for r in read_csv(tmp_path / "eval.csv")] == [2, 4, 6]
    last = tmp_path / "last"  # the last step's evaluation fails: the run's end is kept
    late = lambda params, step: failing(params, step + 2)  # noqa: E731 - fails at step 2
    with pytest.raises(RuntimeError, match="evaluator failed"):
        train_params(LIN_P0, lin_batch, cfg.replace(steps=2), lin_mse, eval_fn=late,
                     **{**run, "run_dir": str(last)})
    assert latest_step(last / "checkpoints") == 2
    _, hist = train_params(LIN_P0, lin_batch, cfg.replace(steps=2), lin_mse, eval_fn=score,
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
        return lin_batch(position)

    for damaged, best in ((False, {"step": 4, "value": 0.5, "mode": "max"}),
                          (True, {"step": 2, "value": 0.0, "mode": "max"})):
        run = dict(eval_fn=score, keep_best="score", run_dir=str(tmp_path / str(damaged)),
                   progress=False)
        with pytest.raises(RuntimeError, match="killed"):
            train_params(LIN_P0, crashing, cfg, lin_mse, **run)
        assert latest_step(tmp_path / str(damaged) / "best") == 4
        if damaged:
            os.remove(tmp_path / str(damaged) / "best" / "4" / "state" / "_METADATA")
        _, hist = train_params(LIN_P0, lin_batch, cfg, lin_mse, **run)
        assert [h["step"] for h in hist] == [5, 6] and hist.best == best


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
        return lin_batch(position)

    with pytest.raises(RuntimeError, match="killed"):
        train_params(LIN_P0, crashing, cfg, lin_mse, run_dir=str(tmp_path), progress=False,
                     eval_fn=lambda p, step: {"at": float(step)})
    assert [int(r["step"]) for r in read_csv(tmp_path / "eval.csv")] == [1, 2, 3]
    train_params(LIN_P0, lin_batch, cfg, lin_mse, run_dir=str(tmp_path), progress=False,
                 eval_fn=lambda p, step: {"at": float(step) + 0.5})
    rows = read_csv(tmp_path / "eval.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert [float(r["at"]) for r in rows] == [1, 2, 3.5, 4.5, 5.5, 6.5]


def test_a_captured_run_whose_first_batch_fails_lets_go_of_its_directory(tmp_path):
    """Inside a capture the first batch is read before the first step, to record the step:
    a source failing there ends the run with the directory unlocked, as a failure while
    opening it does."""
    cfg = TrainConfig(steps=2, batch_size=4, log_every=1)
    with capture_steps(steps=1), pytest.raises(RuntimeError, match="killed"):
        train(TinyMoELM(nnx.Rngs(0)), _crashing_at(0, ToySource(batch_size=4)), cfg,
              run_dir=str(tmp_path), progress=False)
    assert not is_held(tmp_path)
    with capture_steps(steps=1):  # the same process runs it again at once
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, run_dir=str(tmp_path),
              progress=False)
