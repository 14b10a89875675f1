"""Training loop: CSV/eval/checkpoint outputs, crash + automatic resume reproduces the
uninterrupted run bitwise, NonFiniteError before a corrupt update is saved, and an
integration run of DecoderLM with an MoE slot."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.data.lm_batches import WindowBatches
from moejax.nn import decoder, moe
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.slots import layer_pattern
from moejax.train import budget
from moejax.train.checkpoint import Checkpointer, latest_step
from moejax.train.hparams import TrainConfig, make_optimizer
from moejax.train.loop import read_csv, train, train_params
from moejax.train.step import NonFiniteError, init_train_state
from tests.toy_models import TinyMoELM, ToySource, tree_equal

CFG = TrainConfig(
    steps=6,
    batch_size=4,
    lr=1e-2,
    warmup_steps=1,
    schedule="cosine",
    ckpt_every=3,
    eval_every=3,
    log_every=2,
    seed=1,
)
PLAIN = CFG.replace(ckpt_every=0, eval_every=0)  # for a call without eval_fn or run_dir


class Crash(RuntimeError):
    pass


class CrashingSource(ToySource):
    """Raises when asked for ``crash_at`` (simulates a killed job)."""

    def __init__(self, crash_at, **kw):
        super().__init__(**kw)
        self.crash_at = crash_at

    def batch(self, position):
        if position == self.crash_at:
            raise Crash(f"killed at data position {position}")
        return super().batch(position)


class NaNSource(ToySource):
    def batch(self, position):
        b = super().batch(position)
        if position == 2:
            b["mask"] = b["mask"].copy()
            b["mask"][0, 0] = np.nan
        return b


def _eval_fn(model, step):
    logits, _ = model(ToySource(batch_size=2).batch(999)["inputs"])
    return {"logit_mean": float(np.mean(logits))}


def test_loop_outputs_and_crash_resume_is_exact(tmp_path):
    straight_model = TinyMoELM(nnx.Rngs(0))
    hist_a = train(
        straight_model,
        ToySource(batch_size=4),
        CFG,
        run_dir=str(tmp_path / "a"),
        eval_fn=_eval_fn,
        progress=False,
    )
    assert [h["step"] for h in hist_a] == [1, 2, 3, 4, 5, 6]
    rows = read_csv(tmp_path / "a" / "metrics.csv")
    assert list(rows[0])[:5] == ["step", "loss", "lr", "grad_norm", "tokens_per_s"]
    assert {"ce", "aux_loss", "accuracy", "aux/gate_max"} <= set(rows[0])
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert float(rows[0]["lr"]) == pytest.approx(1e-2) and float(rows[0]["tokens_per_s"]) > 0
    ev = read_csv(tmp_path / "a" / "eval.csv")
    assert [int(r["step"]) for r in ev] == [3, 6] and "eval/logit_mean" in hist_a[2]
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["3", "6"]
    assert (tmp_path / "a" / "config.json").exists()

    # crash while fetching data position 4 (after step 4 was logged, checkpoint at 3)
    run_b = str(tmp_path / "b")
    with pytest.raises(Crash):
        train(
            TinyMoELM(nnx.Rngs(0)),
            CrashingSource(5, batch_size=4),
            CFG.replace(eval_every=0),  # no eval_fn: the run's evaluation cadence unset
            run_dir=run_b,
            progress=False,
        )
    assert latest_step(os.path.join(run_b, "checkpoints")) == 3
    resumed_model = TinyMoELM(nnx.Rngs(0))  # fresh model: the loop restores from step 3
    hist_b = train(resumed_model, ToySource(batch_size=4), CFG.replace(eval_every=0),
                   run_dir=run_b, progress=False)
    assert [h["step"] for h in hist_b] == [4, 5, 6]
    assert [h["loss"] for h in hist_b] == [h["loss"] for h in hist_a[3:]]
    rows_b = read_csv(os.path.join(run_b, "metrics.csv"))
    assert [int(r["step"]) for r in rows_b] == [1, 2, 3, 4, 5, 6]  # stale row 4/5 dropped
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows]
    assert tree_equal(nnx.state(resumed_model, nnx.Param), nnx.state(straight_model, nnx.Param))

    # a finished run resumes to a no-op
    assert (
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), CFG.replace(eval_every=0),
              run_dir=run_b, progress=False)
        == []
    )


def test_loop_raises_non_finite_before_saving(tmp_path):
    cfg = CFG.replace(ckpt_every=1, eval_every=0)
    with pytest.raises(NonFiniteError, match="at step 2 .*data position 2"):
        train(
            TinyMoELM(nnx.Rngs(0)),
            NaNSource(batch_size=4),
            cfg,
            run_dir=str(tmp_path),
            progress=False,
        )
    assert latest_step(tmp_path / "checkpoints") == 2  # steps 1, 2 saved; the bad one not
    assert [int(r["step"]) for r in read_csv(tmp_path / "metrics.csv")] == [1, 2]


def test_source_batch_size_must_match():
    with pytest.raises(ValueError, match="batch_size"):
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=3), PLAIN, progress=False)


@pytest.mark.parametrize("setting, needs", [
    (dict(eval_every=3), "eval_fn"), (dict(ckpt_every=2), "run_dir"),
    (dict(keep_checkpoints=5), "run_dir"), (dict(tensorboard=True), "run_dir"),
    (dict(resume="force"), "run_dir"), (dict(eval_every=3, ckpt_every=2), "eval_fn and run_dir"),
])
def test_a_setting_the_call_would_ignore_is_refused_before_it_runs(tmp_path, setting, needs):
    """The evaluation cadence is read only with an eval_fn, the checkpoint, TensorBoard and
    resume settings only with a run_dir: taken without them, a run recorded them in its
    config and ran as if they were unset. Refused before any step, naming the fix, for a model
    and a plain pytree alike; given what reads it, the same setting runs."""
    model = TinyMoELM(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    cfg = PLAIN.replace(steps=2, **setting)
    field = next(iter(setting))
    match = f"{field}=.* is read only with {needs}, which this call was not given"
    with pytest.raises(ValueError, match=match) as e:
        train(model, ToySource(batch_size=4), cfg, progress=False)
    assert f"leave {field} at its default, {TrainConfig._default(field)!r}" in str(e.value)
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match=match):
        train_params(before, ToySource(batch_size=4), cfg, lambda p, batch, key: 0.0)
    if needs == "eval_fn":  # a run directory does not read the evaluation cadence either
        with pytest.raises(ValueError, match=match):
            train(model, ToySource(batch_size=4), cfg, run_dir=str(tmp_path / "r"),
                  progress=False)
        assert not (tmp_path / "r").exists()
    hist = train(model, ToySource(batch_size=4), cfg, run_dir=str(tmp_path / "ok"),
                 eval_fn=_eval_fn, progress=False)
    assert len(hist) == 2


def test_decoder_lm_with_moe_trains_and_resumes(tmp_path):
    slots = layer_pattern(
        2,
        DenseFFNConfig(d_hidden=32, activation="swiglu"),
        moe.MoEConfig(n_experts=4, top_k=2, d_expert=16, dispatch="dense", router="noisy"),
    )
    mcfg = decoder.DecoderConfig(
        vocab_size=32, d_model=16, n_layers=2, n_heads=2, ffn_slots=slots, max_seq_len=16
    )
    rng = np.random.default_rng(0)
    tokens = np.tile(rng.integers(0, 32, size=40), 20)  # repetitive: learnable
    src = WindowBatches(tokens, batch_size=4, seq_len=8, seed=0)
    cfg = TrainConfig(
        steps=6,
        batch_size=4,
        lr=1e-2,
        warmup_steps=0,
        schedule="constant",
        ckpt_every=3,
        grad_accum=2,
        precision="bfloat16",
    )
    hist = train(
        decoder.DecoderLM(mcfg, rngs=nnx.Rngs(0)), src, cfg, run_dir=str(tmp_path), progress=False
    )
    assert len(hist) == 6 and all(np.isfinite(h["loss"]) for h in hist)
    assert hist[-1]["ce"] < hist[0]["ce"]
    assert hist[0]["aux_loss"] > 0
    # the checkpoint restores into a freshly built DecoderLM state (expert stacks included)

    _, template = init_train_state(
        decoder.DecoderLM(mcfg, rngs=nnx.Rngs(1)), make_optimizer(cfg), 0
    )
    restored, meta = Checkpointer(tmp_path / "checkpoints").restore(template)
    assert int(restored.step) == 6 and meta["data_position"] == 6
    assert restored.params["blocks"][1]["ffn"]["experts"]["w_up"][...].shape[0] == 4


def test_a_step_that_cannot_fit_the_device_is_refused_before_it_runs(tmp_path, monkeypatch):
    model = TinyMoELM(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    assert budget.available_bytes(jax.devices()[0])[0] > 1e9  # this host: the real memory
    monkeypatch.setattr(budget, "available_bytes", lambda device: (1000, "a 1 kB device"))
    with pytest.raises(budget.MemoryBudgetError) as e:
        train(model, ToySource(batch_size=4), CFG.replace(eval_every=0),
              run_dir=str(tmp_path / "r"), progress=False)
    msg = str(e.value)
    assert " per device" in msg and "a 1 kB device is 1.0 kB" in msg
    assert "batch_size (now 4)" in msg and "grad_accum" in msg and "\n" not in msg
    assert not (tmp_path / "r" / "checkpoints").exists()  # refused before anything ran
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    monkeypatch.undo()
    assert len(train(model, ToySource(batch_size=4), PLAIN.replace(steps=1), progress=False)) == 1
