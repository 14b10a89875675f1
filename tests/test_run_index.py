"""The run index: finished runs are recorded wherever they live, smoke runs are not, and the
results document of a machine class reads the newest run of each study from it."""

import json
import time

from experiments import results_doc
from moejax.harness import run_index
from moejax.harness.experiment import run_experiment
from moejax.harness.run_record import write_run_record
from moejax.train.hparams import TrainConfig


def _run(path, study, command, accelerator="none"):
    """A finished run's directory: its run.json (as the runner writes it, with the given
    accelerator), summary and config."""
    path.mkdir(parents=True)
    argv = command.split()[3:]
    preset = next((a[7:] for a in argv if a.startswith("preset=")), "quick")
    write_run_record(path, study=study, argv=argv, started=time.time(), repeat=1, seeds={},
                     preset=preset, smoke="smoke=true" in argv)
    meta = json.loads((path / "run.json").read_text())
    meta["machine"]["accelerator"] = accelerator
    (path / "run.json").write_text(json.dumps(meta))
    (path / "summary.md").write_text(f"## {study}\n\n{command}\n\n_wall time: 1 s_\n")
    (path / "config.json").write_text("{}")
    return path


def test_newest_run_per_study_and_machine_class(tmp_path):
    index = tmp_path / "index.jsonl"
    old = _run(tmp_path / "a" / "old", "lm_demo", "python -m experiments.lm_demo")
    new = _run(tmp_path / "elsewhere" / "new", "lm_demo", "python -m experiments.lm_demo")
    gpu = _run(tmp_path / "g", "lm_demo", "python -m experiments.lm_demo preset=full",
               accelerator="1 x NVIDIA H200")
    smoke = _run(tmp_path / "s", "lm_demo", "python -m experiments.lm_demo smoke=true")
    gone = _run(tmp_path / "gone", "moee", "python -m experiments.extraction.moee")
    for p in (old, new, gpu, gone):
        assert run_index.record(p, index)["path"] == str(p.resolve())
    assert run_index.record(smoke, index) is None          # a smoke run is no result
    (gone / "run.json").unlink()                           # its directory was removed
    with open(index, "a") as f:
        f.write("{not json\n")
    cpu, skipped = run_index.newest("cpu", index)
    assert cpu == {"lm_demo": new.resolve()} and skipped == 1
    assert run_index.newest("gpu", index)[0] == {"lm_demo": gpu.resolve()}
    assert run_index.newest("gpu", index, preset="quick")[0] == {}
    line = json.loads(index.read_text().splitlines()[2])
    assert (line["preset"], line["machine"]) == ("full", "gpu")


def test_runs_moved_with_their_index_are_found_beside_it(tmp_path):
    """A GPU machine's runs and their index, copied back to another path (the recorded paths
    gone), are read from beside the index; a directory of that name holding another study's
    run is not taken for it."""
    import shutil

    there = tmp_path / "device" / "runs" / "gpu"
    run_index.record(_run(there / "bench_train_step", "bench_dispatch",
                          "python -m experiments.benchmarks.dispatch preset=full "
                          "variant=train_step", accelerator="1 x NVIDIA H200"),
                     there / "index.jsonl")  # beside the runs, as outside the tests
    run_index.record(_run(there / "bench_other", "moee", "python -m experiments.extraction.moee",
                          accelerator="1 x NVIDIA H200"), there / "index.jsonl")
    here = tmp_path / "here" / "runs" / "gpu"
    shutil.copytree(there, here)
    shutil.rmtree(tmp_path / "device")
    shutil.rmtree(here / "bench_other")
    _run(here / "bench_other", "lm_demo", "python -m experiments.lm_demo",
         accelerator="1 x NVIDIA H200")  # another study's run under the moved one's name
    paths, skipped = run_index.newest("gpu", [here / "index.jsonl"])
    assert paths == {"bench_dispatch": here / "bench_train_step"} and skipped == 0


def test_results_doc_reads_the_index_of_its_machine_class(tmp_path, monkeypatch):
    index = tmp_path / "index.jsonl"
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    run_index.record(_run(tmp_path / "x" / "lm", "lm_demo", "python -m experiments.lm_demo"),
                     index)
    graphs = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
    monkeypatch.setenv("XLA_FLAGS", graphs)  # what the run ran under is on its machine line
    run_index.record(_run(tmp_path / "y" / "g", "moee", "python -m experiments.extraction.moee",
                          accelerator="1 x NVIDIA H200"), index)
    monkeypatch.setattr(results_doc, "REGISTRY", ("lm_demo", "moee"))
    out = tmp_path / "docs" / "results.md"
    assert results_doc.main([f"index={index}", f"out={out}"]) == 0
    doc = out.read_text()
    assert "## lm_demo" in doc and "## moee" not in doc and "Not run: moee, moee[minilm]." in doc
    assert f"results_doc machine=cpu index={index} out={out}" in doc
    gpu_out = tmp_path / "docs" / "results_gpu.md"
    assert results_doc.main(["machine=gpu", f"index={index}", f"out={gpu_out}"]) == 0
    assert "## moee" in gpu_out.read_text()
    assert f"accelerator: 1 x NVIDIA H200; XLA_FLAGS `{graphs}`" in gpu_out.read_text()
    assert "XLA_FLAGS" not in doc
    assert "Not run: lm_demo, moee[minilm]." in gpu_out.read_text()
    assert results_doc.main(["machine=quantum", f"index={index}", f"out={out}"]) == 2


def test_the_runner_indexes_what_it_finishes(tmp_path, monkeypatch):
    index = tmp_path / "index.jsonl"
    monkeypatch.setenv(run_index.ENV, str(index))
    run_experiment("lm_demo", lambda preset: TrainConfig(seed=0),
                   lambda cfg, run: {"headline": "x"}, [], out=tmp_path / "runs" / "lm")
    (line,) = [json.loads(x) for x in index.read_text().splitlines()]
    assert line["study"] == "lm_demo" and line["machine"] == "cpu"


def test_index_lines_survive_a_cut_line_and_argv_that_quotes_smoke(tmp_path, monkeypatch):
    """A line cut off without its newline does not swallow the next run's line; a value that
    merely contains ' smoke=true' (a prompt) does not keep a real run out of the index; the
    recorded command is shell-quoted and splits back into the run's argv."""
    import shlex

    index = tmp_path / "index.jsonl"
    monkeypatch.setenv(run_index.ENV, str(index))
    index.write_text('{"study": "lm_demo", "path": "/x", "t": 1')  # cut: no newline
    argv = ["decay_paths=say smoke=true now"]
    make = lambda preset: TrainConfig(seed=0)  # noqa: E731
    _, run = run_experiment("lm_demo", make, lambda cfg, run: {"headline": "x"},
                            argv, out=tmp_path / "lm")
    lines = index.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["path"] == str(run.path.resolve())
    # (an overridden key: a trial, indexed apart from the preset runs)
    assert run_index.newest("cpu", index, kind="trial") == ({"lm_demo": run.path.resolve()}, 1)
    command = json.loads((run.path / "run.json").read_text())["command"]
    assert shlex.split(command)[3:] == argv


def test_trials_are_indexed_apart_and_never_replace_a_published_section(tmp_path, monkeypatch):
    """A run is a preset run only at its preset's config and default repeat (a variant's
    overrides included); an overridden key or another repeat makes a trial, which the results
    document lists by command and never publishes over the preset run's section."""
    monkeypatch.delenv(run_index.ENV, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    make = lambda preset: TrainConfig(seed=0, steps=300)  # noqa: E731

    def body(cfg, run):
        run.table("t", [{"steps": cfg.steps}])
        return {"headline": f"{cfg.steps} steps"}

    runs = tmp_path / "runs"
    kinds = {}
    for out, argv, kw in (("pub", [], {}), ("trial", ["steps=30"], {}),
                          ("fewer", [], {"seed_keys": ("seed",), "quick_repeat": 2}),
                          ("fewer2", ["repeat=1"], {"seed_keys": ("seed",), "quick_repeat": 2}),
                          ("var", ["variant=long"], {"variants": {"long": ("steps=900",)}})):
        _, run = run_experiment("lm_demo", make, body, argv, out=runs / out, **kw)
        kinds[out] = json.loads((run.path / "run.json").read_text())["kind"]
    assert kinds == {"pub": "preset", "trial": "trial", "fewer": "preset", "fewer2": "trial",
                     "var": "preset"}
    # the index lives beside the runs (not in the working directory), one line per run
    lines = [json.loads(x) for x in (runs / "index.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["preset", "trial", "preset", "trial", "preset"]
    assert not (tmp_path / "cwd" / "runs").exists()
    assert run_index.index_paths(runs) == [runs / "index.jsonl"]
    # a preset run published, then a newer trial: the section stays the preset run's
    (runs / "fewer").rename(tmp_path / "moved_fewer")  # (keep one preset run of lm_demo)
    monkeypatch.setattr(results_doc, "REGISTRY", ("lm_demo",))
    out = tmp_path / "docs" / "results.md"
    assert results_doc.main([f"index={runs / 'index.jsonl'}", f"out={out}"]) == 0
    doc = out.read_text()
    section = doc[doc.index("## lm_demo"):]
    assert "900 steps" not in section or "300 steps" in section  # (the variant is its own)
    assert "Headline: 300 steps" in section and "Headline: 30 steps" not in doc
    assert "Trial runs, not published here" in doc
    assert "python -m experiments.lm_demo repeat=1" in doc


def test_a_run_directory_reused_by_a_later_run_is_read_as_that_run(tmp_path, monkeypatch):
    """A preset run, then a trial written over it (overwrite=true, same out=): the preset
    run's index line now names a directory that holds the trial, so it is no preset run any
    more and nothing is published for the study; a preset run over a trial is published."""
    monkeypatch.delenv(run_index.ENV, raising=False)
    make = lambda preset: TrainConfig(seed=0, steps=300)  # noqa: E731

    def body(cfg, run):
        run.table("t", [{"steps": cfg.steps}])
        return {"headline": f"{cfg.steps} steps"}

    runs = tmp_path / "runs"
    index = runs / "index.jsonl"
    run_experiment("lm_demo", make, body, [], out=runs / "lm")
    assert run_index.newest("cpu", index)[0] == {"lm_demo": (runs / "lm").resolve()}
    run_experiment("lm_demo", make, body, ["steps=30", "overwrite=true"], out=runs / "lm")
    assert run_index.newest("cpu", index)[0] == {}
    assert run_index.newest("cpu", index, kind="trial")[0] == {"lm_demo": (runs / "lm").resolve()}
    monkeypatch.setattr(results_doc, "REGISTRY", ("lm_demo",))
    out = tmp_path / "docs" / "results.md"
    assert results_doc.main([f"index={index}", f"out={out}"]) == 0
    assert "Headline: 30 steps" not in out.read_text()
    assert "Not run: lm_demo." in out.read_text()
    run_experiment("lm_demo", make, body, ["overwrite=true"], out=runs / "lm")
    assert run_index.newest("cpu", index)[0] == {"lm_demo": (runs / "lm").resolve()}
    assert run_index.newest("cpu", index, kind="trial")[0] == {}
    assert results_doc.main([f"index={index}", f"out={out}"]) == 0
    assert "Headline: 300 steps" in out.read_text()


def test_a_line_names_its_run_only_while_the_directory_holds_that_run(tmp_path):
    """An index line publishes its directory only while the run.json there is the run it
    recorded: another variant, another machine class or another start time (a run written
    over it and recorded elsewhere) is not that run; a record from before states were kept
    counts as finished."""
    index = tmp_path / "index.jsonl"
    run = _run(tmp_path / "r", "lm_demo", "python -m experiments.lm_demo")
    run_index.record(run, index)
    meta = json.loads((run / "run.json").read_text())
    assert run_index.newest("cpu", index)[0] == {"lm_demo": run.resolve()}
    for key, value in (("variant", "wide"), ("started", "2001-01-01T00:00:00+0000"),
                       ("machine", {**meta["machine"], "accelerator": "1 x NVIDIA H200"})):
        (run / "run.json").write_text(json.dumps({**meta, key: value}))
        assert run_index.newest("cpu", index)[0] == {}, key
    (run / "run.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "state"}))
    assert run_index.newest("cpu", index)[0] == {"lm_demo": run.resolve()}


def test_machine_classes_and_the_kind_of_a_run_indexed_before_kinds_were_kept(tmp_path):
    """cpu / gpu / tpu from the recorded accelerator; a line and record without a kind read
    the recorded command: the runner's own keys keep a preset run, any other key makes a
    trial (a record that keeps its kind is taken at its word)."""
    assert [run_index.machine_class({"accelerator": a}) for a in
            ("none", "", "1 x NVIDIA H200", "8 x TPU v5 lite")] == ["cpu", "cpu", "gpu", "tpu"]
    index = tmp_path / "index.jsonl"
    commands = {"plain": "python -m experiments.lm_demo preset=quick out=runs/x overwrite=true",
                "tuned": "python -m experiments.lm_demo steps=3",
                "kept": "python -m experiments.lm_demo steps=3"}
    for name, command in commands.items():
        run = _run(tmp_path / name, name, command)
        meta = json.loads((run / "run.json").read_text())
        if name != "kept":
            del meta["kind"]
        (run / "run.json").write_text(json.dumps(meta))
        line = run_index.record(run, index)
        assert line["kind"] == {"plain": "preset", "tuned": "trial", "kept": "preset"}[name]
    lines = [json.loads(x) for x in index.read_text().splitlines()]
    index.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "kind"}) + "\n"
                             for x in lines))
    assert set(run_index.newest("cpu", index)[0]) == {"plain", "kept"}
    assert set(run_index.newest("cpu", index, kind="trial")[0]) == {"tuned"}
