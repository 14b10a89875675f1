"""The scale a run trained at: the loop's scalars, the largest model's tokens, and every
verdict printed beside it and the paper's."""

import csv
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.harness.claims import Claim, claims_markdown, claims_scale
from moejax.harness.experiment import run_experiment
from moejax.pytree import count_params
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train, train_params
from moejax.train.scale import PARAMS, STEPS, TOKENS_PER_STEP, measure_scale
from tests.toy_models import TinyMoELM, ToySource

CFG = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup_steps=1, log_every=1, seed=0)


def test_the_largest_trained_model_and_its_training_tokens_are_measured():
    small, big = TinyMoELM(nnx.Rngs(0), d=8), TinyMoELM(nnx.Rngs(0), d=32)
    n_big = count_params(nnx.state(big, nnx.Param))
    with measure_scale() as scale:
        train(big, ToySource(batch_size=4, seq_len=16), CFG.replace(steps=5))
        train(small, ToySource(batch_size=2, seq_len=16), CFG.replace(steps=7, batch_size=2))
    assert (scale.params, scale.tokens, scale.runs) == (n_big, 5 * 4 * 16, 2)
    assert scale.text() == (f"{n_big / 1e3:.1f}K parameters, 320 training tokens (the largest "
                            "of 2 trained models)")
    # outside the block nothing is listened to any more
    train(TinyMoELM(nnx.Rngs(1), d=64), ToySource(batch_size=4, seq_len=16), CFG)
    assert scale.params == n_big


def test_a_run_restored_finished_from_its_checkpoints_counts_as_it_ran(tmp_path):
    """A rerun in the same directory trains nothing (its checkpoint is the finished run) and
    reports the scale the first run did, not "no model trained"."""
    runs = []
    for _ in range(2):
        with measure_scale() as scale:
            hist = train(TinyMoELM(nnx.Rngs(0), d=8), ToySource(batch_size=4, seq_len=16),
                         CFG, run_dir=str(tmp_path / "run"), progress=False)
        runs.append((len(hist), scale.params, scale.tokens, scale.runs))
    assert runs[0][0] == 3 and runs[1][0] == 0  # the second restored, nothing trained
    assert runs[1][1:] == runs[0][1:] and runs[0][2:] == (3 * 4 * 16, 1)


def test_nothing_trained_gives_no_scale():
    with measure_scale() as scale:
        jax.monitoring.record_scalar(TOKENS_PER_STEP, 10.0)  # no run started: ignored
        jax.monitoring.record_scalar(STEPS, 10.0)
    assert (scale.runs, scale.text()) == (0, "")
    assert claims_scale("", "") == ""
    assert claims_scale("", "BERT-base") == ("here: no model trained by the run; paper: "
                                             "BERT-base")


def test_each_verdict_gives_the_run_scale_beside_the_papers(tmp_path):
    def make_config(preset):
        return CFG

    def run(cfg, run_dir):
        for params, tokens, steps in ((1000.0, 64.0, 10.0), (5000.0, 128.0, 20.0)):
            jax.monitoring.record_scalar(PARAMS, params)  # as the loop does per run
            jax.monitoring.record_scalar(TOKENS_PER_STEP, tokens)
            jax.monitoring.record_scalar(STEPS, steps)
        run_dir.table("t", [{"a": 1.0}])
        return {"headline": "h"}

    def claims(tables):
        return [Claim("A beats B", True, "1 vs 0")]

    _, r = run_experiment("scaled", make_config, run, [], out=tmp_path / "r", claims=claims,
                          paper_scale="a 7B model, 1T tokens")
    want = ("here: 5.0K parameters, 2.6K training tokens (the largest of 2 trained models); "
            "paper: a 7B model, 1T tokens")
    (row,) = list(csv.DictReader(open(r.path / "claims.csv")))
    assert row["scale"] == want
    assert json.loads((r.path / "run.json").read_text())["scale"] == want.split("; paper")[0][6:]
    assert f"- **holds**: A beats B (1 vs 0) [scale {want}]" in (r.path / "summary.md").read_text()
    assert claims_markdown([Claim("c", None, "e")]) == "- **not measured**: c (e)\n"


class _Images:
    """Batches of float features and integer labels (no token ids)."""

    def batch(self, position):
        rng = np.random.default_rng(position)
        return {"images": rng.normal(size=(6, 28, 28)).astype(np.float32),
                "labels": rng.integers(0, 10, 6).astype(np.int32)}


def test_image_batches_count_examples_not_pixels():
    def loss(params, batch, key):
        logits = batch["images"].reshape(6, -1) @ params["w"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(6), batch["labels"]])

    params = {"w": jnp.zeros((784, 10), jnp.float32)}
    with measure_scale() as scale:
        train_params(params, _Images(), CFG.replace(steps=4, batch_size=6), loss)
    assert (scale.params, scale.tokens, scale.unit) == (7840, 24, "examples")
    assert scale.text() == "7.8K parameters, 24 training examples"


@pytest.mark.slow
def test_the_merged_run_of_a_repeat_gives_the_scale_beside_its_verdicts(tmp_path):
    def run(cfg, run_dir):
        jax.monitoring.record_scalar(PARAMS, 1000.0)
        jax.monitoring.record_scalar(TOKENS_PER_STEP, 64.0)
        jax.monitoring.record_scalar(STEPS, 10.0)
        run_dir.table("t", [{"a": float(cfg.seed)}])
        return {"headline": "h"}

    _, r = run_experiment("scaled", lambda preset: CFG, run, ["repeat=2"], out=tmp_path / "r",
                          claims=lambda tables: [Claim("A beats B", True, "1 vs 0")],
                          seed_keys=("seed",))
    want = "1.0K parameters, 640 training tokens"
    assert json.loads((r.path / "run.json").read_text())["scale"] == want
    (row,) = list(csv.DictReader(open(r.path / "claims.csv")))
    assert row["scale"] == f"here: {want}; paper: not stated"


def test_a_params_mask_is_a_bool_per_leaf():
    tree = {"a": jnp.ones((2, 3)), "b": {"c": jnp.ones(4), "d": jnp.ones(())}}
    assert count_params(tree) == 11
    assert count_params(tree, {"a": False, "b": {"c": True, "d": True}}) == 5
    with pytest.raises(ValueError, match="the mask has 2 leaves but the tree 3"):
        count_params(tree, {"a": False, "b": True})  # a prefix would drop leaves unseen
