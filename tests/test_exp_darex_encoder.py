"""Smoke test: the encoder DAREx study (tiny byte-encoder substrate, WordNet pos ->
supersense) runs tiny and names the substrate it fine-tunes."""

import csv

import jax
import numpy as np
import pytest

from experiments.darex import encoder as mod  # imported before tiny_recipes patches the registry
from moejax.data import datasets
from moejax.harness.experiment import run_experiment
from moejax.substrates.classify import ByteEncoderTaskConfig
from tests.tiny_substrates import tiny_train


@pytest.mark.slow
def test_darex_encoder_tiny(tiny_recipes, tmp_path):
    cfg = mod.make_config("quick").replace(
        model="substrate", tasks=("lexname",),
        substrate=ByteEncoderTaskConfig(d_model=16, n_layers=1, n_heads=2, seq_len=16,
                                        max_train_examples=200, eval_examples=32,
                                        train=tiny_train(4)),
        substrate_cache=str(tiny_recipes),
        finetune=mod.make_config("quick").finetune.replace(batch_size=16, steps=10,
                                                            warmup_steps=5),
        n_train=400, n_val=64, n_test=64, seeds=2, q_num=3, eta_num=3)
    summary, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                                  claims=mod.claims, out=tmp_path / "enc")
    text = (run.path / "summary.md").read_text()
    assert "Started from substrate byte_encoder_wordnet_pos" in text
    assert "Glosses per task: 400 train, 64 validation, 64 test." in text
    assert "DARE at p=0.99 loses (unpruned - DARE, AdamW): lexname " in text
    rows = list(csv.DictReader(open(run.path / "encoder_p.csv")))
    methods = [r["method"] for r in rows]
    for m in ("unpruned", "DARE", "DAREx-q (q_v)", "DAREx-q (q_e)", "DAREx-q (per-layer q_v)",
              "DAREx-q (per-layer q_e)", "magnitude", "WANDA", "structural DPP + q_v",
              "AdamR-L2 + DARE",
              "AdamR-L2 + structural DPP + q_v",
              "AdamR-L1 + magnitude", mod.DROPPED):
        assert m in methods, m
    # the control row of each fine-tuning: its pruned deltas dropped whole
    assert {r["fine-tuning"] for r in rows if r["method"] == mod.DROPPED} == {
        "AdamW", "AdamR-L2", "AdamR-L1"}
    for r in rows:
        assert int(r["n_seeds"]) == 2
    seeds = list(csv.DictReader(open(run.path / "per_seed.csv")))
    for r in rows:  # the table is the mean and sample std of the per-seed rows
        acc = [float(s["accuracy"]) for s in seeds if (s["task"], s["fine-tuning"],
               s["method"]) == (r["task"], r["fine-tuning"], r["method"])]
        assert float(r["accuracy"]) == pytest.approx(np.mean(acc))
        assert float(r["accuracy std"]) == pytest.approx(np.std(acc, ddof=1))
    assert {int(r["seed"]) for r in seeds} == {0, 1}
    assert all(float(r["q"]) == pytest.approx(0.01) for r in seeds if r["method"] == "DARE")
    sweep = list(csv.DictReader(open(run.path / "fig1_lexname.csv")))
    qs = np.array([float(r["q"]) for r in sweep])
    assert qs.min() == pytest.approx(0.01) and qs.max() == pytest.approx(1.0)
    assert (run.path / "fig1_acc_lexname.png").exists()
    assert (run.path / "fig1_change_lexname.png").exists()
    last = cfg.tasks[-1]  # the headline reports the last task's AdamW + DARE row
    assert summary["DARE"] == pytest.approx(next(
        float(r["accuracy"]) for r in rows
        if (r["task"], r["fine-tuning"], r["method"]) == (last, "AdamW", "DARE")))
    mp = list(csv.DictReader(open(run.path / "magnitude_p.csv")))
    assert {(r["fine-tuning"], float(r["p"])) for r in mp} == {
        (ft, p) for ft in ("AdamW", "AdamR-L1") for p in (0.9, 0.95, 0.99)}
    # the table's p = 0.99 entries are the main table's magnitude rows
    main = {(r["fine-tuning"], r["method"]): float(r["accuracy"]) for r in rows}
    at99 = {r["fine-tuning"]: float(r["accuracy"]) for r in mp if float(r["p"]) == 0.99}
    assert at99["AdamW"] == pytest.approx(main["AdamW", "magnitude"])
    assert at99["AdamR-L1"] == pytest.approx(main["AdamR-L1", "AdamR-L1 + magnitude"])


def test_darex_encoder_optimizer_subset_and_head_not_anchored(tiny_recipes, tmp_path,
                                                              monkeypatch):
    """``optimizers`` picks the fine-tunings that run; AdamR decays the encoder only (the
    classifier head has no pre-trained value to anchor at) unless ``regularise_head``; run i's
    head is drawn from ``seed + i``, as its batches are (another base seed, other heads)."""
    heads = []

    class Recorded(mod.SequenceClassifier):
        def __init__(self, *a, rngs):
            heads.append(np.asarray(jax.random.key_data(rngs.default.key[...])).tolist())
            super().__init__(*a, rngs=rngs)

    monkeypatch.setattr(mod, "SequenceClassifier", Recorded)
    base = mod.make_config("quick")
    cfg = base.replace(
        model="substrate", tasks=("lexname",),
        substrate=ByteEncoderTaskConfig(d_model=16, n_layers=1, n_heads=2, seq_len=16,
                                        max_train_examples=200, eval_examples=32,
                                        train=tiny_train(4)),
        substrate_cache=str(tiny_recipes),
        finetune=base.finetune.replace(batch_size=16, steps=10, warmup_steps=5),
        n_train=400, n_val=64, n_test=64, seeds=1, optimizers=("adamr_l1",), l1_weight=1.0,
        seed=3)
    summary, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                                  claims=mod.claims, out=tmp_path / "enc")
    assert heads[-1] == np.asarray(jax.random.key_data(jax.random.key(3))).tolist()
    rows = list(csv.DictReader(open(run.path / "per_seed.csv")))
    assert {r["fine-tuning"] for r in rows} == {"AdamR-L1"}
    assert {r["method"] for r in rows} == {"unpruned", "AdamR-L1 + magnitude", mod.DROPPED}
    assert set(summary) >= {"AdamR-L1 unpruned", "AdamR-L1 + magnitude"}
    assert "DARE" not in summary and not (run.path / "fig1_lexname.csv").exists()

    tc = mod.finetune_configs(cfg)
    assert tc["adamw"] == cfg.finetune
    assert tc["adamr_l1"].decay_paths == tc["adamr_l2"].decay_paths == "^encoder/"
    assert (tc["adamr_l1"].optimizer, tc["adamr_l1"].weight_decay) == ("adamr_l1", 1.0)
    assert mod.finetune_configs(cfg.replace(regularise_head=True))["adamr_l2"].decay_paths == ""


def test_the_full_preset_asks_no_more_glosses_than_the_splits_hold():
    """Each full-preset count is at most its split's rows, so the configuration says what runs
    (a count past its split runs the whole split while the config names more)."""
    cfg = mod.make_config("full")
    for split, n in (("train", cfg.n_train), ("validation", cfg.n_val), ("test", cfg.n_test)):
        assert n <= len(datasets.load("wordnet_glosses", split)), (split, n)


def test_claims_pair_every_task_and_seed_not_the_last_tasks_means():
    def rows(dare, darex, dropped=(0.1,) * 6):
        out = []
        for i, (task, seed) in enumerate([(t, s) for t in ("a", "b") for s in (0, 1, 2)]):
            out += [{"task": task, "seed": seed, "fine-tuning": "AdamW", "method": "DARE",
                     "accuracy": dare[i]},
                    {"task": task, "seed": seed, "fine-tuning": "AdamW",
                     "method": "DAREx-q (q_v)", "accuracy": darex[i]}]
            if dropped is not None:
                out.append({"task": task, "seed": seed, "fine-tuning": "AdamW",
                            "method": mod.DROPPED, "accuracy": dropped[i]})
        return {"per_seed": out}

    base = [0.5, 0.52, 0.48, 0.7, 0.71, 0.69]
    better = [b + 0.1 + 0.01 * i for i, b in enumerate(base)]
    (c, *rest) = mod.claims(rows(base, better))
    assert c.holds is True and "wins 6/6 (task, seed) pairs" in c.evidence
    assert "tasks a, b" in c.evidence
    assert "it beats the AdamW delta dropped whole" in c.evidence
    assert c.evidence.count("wins 6/6 (task, seed) pairs") == 2  # the claim and its control
    # the control: a winner no better than its delta dropped whole keeps nothing of it, and
    # a run that did not record the dropped delta cannot say
    (c, *_) = mod.claims(rows(base, better, dropped=[b + 0.1 for b in better]))
    assert c.verdict == "inconclusive" and "keeps nothing shown" in c.evidence
    (c, *_) = mod.claims(rows(base, better, dropped=None))
    assert c.verdict == "inconclusive" and "was not recorded" in c.evidence
    assert all(r.verdict == "not measured" for r in rest)  # those methods did not run
    # the last task alone favours DAREx-q, the first task more strongly the other way
    mixed = [b + (0.02 if i >= 3 else -0.2) for i, b in enumerate(base)]
    assert mod.claims(rows(base, mixed))[0].verdict != "holds"


def test_claims_take_each_fine_tunings_own_control_and_pair_only_common_units():
    """Every fine-tuning has its own "delta dropped whole" row: the AdamR-L2 claims check
    the AdamR-L2 winner against AdamR-L2's dropped delta, not AdamW's; a loser below the
    control does not matter; a (task, seed) one arm did not run is left out of the pairs."""
    def rows(l2_dropped, skip_seed=None):
        out = []
        for task, seed in [(t, s) for t in ("a", "b") for s in (0, 1, 2)]:
            x = 0.1 + 0.01 * seed
            acc = {("AdamR-L2", "AdamR-L2 + structural DPP + q_v"): 0.2 + x + 0.4,
                   ("AdamR-L2", mod.DROPPED): l2_dropped,
                   ("AdamW", "structural DPP + q_v"): 0.05,  # the loser: below both controls
                   ("AdamW", mod.DROPPED): 0.3}
            out += [{"task": task, "seed": seed, "fine-tuning": ft, "method": m, "accuracy": a}
                    for (ft, m), a in acc.items()
                    if not (seed == skip_seed and m == "structural DPP + q_v")]
        return {"per_seed": out}

    def dpp(**kw):
        return next(c for c in mod.claims(rows(**kw)) if "structural DPP" in c.claim)

    c = dpp(l2_dropped=0.1)
    assert c.verdict == "holds" and "AdamR-L2 delta dropped whole" in c.evidence, c
    # the AdamR-L2 winner no better than its own delta dropped whole: unchecked gain
    assert dpp(l2_dropped=0.9).verdict == "inconclusive"
    c = dpp(l2_dropped=0.1, skip_seed=2)  # seed 2 of the loser missing: 4 pairs
    assert c.verdict == "holds" and "wins 4/4" in c.evidence, c
