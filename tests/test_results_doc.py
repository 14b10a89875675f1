"""The results document: a run directory written by the runner (run.json, tables, claims) is
read back into docs, a carried section judged again by today's rules, and a seed-paired claim
judged from its seed runs (the claim helpers themselves: test_claims_statistics.py)."""

import json
import shutil

import pytest

from experiments import main as suite
from experiments import results_doc
from experiments.blockffn import granularity as blockffn_granularity
from moejax.config import ConfigError
from moejax.harness import run_index
from moejax.harness.claims import SEED_TABLES, Claim
from moejax.harness.experiment import run_experiment
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.train.hparams import TrainConfig
from moejax.train.run_lock import RunLock, is_held


def test_granularity_claim_pairs_the_seed_runs():
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


def test_a_declared_variant_is_run_indexed_and_documented_apart(tmp_path, monkeypatch):
    """A study's variant (its quick preset with declared overrides) keeps its own newest run
    in the index and its own section, beside the study's own run."""
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
