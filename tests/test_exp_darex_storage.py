"""Smoke test: the DAREx storage study writes exact byte counts and apply timings."""

import csv

import pytest

from experiments.darex import storage as mod
from experiments.darex.storage import ACCURACY_TOLERANCE, StorageConfig, claims, make_config
from moejax.config import ConfigError
from moejax.harness.claims import SEED_TABLES
from moejax.harness.experiment import run_experiment


def test_darex_storage_tiny(tmp_path):
    summary, run = run_experiment(
        mod.STUDY.name, mod.make_config, mod.run,
        ["substrate.d_hidden=16", "substrate.train.steps=20", "finetune.steps=20",
         f"substrate_cache={tmp_path / 'subs'}", "ps=(0.0,0.9,0.99)",
         "bits=(32,16,4)",
         "timing_tree=tiny", "timing_repeats=1"],
        claims=mod.claims, out=tmp_path / "st",
    )
    rows = list(csv.DictReader(open(run.path / "storage.csv")))
    assert len(rows) == 3 + 2 * 2 * 3  # p = 0 once; DARE and DAREx-q (q_v) at each p > 0
    every = {(r["method"], float(r["p"]), int(r["bits"])): r for r in rows}
    by = {(p, b): r for (m, p, b), r in every.items() if m in ("unpruned", "DARE")}
    for (m, p, b), r in every.items():
        if m == "DAREx-q (q_v)":  # the same survivors, rescaled by a q on the DAREx grid
            dare = every["DARE", p, b]
            assert r["bytes"] == dare["bytes"] and float(dare["q"]) == pytest.approx(1 - p)
            assert 1 - p - 1e-6 <= float(r["q"]) <= 1.0
            if float(r["q"]) == float(dare["q"]):
                assert r["metric"] == dare["metric"]
    dense = summary["dense_bytes"]
    assert int(by[0.0, 32]["bytes"]) == dense  # lossless dense copy
    assert float(by[0.0, 32]["rel_err"]) == 0.0 and float(by[0.9, 32]["rel_err"]) == 0.0
    # smaller with more pruning and fewer bits
    assert int(by[0.99, 32]["bytes"]) < int(by[0.9, 32]["bytes"]) < dense
    assert int(by[0.0, 4]["bytes"]) < int(by[0.0, 16]["bytes"]) < dense
    assert 0.0 < float(by[0.0, 4]["rel_err"]) < 0.5
    # 16-bit codes of the unpruned delta keep the model's accuracy (to a test image or two)
    assert abs(float(by[0.0, 16]["metric"]) - float(by[0.0, 32]["metric"])) < 0.02
    (w,) = csv.DictReader(open(run.path / "delta_worth.csv"))  # the claim's control
    assert float(w["finetuned"]) == pytest.approx(float(by[0.0, 32]["metric"]))
    assert float(w["delta_worth"]) == pytest.approx(float(w["finetuned"]) - float(w["pretrained"]))
    t = list(csv.DictReader(open(run.path / "apply_time.csv")))
    assert len(t) == 3 and all(float(r["GB_per_s"]) > 0 for r in t)
    assert int(t[0]["params"]) * 12 == pytest.approx(float(t[0]["GB_moved"]) * 1e9)
    assert (run.path / "accuracy_vs_size.png").stat().st_size > 0


def test_darex_q_without_a_model_to_choose_q_on_is_refused():
    with pytest.raises(ConfigError, match=r"without a model to choose DAREx-q's q_v on"):
        StorageConfig(source="smollm2_shapes")
    with pytest.raises(ConfigError, match=r"repeats 'DARE'"):
        StorageConfig(methods=("DARE", "DARE"))
    assert make_config("full").methods == ("DARE",)


def test_the_storage_claim_judges_the_accuracy_lost_by_settings_10x_smaller():
    def row(p, bits, ratio, acc, method="DARE"):
        return {"method": "unpruned" if p == 0 else method, "p": p, "bits": bits,
                "ratio_vs_fp32": ratio, "metric": acc}

    def seeds(rows, n=3, worth=0.5, noise=(0.0, 0.001, -0.0015)):
        # n seed runs: the ratios a little apart, each compressed row's accuracy off by noise
        runs = [{"storage": [{**r, "ratio_vs_fp32": r["ratio_vs_fp32"] * (1 + 0.01 * i),
                              "metric": r["metric"] + (noise[i] if r["p"] or r["bits"] < 32
                                                       else 0.0)}
                             for r in rows],
                 "delta_worth": [{"delta_worth": worth}]} for i in range(n)]
        return {**runs[0], SEED_TABLES: runs}

    rows = [row(0.0, 32, 1.0, 0.94), row(0.9, 32, 8.2, 0.94), row(0.99, 32, 56.0, 0.60)]
    (c,) = claims(seeds(rows))  # 56x, but at 0.60 accuracy; 8.2x is too large to count
    assert c.holds is False and "DARE at p=0.99, 32 bits (56.0x smaller" in c.evidence
    assert "the least loss of 1 settings" in c.evidence
    assert claims({"storage": rows})[0].verdict == "inconclusive"  # one run: no interval
    # DAREx-q (q_v) in the run: its settings 10x smaller are the candidates (DARE's are
    # not counted), the least loss of them judged at the Bonferroni level over them
    darex = [row(0.99, 32, 56.0, 0.62, "DAREx-q (q_v)"),
             row(0.9, 4, 14.1, 0.94 - ACCURACY_TOLERANCE / 2, "DAREx-q (q_v)")]
    (c,) = claims(seeds(rows + darex))
    assert c.holds is True and "DAREx-q (q_v) at p=0.9, 4 bits (14.1x" in c.evidence
    assert "the least loss of 2 settings" in c.evidence
    assert "the best of 2: Bonferroni" in c.evidence and "97.5% CI" in c.evidence
    # an older table without methods: its rows are DARE's
    rows.append(row(0.9, 4, 14.1, 0.94 - ACCURACY_TOLERANCE / 2))
    (c,) = claims(seeds([{k: v for k, v in r.items() if k != "method"} for r in rows]))
    assert c.holds is True and "DARE at p=0.9, 4 bits" in c.evidence
    assert "the least loss of 2 settings" in c.evidence
    # the loss per seed straddles the tolerance: no verdict, though its mean is within it
    at_edge = rows[:-1] + [row(0.9, 4, 14.1, 0.94 - ACCURACY_TOLERANCE + 0.001)]
    assert claims(seeds(at_edge))[0].verdict == "inconclusive"
    # a grid with no setting 10x smaller tests nothing
    (c,) = claims(seeds(rows[:2]))
    assert c.verdict == "inconclusive" and "untested" in c.evidence
    # a delta worth no more than the tolerance stays "within it" when dropped whole: the
    # claim cannot be judged, nor where what the delta is worth was not recorded
    (c,) = claims(seeds(rows, worth=ACCURACY_TOLERANCE / 2))
    assert c.verdict == "inconclusive" and "dropping it whole" in c.evidence
    one_poor = seeds(rows)  # worth enough in two seed runs, not in the third
    one_poor[SEED_TABLES][1]["delta_worth"] = [{"delta_worth": ACCURACY_TOLERANCE / 2}]
    (c,) = claims(one_poor)
    assert c.verdict == "inconclusive" and "dropping it whole" in c.evidence
    no_worth = seeds(rows)
    for run in no_worth[SEED_TABLES]:
        del run["delta_worth"]
    (c,) = claims(no_worth)
    assert c.verdict == "inconclusive" and "was not recorded" in c.evidence
    for missing in ("", "nan", float("nan")):  # a random delta: the CSV holds "nan"
        (c,) = claims({"storage": [{**r, "metric": missing} for r in rows]})
        assert c.verdict == "not measured" and "no accuracy" in c.evidence
    # a setting counts only where it is 10x smaller in every seed run
    edge = seeds(rows[:3] + [row(0.95, 8, 10.0, 0.935)])
    edge[SEED_TABLES][2]["storage"][-1]["ratio_vs_fp32"] = 9.9
    (c,) = claims(edge)
    assert c.holds is False and "the least loss of 1 settings" in c.evidence
    # the candidate with the least loss on the mean over the seed runs, not in the first

    def run(a_acc, b_acc):
        return {"storage": [row(0.0, 32, 1.0, 0.94), row(0.99, 32, 56.0, a_acc),
                            row(0.9, 4, 14.1, b_acc)], "delta_worth": [{"delta_worth": 0.5}]}

    runs = [run(0.939, 0.935), run(0.89, 0.935), run(0.89, 0.935)]
    (c,) = claims({**runs[0], SEED_TABLES: runs})
    assert c.holds is True and "DARE at p=0.9, 4 bits" in c.evidence


def test_the_full_presets_random_delta_is_stored_and_judged_not_measured(tmp_path):
    """The full preset's source (a random delta with SmolLM2-135M's layout, here at its tiny
    size) has no accuracy: every row's metric is NaN and the storage claim says "not
    measured" instead of failing after the tables are written."""
    summary, run = run_experiment(
        mod.STUDY.name, mod.make_config, mod.run,
        ["source=smollm2_shapes_tiny", "methods=(DARE,)", "ps=(0.0,0.9)", "bits=(32,4)",
         "timing_tree=none"],
        claims=mod.claims, out=tmp_path / "st")
    rows = list(csv.DictReader(open(run.path / "storage.csv")))
    assert len(rows) == 4 and all(r["metric"] == "nan" for r in rows)
    assert [r["method"] for r in rows] == ["unpruned"] * 2 + ["DARE"] * 2
    assert int(rows[0]["bytes"]) == summary["dense_bytes"]
    (c,) = csv.DictReader(open(run.path / "claims.csv"))
    assert c["verdict"] == "not measured" and (run.path / "summary.md").exists()


def test_the_summary_names_the_fine_tuning_that_made_the_delta(tmp_path):
    """The storage table and the note name the optimizer the delta was fine-tuned with, and
    say where it is not the recipe's AdamR-L2: an AdamW delta is never labelled AdamR-L2's."""
    common = ["substrate.d_hidden=16", "substrate.train.steps=20", "finetune.steps=20",
              f"substrate_cache={tmp_path / 'subs'}", "ps=(0.0,0.9)", "methods=(DARE,)",
              "bits=(32,)", "timing_tree=none"]
    for extra, label, aside in (
            ([], "AdamR-L2 (lambda 0.1)", False),
            (["finetune.optimizer=adamw", "finetune.weight_decay=0.01"],
             "AdamW (weight decay 0.01)", True)):
        _, run = run_experiment(mod.STUDY.name, mod.make_config, mod.run, common + extra,
                                claims=mod.claims, out=tmp_path / label.split()[0])
        text = (run.path / "summary.md").read_text()
        assert f"### Delta checkpoint size and load/apply time: {label} fine-tuned MLP" in text
        assert f"The delta: the MLP fine-tuned with {label}" in text
        assert ("not the recipe's AdamR-L2" in text) is aside
