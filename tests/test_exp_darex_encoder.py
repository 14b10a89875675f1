"""Smoke test: the encoder DAREx study (tiny byte-encoder substrate, WordNet pos ->
supersense) runs tiny and names the substrate it fine-tunes."""

import csv

import numpy as np
import pytest

from experiments import darex_encoder as mod  # imported before tiny_recipes patches the registry
from moejax.experiment import run_experiment
from moejax.substrates.classify import ByteEncoderTaskConfig
from tests.tiny_substrates import tiny_train


def test_darex_encoder_tiny(tiny_recipes, tmp_path):
    cfg = mod.make_config("quick").replace(
        substrate=ByteEncoderTaskConfig(d_model=16, n_layers=1, n_heads=2, seq_len=16,
                                        max_train_examples=200, eval_examples=32,
                                        train=tiny_train(4)),
        substrate_cache=str(tiny_recipes),
        finetune=mod.make_config("quick").finetune.replace(batch_size=16, steps=10,
                                                            warmup_steps=5),
        n_train=400, n_val=64, n_test=64, seeds=2, q_num=3, eta_num=3)
    summary, run = run_experiment(mod.NAME, lambda preset: cfg, mod.run, [],
                                  out=tmp_path / "enc")
    text = (run.path / "summary.md").read_text()
    assert "Started from substrate byte_encoder_wordnet_pos" in text
    rows = list(csv.DictReader(open(run.path / "encoder_p.csv")))
    methods = [r["method"] for r in rows]
    for m in ("unpruned", "DARE", "DAREx-q (q_v)", "DAREx-q (q_e)", "DAREx-q (per-layer q_v)",
              "DAREx-q (per-layer q_e)", "WANDA", "structural DPP + q_v", "AdamR-L2 + DARE",
              "AdamR-L2 + structural DPP + q_v",
              "AdamR-L1 + magnitude"):
        assert m in methods, m
    for r in rows:
        assert int(r["n_seeds"]) == 2
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and float(r["accuracy std"]) >= 0.0
    seeds = list(csv.DictReader(open(run.path / "per_seed.csv")))
    assert {int(r["seed"]) for r in seeds} == {0, 1}
    assert all(float(r["q"]) == pytest.approx(0.01) for r in seeds if r["method"] == "DARE")
    sweep = list(csv.DictReader(open(run.path / "fig1_lexname.csv")))
    qs = np.array([float(r["q"]) for r in sweep])
    assert qs.min() == pytest.approx(0.01) and qs.max() == pytest.approx(1.0)
    assert (run.path / "fig1_acc_lexname.png").exists()
    assert (run.path / "fig1_change_lexname.png").exists()
    assert 0.0 <= summary["DARE"] <= 1.0
