"""Smoke tests: both DeRS studies run tiny, upcycling the (tiny) library substrates, build each
substrate once into the cache, say which substrate they started from and write their tables."""

import csv
import math
from pathlib import Path

import pytest

# imported here, not inside a test: their configs' defaults read the substrate registry, which
# the tiny_recipes fixture replaces
from experiments.ders import compression, upcycling
from experiments.ders import upcycling_claims as uc
from experiments.ders.compression import _headline, make_config
from experiments.ders.compression_claims import PAPER_SETTINGS
from moejax.config import ConfigError
from moejax.data.corpora import corpus_tokens, document_tokens
from moejax.data.tokenizer import ByteTokenizer
from moejax.harness.claims import SEED_TABLES
from moejax.harness.experiment import run_experiment
from moejax.harness.results import RunDir
from moejax.harness.tables import read_tables
from moejax.substrates.ders import SubstrateConfig
from moejax.train.hparams import TrainConfig
from tests.tiny_substrates import tiny_lm


def _substrate(cache):
    return SubstrateConfig(pretrained=tiny_lm("dense_lm_prose", "quick"),
                           prefinetuned=tiny_lm("dense_lm_code", "quick"), cache_dir=str(cache),
                           seq_len=16)


TRAIN = TrainConfig(steps=4, batch_size=4, lr=1e-3, warmup_steps=1, log_every=2, seed=2)


@pytest.mark.slow
def test_ders_compression_tiny(tiny_recipes, tmp_path):
    mod = compression

    cfg = mod.make_config("quick").replace(substrate=_substrate(tiny_recipes), train=TRAIN,
                                           drop_rates=(0.0, 0.9), bits=(8, 1), eval_batches=1,
                                           scenarios=("not_finetuned",))
    summary, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                                  claims=mod.claims, out=tmp_path / "comp")
    rows = list(csv.DictReader(open(run.path / "losses.csv")))
    assert [r["scenario"] for r in rows] == ["not_finetuned"]
    for r in rows:
        assert 0 < float(r["dense_val_loss"]) < 10 and 0 < float(r["upcycled_val_loss"]) < 10
    text = (run.path / "summary.md").read_text()
    assert "upcycled from substrate dense_lm_prose" in text
    built = list(tiny_recipes.glob("*/*/model.safetensors"))
    assert [p.parent.parent.name for p in built] == ["dense_lm_prose"]  # built once, only it
    sweep = {(r["method"], r["setting"]): r for r in csv.DictReader(open(run.path / "sweep.csv"))
             if r["decomposed"] == "experts"}
    base_only = sweep["base_only", "all deltas dropped"]
    assert float(base_only["rel_err"]) == 1.0 and int(base_only["delta_bytes"]) == 0
    assert float(sweep["none", "fp32"]["rel_err"]) == 0.0
    # the quantiser's error falls with bits and beats dropping the delta even at 1 bit
    assert 0 < float(sweep["quant", "8"]["rel_err"]) < float(sweep["quant", "1"]["rel_err"]) < 1
    assert "Quantiser: midrise" in text


def test_upcycling_claim_is_inconclusive_when_the_dense_control_matches_too():
    mod = upcycling

    def row(variant, form, d, ratio):
        return {"variant": variant, "form": form, "d_loss_vs_vanilla": d,
                "added_vs_vanilla": ratio}

    def verdict(sm, lm, control, noise=(0.0, 0.0005, -0.0005)):
        seeds = [{"upcycling": [row("vanilla", "vanilla", 0.0, 1.0),
                                row("DeRS-SM p=0.99", "sm", sm + e, 50.0),
                                row("DeRS-LM r=4", "lm", lm + e, 40.0),
                                row(mod.CONTROL, "dense", control + e, 1e9)]}
                 for e in noise]
        return [c.verdict for c in mod.claims({**seeds[0], SEED_TABLES: seeds})[:2]]

    assert verdict(0.004, 0.03, 0.08) == [
        "holds", "does not hold"]           # the experts matter here, and SM keeps them
    assert verdict(0.004, 0.03, 0.002) == [
        "inconclusive", "does not hold"]    # no experts at all match vanilla too
    assert verdict(0.0095, 0.03, 0.08, noise=(0.0, 0.004, -0.004)) == [
        "inconclusive", "does not hold"]    # the seeds straddle the tolerance
    # SM matches, but the control's seeds straddle the tolerance (not shown apart), or the
    # control is missing: either way nothing shows what the experts add
    for control in ([0.01, 0.014, 0.006], []):
        rows = [{"upcycling": [row("vanilla", "vanilla", 0.0, 1.0),
                               row("DeRS-SM p=0.99", "sm", 0.004 + e, 50.0),
                               *(row(mod.CONTROL, "dense", g, 1e9) for g in control[i:i + 1])]}
                for i, e in enumerate((0.0, 0.0005, -0.0005))]
        c = mod.claims({**rows[0], SEED_TABLES: rows})[0]
        assert c.verdict == "inconclusive", c.evidence
        assert ("not shown further than 0.01" if control else "not recorded") in c.evidence
    far = [{"upcycling": [row("vanilla", "vanilla", 0.0, 1.0),  # no control, SM far off
                          row("DeRS-SM p=0.99", "sm", 0.05 + e, 50.0)]}
           for e in (0.0, 0.0005, -0.0005)]
    assert mod.claims({**far[0], SEED_TABLES: far})[0].verdict == "does not hold"
    assert [c.verdict for c in mod.claims({"upcycling": []})] == ["not measured"] * 8
    # the best of several >= 10x variants is judged at a Bonferroni level (0.05 / K)
    seeds = [{"upcycling": [row("vanilla", "vanilla", 0.0, 1.0),
                            *(row(f"DeRS-SM p=0.9{i}", "sm", 0.0085 + e + i / 1e4, 50.0)
                              for i in range(k)),
                            row(mod.CONTROL, "dense", 0.08 + e, 1e9)]}
             for e in (0.0, 0.0005, -0.0005) for k in (1,)]
    one = mod.claims({**seeds[0], SEED_TABLES: seeds})[0]
    assert one.verdict == "holds" and "95% CI" in one.evidence
    seeds = [{"upcycling": [*s["upcycling"][:2],
                            *(row(f"DeRS-SM p=0.9{i}", "sm", 0.0095, 50.0) for i in (1, 2, 3)),
                            s["upcycling"][-1]]} for s in seeds]
    four = mod.claims({**seeds[0], SEED_TABLES: seeds})[0]
    assert four.verdict == "inconclusive" and "the best of 4: Bonferroni" in four.evidence


def _sweep(kept: dict) -> dict:
    """One seed run's ``sweep`` table: each ``(scenario, decomposed, method, setting)`` of
    ``kept`` keeps that share of its deltas' worth (``base_only`` at 1.0)."""
    rows, bases = [], set()
    for (sc, dec, method, setting), k in kept.items():
        if (sc, dec) not in bases:
            bases.add((sc, dec))
            rows.append({"scenario": sc, "decomposed": dec, "method": "base_only",
                         "setting": "all deltas dropped", "d_loss": 1.0})
        rows.append({"scenario": sc, "decomposed": dec, "method": method, "setting": setting,
                     "d_loss": 1.0 - k})
    return {"sweep": rows}


def test_compression_claims_judge_the_papers_settings_per_scenario():
    """Each claim is the paper's setting for its scenario (MoE-LLaVA analog: 0.9, 2 bits,
    even 0.99 and 1 bit; Coder-MoE analog: 0.6 and 2 bits, and 0.4 and 4 bits with the
    universal FFN decomposed too), judged on the worst of its settings per seed run; a
    setting elsewhere does not count, and a scenario whose deltas are worth nothing cannot be
    judged."""
    mod = compression

    def runs(kept_of):  # kept_of(scenario, decomposed, method, setting, seed) -> share kept
        out = []
        for i, e in enumerate((0.0, 0.01, -0.01, 0.005, 0.0)):
            cells = {(sc, dec, m, x): kept_of(sc, dec, m, x, i) + e
                     for sc, dec, settings, _ in PAPER_SETTINGS for m, x in settings}
            cells[("not_finetuned", "experts", "sparse", 0.9)] = 0.1  # not a paper setting
            out.append(_sweep(cells))
        return {**out[0], SEED_TABLES: out}

    got = mod.claims(runs(lambda *a: 0.95))
    assert [c.verdict for c in got] == ["holds"] * 6
    # the MoE-LLaVA analog collapses at drop rate 0.99 only: that claim alone fails
    collapse = runs(lambda sc, dec, m, x, i: 0.3 if (sc, m, x) == ("finetuned", "sparse", 0.99)
                    else 0.95)
    assert [c.verdict for c in mod.claims(collapse)] == ["holds"] * 2 + [
        "does not hold"] + ["holds"] * 3
    # a worst-of-two claim fails on either setting
    quant = runs(lambda sc, dec, m, x, i: 0.5 if (sc, dec, m) == ("not_finetuned", "experts",
                                                                 "quant") else 0.95)
    assert mod.claims(quant)[4].verdict == "does not hold"
    assert "worst of sparse 0.6 and quant 2" in mod.claims(quant)[4].evidence
    # deltas worth nothing in one seed run: that scenario's claims are inconclusive, named
    t = runs(lambda *a: 0.95)
    for r in t[SEED_TABLES][2]["sweep"]:
        if r["scenario"] == "finetuned" and r["method"] == "base_only":
            r["d_loss"] = 0.0
    c = mod.claims(t)[0]
    assert c.verdict == "inconclusive" and "seed run 2: deltas worth nothing" in c.evidence
    assert [x.verdict for x in mod.claims(t)[4:]] == ["holds"] * 2
    # a scenario the run did not train: not measured
    only = {SEED_TABLES: [{"sweep": [r for r in run["sweep"] if r["scenario"] == "finetuned"]}
                          for run in runs(lambda *a: 0.95)[SEED_TABLES]]}
    assert [c.verdict for c in mod.claims(only)[4:]] == ["not measured"] * 2
    assert "seed run 0: no row of the scenario (not run)" in mod.claims(only)[4].evidence
    # a sweep without the paper's setting names the row it lacks
    short = {SEED_TABLES: [{"sweep": [r for r in run["sweep"] if r["setting"] != 0.6]}
                           for run in runs(lambda *a: 0.95)[SEED_TABLES]]}
    c = mod.claims(short)[4]
    assert c.verdict == "not measured" and "no row sparse 0.6 (not in the sweep)" in c.evidence
    # a seed run that cannot tell does not hide the others' clear failure
    fail = runs(lambda sc, dec, m, x, i: 0.3 if sc == "finetuned" else 0.95)
    for r in fail[SEED_TABLES][2]["sweep"]:
        if r["scenario"] == "finetuned" and r["method"] == "base_only":
            r["d_loss"] = 0.0
    c = mod.claims(fail)[0]
    assert c.verdict == "does not hold" and "seed run 2" not in c.evidence, c
    # no seed run can tell, one for want of a row: still measured, so inconclusive
    for r in fail[SEED_TABLES][0]["sweep"]:
        if r["scenario"] == "finetuned" and r["method"] == "base_only":
            r["scenario"] = "elsewhere"
    for run in fail[SEED_TABLES][1:]:
        for r in run["sweep"]:
            if r["scenario"] == "finetuned" and r["method"] == "base_only":
                r["d_loss"] = 0.0
    c = mod.claims(fail)[0]
    assert c.verdict == "inconclusive" and "seed run 0: no row base_only" in c.evidence, c


def test_upcycling_claims_find_the_control_in_the_table_as_written(tmp_path):
    """The table the study writes (read back from its CSV) carries the dense control: where
    DeRS equals the control, the claim does not read holds."""
    mod = upcycling

    def row(variant, form, setting, loss, added):
        return {"variant": variant, "form": form, "setting": setting, "val_loss": loss,
                "val_loss_step0": 2.0, "trainable": 1, "added": added, "added_with_index": added,
                "stored": 1, "model_bytes": 1, "peak_train_bytes": 1, "train_state_bytes": 1,
                "peak_infer_bytes": 1, "infer_arg_bytes": 1, "train_loss_last10": loss}

    rows = [row("vanilla", "vanilla", "", 1.70, 1000), row("DeRS-SM p=0.99", "sm", 0.99, 1.705, 10),
            row("DeRS-LM r=4", "lm", 4, 1.705, 20),
            row(mod.CONTROL, "dense", "", 1.705, 0)]  # the control: no experts, same loss
    for r in rows:
        r["added_vs_vanilla"] = 1000 / max(r["added"], 1)
        r["d_loss_vs_vanilla"] = r["val_loss"] - 1.70
    run = RunDir.create(tmp_path / "up")
    mod._tables(run, rows, {"dense": 1.8})

    tables = read_tables(run.path)
    got = mod.claims({**tables, SEED_TABLES: [tables, tables]})[:2]  # two equal seed runs
    assert [c.verdict for c in got] == ["inconclusive", "inconclusive"]
    assert all("dense control" in c.evidence and "no measurable" in c.evidence for c in got)


def test_upcycling_ablation_claims_pair_the_variants_over_the_seeds(tmp_path):
    """Table 5 (freezing the shared FFN raises the loss of both forms), Table 4a (the lowest
    sparse rate beats the highest) and Table 4b (rank 4 beats the highest rank), read from
    the table the study writes (the settings from the variant names), paired over seeds."""
    mod = upcycling

    def run(i, frozen, rate, rank):  # each margin in its claim's direction, seed noise 1e-4
        e = 1e-4 * (i % 2)
        loss = {("sm", 0.9): 1.70, ("sm", 0.9999): 1.70 + rate, ("lm", 4): 1.70,
                ("lm", 64): 1.70 + rank, ("sm-frozen", 0.9): 1.70 + frozen,
                ("lm-frozen", 4): 1.70 + frozen}
        names = {"sm": "DeRS-SM p={}", "lm": "DeRS-LM r={}",
                 "sm-frozen": "DeRS-SM p={} frozen shared",
                 "lm-frozen": "DeRS-LM r={} frozen shared"}
        rows = [{"variant": names[f].format(x), "form": f, "setting": x, "val_loss": v + e,
                 "d_loss_vs_vanilla": 0.0, "added_vs_vanilla": 2.0}
                for (f, x), v in loss.items()]
        d = RunDir.create(tmp_path / f"r{i}_{frozen}_{rate}_{rank}")
        d.table("upcycling", rows, title="t")
        return read_tables(d.path)

    def verdicts(frozen, rate, rank):
        seeds = [run(i, frozen, rate, rank) for i in range(3)]
        return [c.verdict for c in mod.claims({**seeds[0], SEED_TABLES: seeds})[2:5]]

    assert verdicts(0.02, 0.003, 0.01) == ["holds"] * 3
    assert verdicts(-0.02, -0.003, -0.01) == ["does not hold"] * 3
    got = mod.claims({**run(0, 0.02, 0.003, 0.01), SEED_TABLES: [run(0, 0.02, 0.003, 0.01)]})
    assert [c.verdict for c in got[2:5]] == ["inconclusive"] * 3  # one seed run: no interval
    assert "rank 4 beats rank 64" in got[4].claim and "p=0.9 beats p=0.9999" in got[3].claim


@pytest.mark.slow
def test_ders_upcycling_tiny_with_an_imported_baseline(tiny_recipes, tmp_path):
    """The study's variants, every one equal to the dense substrate at step 0, and
    ``baseline=hf:<dir>``: the tiny OLMoE fixture (its char-level tokenizer) evaluated and
    trained alike on the same text; its row compares in bits per byte, its nats converted to
    the study's byte tokens, and the claims still judge the DeRS rows only."""
    mod = upcycling

    hf = Path(__file__).parent / "fixtures" / "hf_moe" / "olmoe"
    cfg = mod.make_config("quick").replace(substrate=_substrate(tiny_recipes), train=TRAIN,
                                           sm_rates=(0.9,), lm_ranks=(2,), eval_batches=1,
                                           baseline=f"hf:{hf}")
    summary, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                                  claims=mod.claims, out=tmp_path / "up")
    rows = list(csv.DictReader(open(run.path / "upcycling.csv")))
    by = {r["variant"]: r for r in rows}
    assert {"vanilla", "DeRS-SM p=0.9", "DeRS-LM r=2", "DeRS-SM p=0.9 frozen shared"} <= set(by)
    # every upcycled model equals the dense substrate at step 0
    step0 = {float(r["val_loss_step0"]) for r in rows if r["form"] != "imported"}
    assert max(step0) - min(step0) < 1e-4
    assert int(by["DeRS-SM p=0.9"]["added"]) < int(by["vanilla"]["added"])
    assert int(by["dense fine-tuned (control)"]["added"]) == 0  # trained alike, no experts
    text = (run.path / "summary.md").read_text()
    assert "Upcycled from substrate dense_lm_code" in text
    (imp,) = [r for r in rows if r["form"] == "imported"]
    van = by["vanilla"]
    assert imp["variant"].startswith("imported olmoe") and imp["added_vs_vanilla"] == "-"
    # byte tokens: a loss per token is one per byte; the imported row converts to it
    assert abs(float(van["val_bpb"]) * math.log(2) - float(van["val_loss"])) < 1e-6
    assert abs(float(imp["val_bpb"]) * math.log(2) - float(imp["val_loss"])) < 1e-6
    assert 0 < float(imp["val_loss"]) < 10 and float(imp["val_loss"]) != float(
        imp["val_loss_step0"])
    assert "Imported baseline: imported olmoe" in text
    assert "of its tokens are its unknown token" in text  # a char-level vocabulary of 96
    claims = list(csv.DictReader(open(run.path / "claims.csv")))
    assert [c["claim"][:8] for c in claims[:2]] == ["DeRS-SM ", "DeRS-LM "]
    assert all("imported" not in c["evidence"] for c in claims)


def test_document_tokens_of_the_byte_tokenizer_are_the_byte_stream():
    """The documents in any tokenizer's ids cover the bytes the byte stream has: with byte
    tokens, the ids are that stream itself (so its windows are unchanged)."""
    import numpy as np

    ids, n_bytes = document_tokens("stdlib_code", "validation", ByteTokenizer())
    assert np.array_equal(ids, corpus_tokens("stdlib_code", "validation"))
    assert n_bytes == len(ids)


def test_an_imported_baseline_is_checked_before_anything_runs(tmp_path):
    mod = upcycling

    with pytest.raises(ConfigError, match="give hf:<dir> of a Hugging Face MoE"):
        mod.make_config("quick").replace(baseline=f"hf:{tmp_path}")
    hf = Path(__file__).parent / "fixtures" / "hf_moe" / "olmoe"  # 64 positions
    with pytest.raises(ConfigError, match="takes at most 64 positions"):
        mod.make_config("quick").replace(baseline=f"hf:{hf}", substrate=mod.SubstrateConfig(
            seq_len=128))


def _upcycling_runs(rows_of_seed):
    runs = [{"upcycling": rows_of_seed(s)} for s in range(5)]
    return {"upcycling": runs[0]["upcycling"], SEED_TABLES: runs}


def _up_row(variant, form, gap, ratio):
    return {"variant": variant, "form": form, "d_loss_vs_vanilla": gap, "val_loss": 1.7 + gap,
            "added_vs_vanilla": ratio}


def test_upcycling_claims_pick_their_candidates_and_need_every_part():
    """"Matches vanilla" is judged on the trainable-shared variant of >= 10x fewer added
    parameters with the lowest gap (not a frozen one with a lower gap, not a 5x one, not the
    first listed);
    the shared-base claim needs every frozen variant to lose; the rank claim needs a rank
    above the paper's 4."""
    def rows(s):
        e = 0.001 * s
        return [_up_row("DeRS-SM p=0.999", "sm", 0.05 + e, 500.0),
                _up_row("DeRS-SM p=0.5", "sm", -0.04 + e, 5.0),
                _up_row("DeRS-SM p=0.99", "sm", 0.002 + e, 50.0),
                # frozen, lowest gap: a form of its own, so only the candidate rule reads it
                _up_row("DeRS-SM p=0.9 frozen shared", "sm-frozen-x", -0.05 + e, 50.0),
                _up_row("DeRS-SM frozen p=0.99", "sm-frozen", 0.2 + 2 * e, 50.0),  # higher
                _up_row("DeRS-LM r=1", "lm", 0.003 + e, 40.0),
                _up_row("DeRS-LM r=4", "lm", 0.001 + e, 20.0),
                _up_row("DeRS-LM frozen r=4", "lm-frozen", -0.05 + e, 20.0),  # lower loss
                _up_row(uc.CONTROL, "dense", 0.1, 1e9)]

    sm, lm, shared, _, rank = uc.claims(_upcycling_runs(rows))[:5]
    assert sm.evidence.startswith("DeRS-SM p=0.99 (50x"), sm.evidence
    assert lm.evidence.startswith("DeRS-LM r=4 (20x"), lm.evidence
    assert shared.holds is False  # LM's frozen twin has the lower loss (SM's the higher)
    assert rank.holds is None and "no rank 4 and a higher one" in rank.evidence


def test_table_6s_cost_claims_read_the_cost_table_of_each_seed_run(tmp_path):
    """Table 6: DeRS-SM p=0.9 and p=0.99 and DeRS-LM r=4 each cost less model size, training
    memory and inference memory than vanilla, read from the cost table the study writes:
    holds where every one does, does not hold where one costs as much (a tie) or more, and
    not measured where none of the three ran."""
    mod = upcycling

    def run(i, infer_sm_99):
        rows = [{"variant": v, "form": f, "setting": x, "val_loss": 1.7, "stored": n,
                 "model_bytes": 4 * n, "peak_train_bytes": 10 * n, "train_state_bytes": n,
                 "peak_infer_bytes": infer_sm_99 if v == "DeRS-SM p=0.99" else 5 * n,
                 "infer_arg_bytes": n, "d_loss_vs_vanilla": 0.0, "added_vs_vanilla": 2.0}
                for v, f, x, n in (("vanilla", "vanilla", "", 100),
                                   ("DeRS-SM p=0.9", "sm", 0.9, 60),
                                   ("DeRS-SM p=0.99", "sm", 0.99, 50),
                                   ("DeRS-LM r=4", "lm", 4, 55), ("DeRS-LM r=64", "lm", 64, 99))]
        d = RunDir.create(tmp_path / f"r{i}_{infer_sm_99}")
        mod._tables(d, rows, {"dense": 1.8})
        return read_tables(d.path)

    def claims(infer_sm_99):
        seeds = [run(i, infer_sm_99) for i in range(3)]
        return uc.claims({**seeds[0], SEED_TABLES: seeds})[5:]

    size, train, infer = claims(250)
    assert [c.verdict for c in (size, train, infer)] == ["holds"] * 3
    assert "Table 6" in infer.claim and "inference memory" in infer.claim
    assert all(v in infer.evidence for v in ("DeRS-SM p=0.9 ", "DeRS-SM p=0.99 ", "DeRS-LM r=4 "))
    assert "r=64" not in infer.evidence  # not one of Table 6's rows
    assert [c.verdict for c in claims(500)] == ["holds", "holds", "does not hold"]  # a tie
    assert claims(700)[2].verdict == "does not hold"
    none = {"upcycling": [{"variant": "DeRS-LM r=64", "form": "lm", "val_loss": 1.7,
                           "d_loss_vs_vanilla": 0.0, "added_vs_vanilla": 2.0}]}
    assert {c.verdict for c in uc.claims(none)[5:]} == {"not measured"}


def test_the_compression_headline_reads_the_settings_the_run_swept():
    """The headline gives each scenario's two highest drop rates and two fewest bits that the
    run swept (make demo's 0.4 / 0.6 and 4 / 2 bits), not settings it never ran."""
    cfg = make_config("quick").replace(scenarios=("not_finetuned",), drop_rates=(0.4, 0.6),
                                       bits=(4, 2))
    rows = [{"scenario": "not_finetuned", "decomposed": "experts", "method": m, "setting": s,
             "d_loss": d} for m, s, d in (("sparse", 0.4, 0.001), ("sparse", 0.6, 0.002),
                                          ("quant", 4, 0.0005), ("quant", 2, 0.003),
                                          ("base_only", "all deltas dropped", 0.05))]
    assert _headline(cfg, rows) == ("not_finetuned: d_loss drop0.4 +0.0010, drop0.6 +0.0020, "
                                    "4-bit +0.0005, 2-bit +0.0030, base only +0.0500")
    assert "drop0.9 " in _headline(make_config("quick"), rows)  # the quick sweep's 0.9, 0.99
