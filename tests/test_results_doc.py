"""The results document and the claim helpers: a run directory written by the runner
(run.json, tables, claims) is read back into docs; claims are judged from tables."""

import json
import shutil

import pytest

from experiments import results_doc
from experiments.blockffn import granularity as blockffn_granularity
from moejax.config import ConfigError
from moejax.harness.claims import (
    SEED_TABLES,
    Claim,
    compare,
    lookup,
    paired,
    paired_claim,
    top_column,
)
from moejax.harness.experiment import run_experiment
from moejax.harness.results import RunDir


def test_lookup_compare_and_top_column():
    rows = [{"method": "DARE", "p": 0.9, "acc": 0.5}, {"method": "DARE", "p": "0.99", "acc": 0.2}]
    assert lookup(rows, {"method": "DARE", "p": 0.99}, "acc") == 0.2  # "0.99" == 0.99
    assert lookup(rows, {"method": "WANDA"}) is None
    assert top_column([{"p=0.5": 1, "p=0.99": 2, "p=0.9 std": 3, "method": "x"}]) == "p=0.99"
    c = compare("a beats b", ("a", 0.3), ("b", 0.4))
    assert (c.holds, c.verdict, c.evidence) == (False, "does not hold", "a 0.3 vs b 0.4")
    assert compare("lower wins", ("a", 0.3), ("b", 0.4), better="lower").holds is True
    assert compare("missing", ("a", None), ("b", 0.4)).holds is None
    assert compare("nan", ("a", float("nan")), ("b", 0.4)).verdict == "not measured"


def test_paired_differences_by_hand():
    # a - b per seed: 0.1, -0.2, 0.4 -> mean 0.1, sample std sqrt((0 + 0.09 + 0.09) / 2) = 0.3
    row = paired("A - B", [0.5, 0.3, 0.9], [0.4, 0.5, 0.5])
    assert row["mean_diff"] == pytest.approx(0.1) and row["std_diff"] == pytest.approx(0.3)
    assert (row["wins"], row["n"], row["comparison"]) == (2, 3, "A - B")
    c = paired_claim("A beats B", row)
    # 95% CI: 0.1 +/- t(2) 4.3027 * 0.3 / sqrt(3) = [-0.6452, 0.8452]: contains zero
    assert c.verdict == "inconclusive" and c.holds is None
    assert "0.1000 +/- 0.3000, wins 2/3 seeds, 95% CI [-0.6452, 0.8452]" in c.evidence
    assert paired_claim("x", None).verdict == "not measured"
    one = paired("one", [1.0], [0.5])
    assert one["std_diff"] == 0.0 and paired_claim("x", one).verdict == "inconclusive"
    with pytest.raises(ValueError, match="equal, non-zero lengths"):
        paired("bad", [1.0], [1.0, 2.0])


def test_a_paired_value_that_is_not_a_number_is_not_measured():
    """A NaN or infinite value (a run that could not measure it, e.g. a diverged loss) leaves
    the claim not measured, not inconclusive; a metric that lies below still decides it."""
    nan, inf = float("nan"), float("inf")
    for a in ([0.5, nan, 0.9], [0.5, inf, 0.9]):
        c = paired_claim("A beats B", paired("A - B", a, [0.4, 0.5, 0.5]))
        assert c.verdict == "not measured" and "not a number" in c.evidence
    up = paired("up", [1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    down = paired("down", [0.0, 1.0, 2.0], [1.0, 2.1, 3.0])
    bad = paired("bad", [nan, 1.0, 2.0], [0.0, 0.0, 0.0])
    assert paired_claim("both", [up, bad]).verdict == "not measured"
    assert paired_claim("both", [down, bad]).verdict == "does not hold"


@pytest.mark.parametrize("seed", range(20))
def test_paired_verdicts_follow_the_interval(seed):
    """Properties over random seeds: a clear shift holds (its mirror does not), arms equal in
    every seed do not hold (the first is better in none), noise-dominated shifts follow the
    interval, the interval holds the mean, and several metrics hold only together."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    b = rng.normal(size=n)
    noise = rng.normal(scale=0.01, size=n)
    up = paired("A - B", list(b + 1.0 + noise), list(b))
    assert paired_claim("A beats B", up).holds is True
    assert paired_claim("B beats A", paired("B - A", list(b), list(b + 1.0 + noise))).holds \
        is False
    same = paired_claim("same", paired("same", list(b), list(b)))
    assert same.verdict == "does not hold" and "equal in every seed" in same.evidence
    tiny = paired("tiny", list(b + 1e-3 + rng.normal(scale=1.0, size=n)), list(b))
    c = paired_claim("tiny", tiny)
    lo, hi = (float(v) for v in c.evidence.split("CI [")[1].rstrip("]").split(", "))
    assert lo <= tiny["mean_diff"] <= hi
    assert c.verdict == ("holds" if lo > 0 else "does not hold" if hi < 0 else "inconclusive")
    assert paired_claim("both", [up, up]).holds is True
    assert paired_claim("both", [up, paired("same", list(b), list(b))]).verdict == \
        "does not hold"
    assert paired_claim("both", [up, tiny]).verdict == ("holds" if lo > 0 else
                                                        "does not hold" if hi < 0 else
                                                        "inconclusive")
    down = paired("B - A", list(b), list(b + 1.0 + noise))
    assert paired_claim("both", [up, down]).holds is False


def test_the_best_of_several_settings_is_judged_at_a_bonferroni_level():
    """A threshold claim on the best of K settings widens its interval to 1 - 0.05/K: the
    same values that clear the threshold at 95% can be inconclusive as the best of many."""
    from moejax.harness.claims import threshold_claim

    values = [1.62, 1.58, 1.66, 1.55, 1.64]  # mean 1.61, 95% CI [1.554, 1.666]
    assert threshold_claim("c", values, 1.5).verdict == "holds"
    c = threshold_claim("c", values, 1.5, candidates=2)  # 97.5%: [1.540, 1.680]
    assert c.verdict == "holds" and "97.5% CI [0.04009, 0.1799]" in c.evidence
    assert threshold_claim("c", values, 1.6).verdict == "inconclusive"
    c = threshold_claim("c", [v + 0.05 for v in values], 1.6)  # 95%: [1.604, 1.716]
    assert c.verdict == "holds" and "95% CI" in c.evidence
    c = threshold_claim("c", [v + 0.05 for v in values], 1.6, candidates=20)
    assert c.verdict == "inconclusive" and "99.75% CI" in c.evidence
    assert "the best of 20: Bonferroni" in c.evidence
    with pytest.raises(ValueError, match="candidates"):
        threshold_claim("c", values, 1.5, candidates=0)


def test_granularity_claim_pairs_the_seed_runs():
    from moejax.harness.claims import SEED_TABLES

    def tables(*ppl_by_seed, tls=(0.8, 0.8, 0.8)):
        seeds = [{"granularity": [{"n_experts": n, "val_ppl": v, "TLS": s}
                                  for n, v, s in zip((4, 8, 32), p, tls)]}
                 for p in ppl_by_seed]
        return {"granularity": seeds[0]["granularity"], SEED_TABLES: seeds}

    def ppl_claims(t):  # the PPL claims, without the sparsity claim after them
        *ppl, peak = blockffn_granularity.claims(t)
        assert peak.claim == blockffn_granularity.PEAK_CLAIM
        return ppl

    one = ppl_claims(tables((12.0, 11.5, 11.0)))
    assert one[0].verdict == "inconclusive" and "N=32 11 vs N=4 12" in one[0].evidence
    five = tables(*[(12.0 + e, 11.5 + e, 11.0 + e) for e in (0.0, 0.1, -0.2, 0.3, 0.05)])
    finest, steps = ppl_claims(five)
    assert finest.holds is True and steps.holds is True and "wins 5/5" in finest.evidence
    worse = tables(*[(11.0 + e, 11.5 + e, 12.0 + e) for e in (0.0, 0.1, -0.2, 0.3, 0.05)])
    assert [c.verdict for c in ppl_claims(worse)] == ["does not hold"] * 2
    mixed = tables(*[(12.0 + e, 11.0 + e, 11.5 + e) for e in (0.0, 0.1, -0.2, 0.3, 0.05)])
    assert [c.verdict for c in ppl_claims(mixed)] == [
        "holds", "does not hold"]  # N=32 beats N=4, but N=8 -> N=32 goes up
    diverged = tables(*[(12.0 + e, float("nan") if e else 11.5, 11.0 + e)
                        for e in (0.0, 0.1, -0.2, 0.3, 0.05)])
    assert [c.verdict for c in ppl_claims(diverged)] == [
        "holds", "not measured"]  # N=8's loss is NaN in four seed runs
    # at close TLS only (half an expert of the finer setting): a finer setting denser by
    # more than that may owe its lower PPL to its density; sparser, it stands
    ppl = [(12.0 + e, 11.5 + e, 11.0 + e) for e in (0.0, 0.1, -0.2, 0.3, 0.05)]
    denser = ppl_claims(tables(*ppl, tls=(0.8, 0.75, 0.7)))
    assert [c.verdict for c in denser] == ["inconclusive"] * 2
    assert "not close" in denser[0].evidence
    sparser = ppl_claims(tables(*ppl, tls=(0.7, 0.75, 0.8)))
    assert [c.verdict for c in sparser] == ["holds"] * 2
    close = ppl_claims(tables(*ppl, tls=(0.8, 0.8, 0.79)))  # 1/64 at N=32
    assert [c.verdict for c in close] == ["holds"] * 2


def _study(cfg, run: RunDir) -> dict:
    run.table("granularity", [{"n_experts": 4, "val_ppl": 9.0 + cfg.seed},
                              {"n_experts": 8, "val_ppl": 8.0 + 0.5 * cfg.seed}])
    run.note("- the caveat of this run")
    return {"headline": f"seed {cfg.seed}", "ppl_n4": 9.0 + cfg.seed, "steps": 3}


def test_runner_records_the_run_and_the_document_reads_it(tmp_path, monkeypatch):
    from moejax.train.hparams import TrainConfig

    make = lambda preset: TrainConfig(seed=0)  # noqa: E731  any config with an int seed
    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", make, _study, ["preset=quick", "repeat=2"],
                   out=out, seed_keys=("seed",), claims=blockffn_granularity.claims)
    record = json.loads((out / "run.json").read_text())
    assert record["command"] == "python -m experiments.blockffn_granularity preset=quick repeat=2"
    assert record["seeds"] == {"seed": [0, 1]} and record["machine"]["cores"] >= 1
    summary = (out / "summary.md").read_text()
    # PPL 9 -> 8 and 10 -> 8.5: N=8 better on both seeds by 1 and 1.5, mean 1.25, std 0.354,
    # 95% CI 1.25 +/- 12.706 * 0.354 / sqrt(2) = [-1.93, 4.43]: two seeds cannot tell
    assert "**inconclusive**: Finer experts lower PPL" in summary and "wins 2/2" in summary
    assert "one seed: no interval" in (out / "seed_0" / "summary.md").read_text()
    assert "Mean over 2 seed runs (seed): ppl_n4 9.5 +/- 0.71." in summary  # numbers in it
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity", "moee"))
    doc = results_doc.build(tmp_path / "runs", tmp_path / "docs" / "results.md").read_text()
    assert "Not run: moee, moee[minilm]." in doc  # and its declared variant
    assert "| blockffn_granularity | Finer experts lower PPL at equal FFN width" in doc
    assert "- seeds: seed = 0, 1" in doc and "repeat=2`" in doc
    assert "| 4 | 9.5 | 0.7071 |" in doc  # the merged table: mean and std over the seeds
    assert "- the caveat of this run" in doc  # the run's notes, and its claims once
    assert "- run 0: seed 0" in doc and "- run 1: seed 1" in doc  # each run's headline
    assert doc.count("**inconclusive**: Finer experts lower PPL") == 1
    assert "wins 2/2 seeds" in doc  # judged again from the seed runs' tables, paired
    # the scale beside the paper's: _study trains nothing through the loop
    assert ("[scale here: no model trained by the run; paper: BlockFFN and baseline LMs of "
            "0.1B") in doc
    assert (tmp_path / "docs" / "results" / "blockffn_granularity" / "granularity.csv").is_file()


def test_a_study_whose_run_is_gone_keeps_its_section_and_a_failed_rebuild_keeps_all(
        tmp_path, monkeypatch):
    from moejax.train.hparams import TrainConfig

    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                   ["preset=quick", "repeat=2"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity", "moee"))
    doc_path = tmp_path / "docs" / "results.md"
    table = tmp_path / "docs" / "results" / "blockffn_granularity" / "granularity.csv"
    first = results_doc.build(tmp_path / "runs", doc_path).read_text()
    section = first[first.index("## blockffn_granularity\n"):]
    row = next(line for line in first.splitlines() if line.startswith("| blockffn_granul"))
    shutil.rmtree(out)  # the run is gone (a GPU machine given back): its section stays
    again = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert section in again and row in again and table.is_file()
    assert ("Carried over from the previous document, their runs not being readable here "
            "(each section names where and when it ran): blockffn_granularity.") in again
    assert "Not run: moee, moee[minilm]." in again

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                   ["preset=quick"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    monkeypatch.setattr(results_doc, "_section", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        results_doc.build(tmp_path / "runs", doc_path)
    assert doc_path.read_text() == again and table.is_file()  # the old document, whole
    assert sorted(p.name for p in doc_path.parent.iterdir()) == ["results", "results.md"]


def test_a_carried_section_is_judged_again_by_todays_rules_on_its_own_tables(tmp_path,
                                                                            monkeypatch):
    """A repeated run's section, carried after its run is gone, keeps its seed runs' tables
    beside it, and its claims are judged again by the study's current rule; a section whose
    tables were not all carried keeps the verdicts its run gave, and the document says so."""
    from moejax.train.hparams import TrainConfig

    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                   ["preset=quick", "repeat=2"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc_path = tmp_path / "docs" / "results.md"
    first = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "**inconclusive**: Finer experts lower PPL" in first
    assets = tmp_path / "docs" / "results" / "blockffn_granularity"
    assert (assets / "seed_1" / "granularity.csv").is_file()
    shutil.rmtree(out)
    seen = []

    def new_rule(tables):
        seen.append(len(tables.get(SEED_TABLES, [])))
        return [Claim("Finer experts lower PPL at equal FFN width (App. F, Fig. 5)", False,
                      "today's rule")]

    monkeypatch.setattr(blockffn_granularity, "claims", new_rule)
    again = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert seen == [2] and "**does not hold**: Finer experts lower PPL" in again
    assert "| blockffn_granularity | Finer experts lower PPL at equal FFN width (App. F, " \
           "Fig. 5) | does not hold |" in again
    assert "judged again by today's claim rules on the tables carried with them: " \
           "blockffn_granularity." in again

    def unreadable(tables):  # today's rule cannot read the carried tables: they stay judged
        raise KeyError("a column today's rule needs")

    monkeypatch.setattr(blockffn_granularity, "claims", unreadable)
    odd = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "**does not hold**: Finer experts lower PPL" in odd
    assert "| blockffn_granularity | Finer experts lower PPL at equal FFN width (App. F, " \
           "Fig. 5) | does not hold |" in odd
    assert "as their runs judged them" in odd
    shutil.rmtree(assets / "seed_0")  # a section documented before seed tables were kept
    shutil.rmtree(assets / "seed_1")
    monkeypatch.setattr(blockffn_granularity, "claims", lambda t: [])
    kept = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "**does not hold**: Finer experts lower PPL" in kept
    assert "as their runs judged them (the tables that would judge them again were not " \
           "carried: rerun them): blockffn_granularity." in kept


def _study_with_a_ratio(cfg, run: RunDir) -> dict:
    run.table("granularity", [{"n_experts": 4, "val_ppl": 9.0, "gain": 1.0},
                              {"n_experts": 8, "val_ppl": 8.0, "gain": 1.5},  # 9 / 8 = 1.125
                              {"n_experts": 16, "val_ppl": 7.5, "gain": ""}])
    return {"headline": "a table with a derived column"}


def test_a_carried_section_has_the_columns_it_derives_computed_again(tmp_path, monkeypatch):
    """A carried section's derived columns (its study module's ``derived_tables``) are
    computed again by today's rule, in its CSV and its inline table, every measured cell kept
    to the character, and the document names it; a rule that cannot read the tables leaves
    the section as it was, and is not named."""
    from moejax.train.hparams import TrainConfig

    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0),
                   _study_with_a_ratio, ["preset=quick"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc_path = tmp_path / "docs" / "results.md"
    table = tmp_path / "docs" / "results" / "blockffn_granularity" / "granularity.csv"
    first = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "| 4 | 9 | 1 |\n| 8 | 8 | 1.5 |\n| 16 | 7.5 |  |\n" in first
    shutil.rmtree(out)  # carried from now on

    def unreadable(tables):
        raise KeyError("a column today's rule needs")

    monkeypatch.setattr(blockffn_granularity, "derived_tables", unreadable, raising=False)
    kept = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "| 8 | 8 | 1.5 |" in kept and "derived from what was measured" not in kept

    def today(tables):  # the gain over N=4's perplexity
        rows = tables["granularity"]
        return {"granularity": [{**r, "gain": rows[0]["val_ppl"] / r["val_ppl"]}
                                for r in rows]}

    monkeypatch.setattr(blockffn_granularity, "derived_tables", today, raising=False)
    again = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "| 4 | 9 | 1 |\n| 8 | 8 | 1.125 |\n| 16 | 7.5 | 1.2 |\n" in again
    assert table.read_text().splitlines() == ["n_experts,val_ppl,gain", "4,9.0,1.0",
                                              "8,8.0,1.125", "16,7.5,1.2"]
    said = ("Their columns derived from what was measured computed again by today's rules: "
            "blockffn_granularity.")
    assert said in again
    assert results_doc.build(tmp_path / "runs", doc_path).read_text() == again  # a fixed point


def test_forget_leaves_out_a_carried_section_whose_run_no_longer_stands(tmp_path,
                                                                       monkeypatch):
    """forget=: a carried-over section (its run gone) is left out and named as not run, and
    the command that wrote the document says so; an unknown study is refused."""
    from moejax.train.hparams import TrainConfig

    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                   ["preset=quick"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity", "moee"))
    doc_path = tmp_path / "docs" / "results.md"
    table = tmp_path / "docs" / "results" / "blockffn_granularity" / "granularity.csv"
    assert "## blockffn_granularity" in results_doc.build(tmp_path / "runs", doc_path).read_text()
    shutil.rmtree(out)
    runs, path, source, forget, _, _ = results_doc._parse(
        [f"runs={tmp_path / 'runs'}", f"out={doc_path}", "forget=blockffn_granularity"])
    assert forget == ("blockffn_granularity",) and source.endswith(" forget=blockffn_granularity")
    gone = results_doc.build(runs, path, source, forget).read_text()
    assert "## blockffn_granularity" not in gone and not table.exists()
    assert "| blockffn_granularity |" not in gone and "Carried over" not in gone
    assert "Not run: blockffn_granularity, moee, moee[minilm]." in gone
    assert "forget=blockffn_granularity" in gone
    with pytest.raises(ConfigError, match="nope is no study"):
        results_doc._parse([f"runs={tmp_path / 'runs'}", "forget=moee,nope"])


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="run the studies first"):
        results_doc._parse([f"runs={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=r"\*.md"):
        results_doc._parse([f"runs={tmp_path}", "out=results.txt"])
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    (tmp_path / "folder.md").mkdir()
    for out, why in ((a_file / "results.md", "taken is a file, not a directory"),
                     (tmp_path / "folder.md", "folder.md is a directory")):
        with pytest.raises(ConfigError, match=why):  # a line, not a traceback
            results_doc._parse([f"runs={tmp_path}", f"out={out}"])
    assert a_file.read_text() == "x"
    for index in (tmp_path / "typo.jsonl", tmp_path):  # not a doc of every study "not run"
        with pytest.raises(ConfigError, match=f"index={index} is no file"):
            results_doc._parse([f"index={index}", f"out={tmp_path / 'r.md'}"])
    assert results_doc.main(["colour=blue"]) == 2
    assert Claim("c", None, "e").verdict == "not measured"


def test_the_document_never_removes_a_folder_it_did_not_write(tmp_path):
    runs = tmp_path / "runs"
    (runs / "moee").mkdir(parents=True)
    (runs / "moee" / "config.json").write_text("{}")
    # out=runs.md: its assets folder would be the runs themselves
    assert results_doc.main([f"runs={runs}", f"out={tmp_path / 'runs.md'}"]) == 2
    assert (runs / "moee" / "config.json").is_file()
    # out beside an unrelated folder of the same stem
    (tmp_path / "important").mkdir()
    (tmp_path / "important" / "data.txt").write_text("keep me")
    assert results_doc.main([f"runs={runs}", f"out={tmp_path / 'important.md'}"]) == 2
    assert (tmp_path / "important" / "data.txt").read_text() == "keep me"
    assert not (tmp_path / "important.md").exists()
    # a folder holding the runs further down is refused too
    with pytest.raises(ConfigError, match="holds the runs"):
        results_doc._parse([f"runs={runs}", f"out={tmp_path}.md"])
    # its own folder (marked) is replaced on every rebuild, stale files included
    out = tmp_path / "docs" / "results.md"
    assert results_doc.main([f"runs={runs}", f"out={out}"]) == 0
    assets = tmp_path / "docs" / "results"
    assert (assets / results_doc.ASSETS_MARKER).is_file()
    (assets / "stale.png").write_text("old")
    assert results_doc.main([f"runs={runs}", f"out={out}"]) == 0
    assert not (assets / "stale.png").exists() and (assets / results_doc.ASSETS_MARKER).is_file()


def test_a_run_held_by_a_live_lock_is_not_read(tmp_path, monkeypatch):
    from moejax.train.hparams import TrainConfig
    from moejax.train.run_lock import RunLock, is_held

    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                   ["preset=quick"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc_path = tmp_path / "docs" / "results.md"
    assert not is_held(out)
    with RunLock(out):  # a rerun has started in that directory
        assert is_held(out)
        doc = results_doc.build(tmp_path / "runs", doc_path).read_text()
    assert "Running when this was generated (not read): blockffn_granularity." in doc
    assert "## blockffn_granularity" not in doc
    assert not is_held(out)
    assert "## blockffn_granularity" in results_doc.build(tmp_path / "runs", doc_path).read_text()


def test_threshold_claims_need_the_interval_past_the_threshold():
    from moejax.harness.claims import threshold_claim

    assert threshold_claim("x", [0.95, 0.96, 0.94, 0.955, 0.945], 0.9).holds is True
    assert threshold_claim("x", [0.85, 0.86, 0.84, 0.855, 0.845], 0.9).holds is False
    assert threshold_claim("x", [0.95, 0.80, 0.99], 0.9).verdict == "inconclusive"
    assert threshold_claim("x", [0.95], 0.9).verdict == "inconclusive"   # one seed
    assert threshold_claim("x", [0.05, 0.04, 0.06], 0.1, better="lower").holds is True
    assert threshold_claim("x", [], 0.9).verdict == "not measured"


def test_a_declared_variant_is_run_indexed_and_documented_apart(tmp_path, monkeypatch):
    """A study's variant (its quick preset with declared overrides) keeps its own newest run
    in the index and its own section, beside the study's own run."""
    from experiments import main as suite
    from moejax.harness import run_index
    from moejax.harness.study import Study
    from moejax.train.hparams import TrainConfig

    study = Study("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                  claims=blockffn_granularity.claims, variants=(("late", ("seed=7",)),))
    monkeypatch.setenv(run_index.ENV, str(tmp_path / "index.jsonl"))
    runs = tmp_path / "runs"
    study.run_experiment(["preset=quick"], out=runs / "blockffn_granularity")
    study.run_experiment(["preset=quick"], out=runs / "blockffn_granularity_late",
                         variant="late")
    paths, _ = run_index.newest("cpu")
    assert paths == {"blockffn_granularity": runs / "blockffn_granularity",
                     "blockffn_granularity[late]": runs / "blockffn_granularity_late"}
    record = json.loads((runs / "blockffn_granularity_late" / "run.json").read_text())
    # the command names the variant, so it reproduces into the same section
    assert record["variant"] == "late"
    assert record["command"] == ("python -m experiments.blockffn_granularity preset=quick "
                                 "variant=late")
    monkeypatch.setattr(suite, "load_study", lambda name: study)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc = results_doc.build(runs, tmp_path / "docs" / "results.md").read_text()
    assert "## blockffn_granularity\n" in doc and "## blockffn_granularity[late]\n" in doc
    assert "Headline: seed 0" in doc and "Headline: seed 7" in doc
    assert "| blockffn_granularity[late] | Finer experts lower PPL" in doc
    assert (tmp_path / "docs" / "results" / "blockffn_granularity_late" /
            "granularity.csv").is_file()
    # by hand: out= names the directory as given; without it, runs/<study>_<variant>
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    study.run_experiment(["preset=quick", f"out={runs / 'mine'}"], variant="late")
    study.run_experiment(["preset=quick"], variant="late")
    assert (runs / "mine" / "run.json").is_file()
    assert [p.name for p in (tmp_path / "cwd" / "runs").iterdir()] == [
        "blockffn_granularity_late"]
    with pytest.raises(ConfigError, match="variant=early: give one of the variants "
                       "blockffn_granularity declares: late"):
        study.run_experiment(["preset=quick"], out=runs / "x", variant="early")
    assert not (runs / "x").exists()  # refused before anything is written
    with pytest.raises(ValueError, match="expected a name"):
        Study("s", study.make_config, _study, variants=(("two words", ("seed=1",)),))
    with pytest.raises(ValueError, match="key=value"):
        Study("s", study.make_config, _study, variants=(("v", ("seed",)),))


def test_an_accelerator_variant_is_a_preset_run_documented_on_an_accelerator_only(
        tmp_path, monkeypatch):
    """A study's accelerator variant (what the GPU check measures) runs at any preset as a
    preset run, is indexed under its own name, and has a section in an accelerator's document
    only: the CPU document neither holds it nor lists it as not run, and the quick suite does
    not run it."""
    from experiments import main as suite
    from moejax.harness import run_index
    from moejax.harness.study import Study
    from moejax.train.hparams import TrainConfig

    study = Study("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                  claims=blockffn_granularity.claims, variants=(("late", ("seed=7",)),),
                  accelerator_variants=(("gpu", ("seed=9",)),))
    monkeypatch.setenv(run_index.ENV, str(tmp_path / "index.jsonl"))
    runs = tmp_path / "runs"
    study.run_experiment(["preset=full"], out=runs / "blockffn_granularity_gpu", variant="gpu")
    record = json.loads((runs / "blockffn_granularity_gpu" / "run.json").read_text())
    assert record["kind"] == "preset" and record["variant"] == "gpu"
    assert record["command"] == ("python -m experiments.blockffn_granularity preset=full "
                                 "variant=gpu")
    assert run_index.newest("cpu")[0] == {
        "blockffn_granularity[gpu]": runs / "blockffn_granularity_gpu"}
    monkeypatch.setattr(suite, "load_study", lambda name: study)
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    assert [v for _, _, v in suite._jobs_with_variants(
        [("blockffn_granularity", ())], "quick", "studies")] == ["", "late"]
    cpu = results_doc.build(runs, tmp_path / "docs" / "results.md").read_text()
    assert "[gpu]" not in cpu
    assert "Not run: blockffn_granularity, blockffn_granularity[late]." in cpu
    gpu = results_doc.build(runs, tmp_path / "docs" / "results_gpu.md",
                            accelerator=True).read_text()
    assert "## blockffn_granularity[gpu]\n" in gpu and "Headline: seed 9" in gpu
    assert "Not run: blockffn_granularity, blockffn_granularity[late]." in gpu
    assert results_doc._parse([f"runs={runs}", "machine=gpu", "forget=blockffn_granularity[gpu]"]
                              )[5] is True
    with pytest.raises(ConfigError, match=r"blockffn_granularity\[gpu\] is no study"):
        results_doc._parse([f"runs={runs}", "forget=blockffn_granularity[gpu]"])
    with pytest.raises(ValueError, match="variant late declared twice"):
        Study("s", study.make_config, _study, variants=(("late", ("seed=1",)),),
              accelerator_variants=(("late", ("seed=2",)),))


def test_a_record_from_before_tables_and_seed_runs_were_kept_is_read_from_its_summary(
        tmp_path, monkeypatch):
    """A run.json without ``tables`` and ``seed_runs``: the claims get the tables its summary
    links (not a stray CSV of its directory) and its ``repeat`` seed runs' tables."""
    from moejax.train.hparams import TrainConfig

    out = tmp_path / "runs" / "blockffn_granularity"
    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), _study,
                   ["preset=quick", "repeat=2"], out=out, seed_keys=("seed",),
                   claims=blockffn_granularity.claims)
    record = json.loads((out / "run.json").read_text())
    del record["tables"], record["seed_runs"]
    (out / "run.json").write_text(json.dumps(record))
    (out / "stray.csv").write_text("n_experts,val_ppl\n4,1\n")
    (out / "seed_0" / "stray.csv").write_text("n_experts,val_ppl\n4,1\n")
    seen = []
    monkeypatch.setattr(blockffn_granularity, "claims", lambda t: seen.append(
        (sorted(k for k in t if k != SEED_TABLES), [sorted(s) for s in t[SEED_TABLES]])) or [])
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    results_doc.build(tmp_path / "runs", tmp_path / "docs" / "results.md")
    assert seen == [(["granularity"], [["granularity"], ["granularity"]])]


def test_one_seed_and_a_long_table_are_written_as_such(tmp_path, monkeypatch):
    """A run of one seed says so; a table past the inline limit is linked with its row
    count, not inlined."""
    from moejax.train.hparams import TrainConfig

    rows = results_doc.MAX_INLINE_ROWS + 1

    def long_table(cfg, run):
        run.table("sweep", [{"i": i, "loss": 1.0 / (i + 1)} for i in range(rows)])
        return {"headline": "swept"}

    run_experiment("blockffn_granularity", lambda preset: TrainConfig(seed=0), long_table,
                   ["preset=quick"], out=tmp_path / "runs" / "blockffn_granularity",
                   seed_keys=("seed",))
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc = results_doc.build(tmp_path / "runs", tmp_path / "docs" / "results.md").read_text()
    assert "- seeds: 1\n" in doc
    assert f"{rows} rows: [sweep.csv](results/blockffn_granularity/sweep.csv)" in doc
    assert f"| {rows - 1} |" not in doc
