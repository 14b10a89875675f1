"""A run directory holds one run: a study is refused where another study's run, or its own
finished run of another config, lives (unless overwrite=true, which clears the old results
first); claims and the results documents read only the tables and seed runs the run recorded;
an interrupted run is marked so and never shown or indexed as finished."""

import json
import os
import signal
import time

import numpy as np
import pytest

from experiments import blockffn_granularity, results_doc
from experiments import main as suite
from moejax.config import ConfigError
from moejax.harness import experiment, run_index
from moejax.harness.claims import Claim
from moejax.harness.cli import split_overwrite
from moejax.harness.experiment import _headline_keys, main, run_experiment, seed_offset
from moejax.harness.results import RunDir
from moejax.harness.run_record import (
    RunOwnerError,
    claim_run_dir,
    clear_results,
    mark_run_state,
    read_run_record,
)
from moejax.harness.study import Study
from moejax.io._common import WeightFileError
from moejax.train.checkpoint_format import CheckpointMismatchError
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.train.run_lock import RunLock
from moejax.train.run_state import ResumeError
from tests.toy_models import TinyMoELM, ToySource

MAKE = lambda preset: TrainConfig(seed=0)  # noqa: E731  any config with an int seed


def _granularity(cfg, run):
    run.table("granularity", [{"n_experts": 4, "val_ppl": 9.0 + cfg.seed},
                              {"n_experts": 8, "val_ppl": 8.0 + 0.5 * cfg.seed}])
    return {"headline": f"seed {cfg.seed}"}


def _two_tables(cfg, run):
    run.table("main", [{"x": 1}])
    if cfg.steps > 5:  # a config with the optional table
        run.table("extra", [{"y": 2}])
    return {"headline": "ok"}


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()
            and p.name != ".lock"}


@pytest.fixture(autouse=True)
def _own_index(tmp_path, monkeypatch):
    monkeypatch.setenv(run_index.ENV, str(tmp_path / "index.jsonl"))


def test_another_studys_run_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "bench"
    run_experiment("bench_dispatch", MAKE, _two_tables, [], out=out)
    before = _snapshot(out)
    called = []
    code = main("lm_demo", MAKE, lambda cfg, run: called.append(1) or {}, [f"out={out}"])
    assert code == 2 and not called and _snapshot(out) == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a finished run of bench_dispatch" in err[0]
    assert "overwrite=true" in err[0]
    link = tmp_path / "link"  # through a symlink too
    link.symlink_to(out)
    with pytest.raises(RunOwnerError, match="bench_dispatch"):
        run_experiment("lm_demo", MAKE, _two_tables, [], out=link)
    assert _snapshot(out) == before


def test_a_finished_run_of_another_config_needs_overwrite_which_clears_it(tmp_path):
    out = tmp_path / "run"
    seen = []

    def claims(tables):
        seen.append(sorted(tables))
        return []

    run_experiment("darex_controlled", MAKE, _two_tables, ["steps=10"], out=out, claims=claims)
    (out / "seed_3").mkdir()
    (out / "seed_3" / "summary.md").write_text("stale")
    (out / "plot.png").write_bytes(b"png")
    with pytest.raises(RunOwnerError, match="another config"):
        run_experiment("darex_controlled", MAKE, _two_tables, ["steps=2"], out=out,
                       claims=claims)
    assert json.loads((out / "config.json").read_text())["steps"] == 10
    run_experiment("darex_controlled", MAKE, _two_tables, ["steps=2", "overwrite=true"],
                   out=out, claims=claims)
    assert seen == [["extra", "main"], ["main"]]  # the old run's `extra` never judged
    assert not (out / "extra.csv").exists() and not (out / "seed_3").exists()
    assert not (out / "plot.png").exists()
    assert read_run_record(out)["tables"] == ["main"]
    # the same config again is a rerun, taken without overwrite
    run_experiment("darex_controlled", MAKE, _two_tables, ["steps=2"], out=out, claims=claims)


def test_claims_ignore_tables_the_run_did_not_write(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "extra.csv").write_text("y\n2\n")  # left by something else
    seen = []
    run_experiment("darex_controlled", MAKE, _two_tables, ["steps=2"], out=out,
                   claims=lambda t: seen.append(sorted(t)) or [])
    assert seen == [["main"]]


def test_a_smaller_repeat_is_judged_on_its_own_seeds(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    out = runs / "blockffn_granularity"
    kw = dict(out=out, seed_keys=("seed",), claims=blockffn_granularity.claims)
    run_experiment("blockffn_granularity", MAKE, _granularity, ["repeat=3"], **kw)
    run_experiment("blockffn_granularity", MAKE, _granularity, ["repeat=2"], **kw)
    assert (out / "seed_2").is_dir()  # the first run's third seed is still there
    record = read_run_record(out)
    assert sorted(record["seed_runs"]) == ["seed_0", "seed_1"]
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc = results_doc.build(runs, tmp_path / "docs" / "results.md").read_text()
    assert "wins 2/2 seeds" in doc and "3/3" not in doc


def test_a_smoke_runs_summary_says_so_and_judges_no_claim(tmp_path):
    """A smoke run trains a couple of steps: its claim rules still run on its tables, but no
    verdict of it reads as the paper's (holds or does not hold), and its summary opens by
    saying what it was; the same study run for real judges them."""
    def claims(tables):
        return [Claim("A beats B", True, "1 vs 0"), Claim("C beats D", False, "0 vs 1")]

    for argv, verdicts in ((["smoke=true"], {"inconclusive"}),
                           ([], {"holds", "does not hold"})):
        out = tmp_path / ("smoke" if argv else "real")
        run_experiment("darex_controlled", MAKE, _two_tables, argv, out=out, claims=claims)
        rows = (out / "claims.csv").read_text()
        assert {v for v in ("holds", "does not hold", "inconclusive") if f",{v}," in rows} \
            == verdicts
        summary = (out / "summary.md").read_text()
        assert ("**Smoke run**" in summary) == bool(argv)
        assert ("tests the pipeline, not the claim" in rows) == bool(argv)
        assert "1 vs 0" in rows  # the rule's own evidence is kept


def test_an_interrupted_run_is_marked_and_never_shown_as_finished(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    out = runs / "blockffn_granularity"
    run_experiment("blockffn_granularity", MAKE, _granularity, [], out=out)
    assert run_index.newest("cpu")[0] == {"blockffn_granularity": out.resolve()}

    def dies(cfg, run):
        run.table("granularity", [{"n_experts": 4, "val_ppl": 1.0}])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment("blockffn_granularity", MAKE, dies, [], out=out)
    assert read_run_record(out)["state"] == "interrupted"
    assert run_index.newest("cpu")[0] == {}  # the index's line points at a run no more
    monkeypatch.setattr(results_doc, "REGISTRY", ("blockffn_granularity",))
    doc = results_doc.build(runs, tmp_path / "docs" / "results.md").read_text()
    assert "Not run: blockffn_granularity." in doc and "## blockffn_granularity" not in doc
    assert "resumed" not in read_run_record(out)  # its first run resumed nothing
    assert "Resumed:" not in (out / "summary.md").read_text()
    # the same study and config resumes in place and finishes, and says it resumed: its wall
    # time leaves the stopped run's out
    run_experiment("blockffn_granularity", MAKE, _granularity, [], out=out)
    record = read_run_record(out)
    assert record["state"] == "finished" and record["resumed"] is True
    assert experiment.RESUMED_NOTE in (out / "summary.md").read_text()
    doc = results_doc.build(runs, tmp_path / "docs" / "results.md").read_text()
    assert "s (resumed a stopped run: its time is left out)\n" in doc
    # run again once finished: a rerun, which resumes nothing
    run_experiment("blockffn_granularity", MAKE, _granularity, [], out=out)
    assert "resumed" not in read_run_record(out)
    assert "Resumed:" not in (out / "summary.md").read_text()
    # a stopped run taken up under another config (what its training allows to change) is
    # resumed too
    with pytest.raises(KeyboardInterrupt):
        run_experiment("blockffn_granularity", MAKE, dies, [], out=out)
    run_experiment("blockffn_granularity", MAKE, _granularity, ["lr=0.5"], out=out)
    assert read_run_record(out)["resumed"] is True


@pytest.mark.slow
def test_a_stopped_repeat_keeps_its_finished_seed_runs_when_it_resumes(tmp_path):
    """Resumed, a repeat stopped in its second seed run makes only that one again (before,
    every seed run was made again); its merged tables, claims and headline are those of a run
    never stopped. A finished run's rerun, or a seed run whose files are gone, makes them
    all."""
    kw = dict(seed_keys=("seed",), claims=blockffn_granularity.claims)
    made = []

    def whole_study(cfg, run):  # numpy's scalars kept as the numbers they hold
        return {**_granularity(cfg, run), "best": np.int64(8), "ppl": np.float32(8 + cfg.seed)}

    stop = {1}  # the seeds whose next run is stopped

    def study(cfg, run):
        made.append(cfg.seed)
        if cfg.seed in stop:
            stop.discard(cfg.seed)
            raise KeyboardInterrupt
        return whole_study(cfg, run)

    out, whole = tmp_path / "stopped", tmp_path / "whole"
    with pytest.raises(KeyboardInterrupt):
        run_experiment("blockffn_granularity", MAKE, study, ["repeat=3"], out=out, **kw)
    summary, _ = run_experiment("blockffn_granularity", MAKE, study, ["repeat=3"], out=out, **kw)
    assert made == [0, 1, 1, 2]
    assert summary["ppl"] == 9.0 and summary["best"] == [8, 8, 8]
    run_experiment("blockffn_granularity", MAKE, whole_study, ["repeat=3"], out=whole, **kw)
    for f in ("granularity.csv", "claims.csv"):
        assert (out / f).read_text() == (whole / f).read_text()
    text = (out / "summary.md").read_text()
    assert "Seed run(s) 0 finished before the run was stopped and were kept" in text
    assert experiment.RESUMED_REPEAT_NOTE in text
    assert read_run_record(out)["resumed"] is True
    assert results_doc._resumed(read_run_record(out)) == (
        " (resumed a stopped run: its time on the seed runs it had not finished is left out)")
    assert "Resumed:" not in (whole / "summary.md").read_text()
    assert text.split("_wall time")[0] == (whole / "summary.md").read_text().split(
        "_wall time")[0]
    made.clear()  # finished: the same command makes every seed run again
    run_experiment("blockffn_granularity", MAKE, study, ["repeat=3"], out=out, **kw)
    assert made == [0, 1, 2]
    stop.add(1)
    with pytest.raises(KeyboardInterrupt):  # a kept seed run needs every file it wrote
        run_experiment("blockffn_granularity", MAKE, study, ["repeat=3", "lr=0.5"],
                       out=tmp_path / "gone", **kw)
    (tmp_path / "gone" / "seed_0" / "granularity.csv").unlink()
    made.clear()
    run_experiment("blockffn_granularity", MAKE, study, ["repeat=3", "lr=0.5"],
                   out=tmp_path / "gone", **kw)
    assert made == [0, 1, 2]


def test_an_unreadable_record_is_refused_and_overwrite_is_checked(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{cut")
    with pytest.raises(RunOwnerError, match="unreadable"):
        run_experiment("lm_demo", MAKE, _two_tables, [], out=out)
    with pytest.raises(ConfigError, match="overwrite"):
        run_experiment("lm_demo", MAKE, _two_tables, ["overwrite=yes"], out=out)
    run_experiment("lm_demo", MAKE, _two_tables, ["overwrite=true"], out=out)
    assert read_run_record(out)["study"] == "lm_demo"


def test_user_errors_and_ctrl_c_end_in_one_line_with_their_exit_codes(tmp_path, capsys):
    for i, (exc, code) in enumerate([(ResumeError("lr: checkpoint 0.1 vs now 0.2"), 2),
                                     (CheckpointMismatchError("shapes differ"), 2),
                                     (WeightFileError("w.gguf", "bad header"), 2),
                                     (KeyboardInterrupt("interrupted by Ctrl-C"), 130)]):
        def boom(cfg, run, exc=exc):
            raise exc

        assert main("lm_demo", MAKE, boom, [f"out={tmp_path / str(i)}"]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(exc).strip("'") in err[0], err

    def ctrl_c(cfg, run):  # outside a training loop: a bare KeyboardInterrupt, no text
        raise KeyboardInterrupt

    assert main("lm_demo", MAKE, ctrl_c, [f"out={tmp_path / 'c'}"]) == 130
    assert capsys.readouterr().err.strip() == ("[lm_demo] stopped: interrupted by Ctrl-C; the "
                                               "same command continues the run (its trainings "
                                               "from their checkpoints)")

    def sigterm(cfg, run):  # a preemption between trainings: was death, the run left running
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    def ignore(signum, frame):  # the study's own handler replaces it while the run lasts
        pass

    before = signal.signal(signal.SIGTERM, ignore)
    try:
        assert main("lm_demo", MAKE, sigterm, [f"out={tmp_path / 't'}"]) == 130
        assert signal.getsignal(signal.SIGTERM) is ignore  # put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.strip().startswith("[lm_demo] stopped: interrupted by "
                                                      "SIGTERM; the same command continues")
    assert read_run_record(tmp_path / "t")["state"] == "interrupted"


def test_ctrl_c_without_a_checkpoint_promises_no_resume(tmp_path):
    """ckpt_every=0: the message says no checkpoint exists, not 'step None resumes'."""
    import os
    import signal

    from flax import nnx

    class Interrupting(ToySource):
        def batch(self, position):
            if position == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return super().batch(position)

    cfg = TrainConfig(steps=20, batch_size=4, lr=1e-2, ckpt_every=0, log_every=1)
    with pytest.raises(KeyboardInterrupt) as info:
        train(TinyMoELM(nnx.Rngs(0)), Interrupting(batch_size=4), cfg,
              run_dir=str(tmp_path / "r"), progress=False)
    msg = str(info.value)
    assert "no checkpoint was written" in msg and "None" not in msg


def test_a_suite_skips_a_study_another_suite_holds_or_finished(tmp_path, monkeypatch, capsys):
    """Two suites at once: a study locked by the other suite is reported skipped (locked by
    its process), not failed; one the other finished since this suite began is not run
    twice."""
    import os

    ran = []

    def study(name):
        def run(cfg, run):
            ran.append(name)
            return {"headline": name}
        return Study(name, MAKE, run)

    monkeypatch.setattr(suite, "load_study", study)
    monkeypatch.setattr(suite, "_parse", lambda argv: (
        "quick", tmp_path / "report", [("lm_demo", ()), ("moee", ())], "demo"))
    monkeypatch.setattr(suite, "_jobs_with_variants",
                        lambda jobs, preset, s: [(n, o, "") for n, o in jobs])
    out = tmp_path / "report"
    with RunLock(out / "lm_demo"):  # the other suite is running lm_demo now
        assert suite.main([]) == 0
    report = (out / "REPORT.md").read_text()
    assert ran == ["moee"] and "FAILED" not in report
    assert "## lm_demo\n\nSkipped: locked" in report and f"pid {os.getpid()}" in report
    assert "(skipped: lm_demo)" in report
    ran.clear()
    real_time = suite.time.time
    monkeypatch.setattr(suite.time, "time", lambda: real_time() - 60)  # started a minute ago
    assert suite.main([]) == 0  # moee finished (by "the other suite") after this one began
    assert "moee" not in ran and "finished by another process" in (out / "REPORT.md").read_text()
    capsys.readouterr()


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_a_stopped_suite_says_where_in_one_line_and_reports_what_ran(tmp_path, monkeypatch,
                                                                     capsys, how):
    """Ctrl-C (here as a training loop raises it) or SIGTERM during the suite's second study:
    exit 130 and one line naming the study; REPORT.md holds the study run before it and says
    where the suite stopped; the stopped study's run is marked interrupted, so the same
    command resumes it; the study after it does not run."""
    ran = []

    def study(name):
        def run(cfg, run):
            ran.append(name)
            if name == "moee" and how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            if name == "moee":
                raise KeyboardInterrupt("interrupted by Ctrl-C after step 3; the newest "
                                        "complete checkpoint (step 2) resumes the run exactly")
            return {"headline": name}
        return Study(name, MAKE, run)

    out = tmp_path / "report"
    monkeypatch.setattr(suite, "load_study", study)
    monkeypatch.setattr(suite, "_parse", lambda argv: (
        "quick", out, [("lm_demo", ()), ("moee", ()), ("moe_kd", ())], "demo"))
    monkeypatch.setattr(suite, "_jobs_with_variants",
                        lambda jobs, preset, s: [(n, o, "") for n, o in jobs])
    before = signal.getsignal(signal.SIGTERM)
    assert suite.main([]) == 130
    assert signal.getsignal(signal.SIGTERM) is before  # put back
    assert ran == ["lm_demo", "moee"]
    why = ("interrupted by SIGTERM; the same command continues the run (its trainings from "
           "their checkpoints)" if how == "SIGTERM" else
           "interrupted by Ctrl-C after step 3; the newest complete checkpoint (step 2) "
           "resumes the run exactly")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[demo] stopped during moee: {why}; {out / 'REPORT.md'} holds the 1 "
                   "study run before it"]
    report = (out / "REPORT.md").read_text()
    assert f"- **stopped during moee: {why}**; the studies after it did not run" in report
    assert "## lm_demo" in report and "## moee" not in report and "moe_kd/" not in report
    assert read_run_record(out / "moee")["state"] == "interrupted"


def test_a_suite_stopped_between_studies_names_none(tmp_path, monkeypatch, capsys):
    """A stop after one study has finished and before the next begins (a suite's variants
    are listed then) names no study: the finished one is in the report, not blamed."""
    def jobs(jobs, preset, s):
        yield "lm_demo", (), ""
        raise KeyboardInterrupt

    out = tmp_path / "report"
    monkeypatch.setattr(suite, "load_study", lambda name: Study(name, MAKE, lambda c, r: {}))
    monkeypatch.setattr(suite, "_parse", lambda argv: ("quick", out, [("lm_demo", ())], "demo"))
    monkeypatch.setattr(suite, "_jobs_with_variants", jobs)
    assert suite.main([]) == 130
    why = ("stopped between studies: interrupted by Ctrl-C; the same command continues the run "
           "(its trainings from their checkpoints)")
    assert capsys.readouterr().err.strip() == (f"[demo] {why}; {out / 'REPORT.md'} holds the 1 "
                                               "study run before it")
    report = (out / "REPORT.md").read_text()
    assert f"- **{why}**" in report and "## lm_demo" in report
    assert read_run_record(out / "lm_demo")["state"] == "finished"


def test_an_unwritable_out_is_refused_in_one_line_by_a_real_write(capsys):
    """/sys/kernel passes os.access for root; a real write finds it unwritable."""
    import os

    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys/kernel here")
    assert main("lm_demo", MAKE, _two_tables, ["out=/sys/kernel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/sys/kernel is not writable" in err[0]


def test_claiming_a_directory_resumes_its_own_unfinished_run_and_clears_only_results(tmp_path):
    """The study's interrupted run of another config is a resume (the training loop judges
    its checkpoints); its finished run of another config needs overwrite, or resume=force;
    overwrite deletes the results (``seed_<i>/``, never another folder of that prefix nor a
    linked one; a benchmark's kept measurements and traced programs, not a file set aside)
    and keeps the rest; an
    unreadable record is not rewritten by a state mark."""
    out = tmp_path / "run"
    take = lambda h, **kw: claim_run_dir(out, study="lm_demo", variant="", cfg_hash=h,  # noqa
                                         argv=[], **kw)
    take("a")
    mark_run_state(out, "interrupted")
    take("b")  # a resume under another config
    assert read_run_record(out)["config_hash"] == "b"
    mark_run_state(out, "finished")
    with pytest.raises(RunOwnerError, match="another config"):
        take("c")
    take("c", resume_force=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.csv").write_text("x\n1\n")
    for name in ("seed_0", "seed_x", "seed_", "checkpoints", "programs"):
        (out / name).mkdir()
    (out / "programs" / "grown_ar_dense_0.hlo").write_text("HloModule old")
    (out / "seed_1").symlink_to(elsewhere)
    (out / "notes.txt").write_text("mine")
    for name in ("measured_grown.json", "measured.json.foreign"):  # a bench's kept timings
        (out / name).write_text("{}")
    removed = clear_results(out)
    assert removed == ["measured_grown.json", "programs", "run.json", "seed_0"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "measured.json.foreign",
                                                     "notes.txt", "seed_", "seed_1", "seed_x"]
    assert (elsewhere / "kept.csv").read_text() == "x\n1\n"
    (out / "run.json").write_text("{cut")
    mark_run_state(out, "interrupted")
    assert (out / "run.json").read_text() == "{cut"


def test_config_json_is_the_new_runs_at_once_unless_checkpoints_of_another_wait(tmp_path):
    """A changed config replaces config.json when the run starts; where checkpoints of the
    old config lie, only when the run finishes (a resume the loop refuses keeps the old)."""
    out = tmp_path / "run"
    RunDir.create(out, TrainConfig(seed=0, steps=5)).close()
    RunDir.create(out, TrainConfig(seed=0, steps=6)).close()
    assert json.loads((out / "config.json").read_text())["steps"] == 6
    (out / "checkpoints" / "10").mkdir(parents=True)
    run = RunDir.create(out, TrainConfig(seed=0, steps=7))
    assert json.loads((out / "config.json").read_text())["steps"] == 6
    run.finish()
    assert json.loads((out / "config.json").read_text())["steps"] == 7


def test_a_seed_key_must_name_an_int_field():
    cfg = TrainConfig(seed=3)
    assert seed_offset(cfg, ("seed",), 2).seed == 5
    with pytest.raises(ConfigError, match="seed key 'tensorboard' is not an int field"):
        seed_offset(cfg, ("tensorboard",), 1)  # a bool is no seed
    with pytest.raises(ConfigError, match="seed key 'lr' is not an int field"):
        seed_offset(cfg, ("lr",), 1)
    with pytest.raises(ConfigError, match="seed key 'train.seed' is not a key"):
        seed_offset(cfg, ("train.seed",), 1)


def test_a_repeats_headline_gives_the_first_four_values_every_run_measured():
    runs = [{"a": 1.0, "n": 3, "b": 2.0, "wall_s": 9.0, "c": 1.0, "d": 1.0, "e": 1.0, "f": 1.0},
            {"a": 2.0, "n": 4, "b": "n/a", "wall_s": 8.0, "c": 2.0, "d": 2.0, "e": 2.0,
             "f": 2.0}]
    assert _headline_keys(runs) == ["a", "c", "d", "e"]


def test_overwrite_is_true_or_false_and_given_once():
    assert split_overwrite(["overwrite=false", "seed=1"]) == (["seed=1"], False)
    assert split_overwrite(["seed=1", "overwrite=true"]) == (["seed=1"], True)
    assert split_overwrite(["seed=1"]) == (["seed=1"], False)
    for bad in (["overwrite=yes"], ["overwrite=true", "overwrite=true"]):
        with pytest.raises(ConfigError, match="give it once, true or false"):
            split_overwrite(bad)


def test_a_studys_quick_run_is_one_run_unless_the_suite_asks_for_its_repeats(tmp_path):
    def one(cfg, run):
        run.table("t", [{"seed": float(cfg.seed)}])
        return {}

    study = Study("repeated", lambda preset: TrainConfig(seed=0), one, seed_keys=("seed",),
                  quick_repeat=2)
    _, run = study.run_experiment(["preset=quick"], out=tmp_path / "one")
    assert not (tmp_path / "one" / "seed_0").exists()
    _, run = study.run_experiment(["preset=quick"], out=tmp_path / "two", repeat_quick=True)
    assert sorted(p.name for p in (tmp_path / "two").glob("seed_*")) == ["seed_0", "seed_1"]
