"""Fault injection at the edges: renamed step directories and edited checkpoint metadata,
refused runs that must not touch their directory, values refused before compute, damaged
delta files and substrate caches, negative token ids, unusable output directories, SIGTERM,
and the permissions of result files. Each test fails on code without the matching check."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

import moejax.files
from experiments import lm_demo
from experiments.blockffn import granularity as blockffn_granularity
from experiments.darex import controlled as darex_controlled
from experiments.kd import moe_kd
from moejax import substrates
from moejax.config import ConfigError, to_json
from moejax.config_overrides import apply_overrides
from moejax.delta import storage
from moejax.files import UnusableDirError, default_file_mode, move_aside
from moejax.harness.cli import parse_runner
from moejax.harness.experiment import main as cli_main
from moejax.harness.experiment import run_experiment
from moejax.harness.results import RunDir, RunDirError
from moejax.harness.run_record import RunOwnerError, mark_run_state
from moejax.io import WeightFileError
from moejax.io.hf_tokenizer import tokenizer_from_json
from moejax.io.safetensors_io import export_params, read_safetensors
from moejax.train.checkpoint import (
    Checkpointer,
    CheckpointWriteError,
    CorruptCheckpointError,
    latest_step,
)
from moejax.train.hparams import TrainConfig
from moejax.train.loop import ResumeError, config_differences, train
from moejax.train.run_lock import RunLock, RunLockedError, is_held
from moejax.train.run_state import CtrlC, sigterm_as_interrupt, stops_deferred
from moejax.train.step import NonFiniteError
from tests.test_faults import _SIGINT_RUN, CFG, ONE_STEP, ROOT, _params, _run, _template
from tests.test_train_loop import Crash
from tests.test_train_loop import CrashingSource as CrashAt
from tests.toy_models import TinyMoELM, ToySource, tree_equal


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    model, hist = _run(tmp_path_factory.mktemp("straight") / "run")
    return _params(model), [h["loss"] for h in hist]


def _meta_file(run, step):
    return run / "checkpoints" / str(step) / "meta" / "metadata"


# -- checkpoints: renamed steps and edited metadata ------------------------------------------
def test_swapped_step_directories_are_caught_and_resume_stays_exact(tmp_path, straight):
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(5, batch_size=4))
    ck = run / "checkpoints"
    os.rename(ck / "2", ck / "x")
    os.rename(ck / "4", ck / "2")
    os.rename(ck / "x", ck / "4")
    with pytest.raises(CorruptCheckpointError, match="step 4 .* holds the state of step 2"):
        _run(run)  # both swapped steps are refused and moved aside
    assert len(os.listdir(ck / ".corrupt")) == 2
    model, hist = _run(run)  # nothing verifies any more: trains from scratch, exactly
    assert tree_equal(_params(model), straight[0])
    assert [h["loss"] for h in hist] == straight[1]


@pytest.mark.parametrize("part", ["state", "meta"])
def test_a_step_holding_another_steps_state_or_record_is_named(tmp_path, part):
    """One part of step 4 (its arrays, or its meta record) replaced by step 2's: the step is
    refused naming both steps, before its arrays are compared with the record's checksums."""
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(5, batch_size=4))
    ck = run / "checkpoints"
    shutil.rmtree(ck / "4" / part)
    shutil.copytree(ck / "2" / part, ck / "4" / part)
    said = "holds the state of step 2 \\(meta says 4\\)" if part == "state" else \
        "holds the state of step 4 \\(meta says 2\\)"
    with pytest.raises(CorruptCheckpointError, match=said):
        Checkpointer(ck).restore(_template(), 4)


@pytest.mark.parametrize("edit", ["data_position", "config", "format"])
def test_edited_meta_record_is_caught(tmp_path, straight, edit):
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(5, batch_size=4))
    path = _meta_file(run, 4)
    meta = json.loads(path.read_text())
    meta.update({"data_position": {"data_position": 2}, "config": {"config": None},
                 "format": {"format": "moejax-checkpoint-v9"}}[edit])
    path.write_text(json.dumps(meta))
    problem = "unknown meta format" if edit == "format" else "meta record .* was changed"
    with pytest.raises(Exception, match=problem):
        Checkpointer(run / "checkpoints").restore(_template(), 4)
    if edit == "config":  # a resume with another lr is refused again (falls back to step 2)
        with pytest.raises(ResumeError, match="lr: checkpoint"):
            _run(run, CFG.replace(lr=2e-2))
        return
    model, hist = _run(run)  # falls back to step 2 and replays nothing twice
    assert tree_equal(_params(model), straight[0])


# -- refused runs write nothing ------------------------------------------------------------
def _study(cfg, run: RunDir) -> dict:
    train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, run_dir=str(run.path / "train"),
          progress=False)
    return {}


def test_refused_runs_leave_config_json_alone(tmp_path):
    out = tmp_path / "study"
    make = lambda preset: CFG  # noqa: E731
    run_experiment("s", make, _study, [], out=out)
    before = (out / "config.json").read_text()
    # a finished run of another config: refused before anything is written
    with pytest.raises(RunOwnerError, match="finished run of s with another config"):
        run_experiment("s", make, _study, ["lr=0.05"], out=out)
    assert (out / "config.json").read_text() == before
    with RunLock(out):  # another live run holds the directory
        with pytest.raises(RunLockedError):
            run_experiment("s", make, _study, ["steps=8"], out=out)
    assert (out / "config.json").read_text() == before
    run_experiment("s", make, _study, ["steps=8", "resume=force"], out=out)  # accepted
    assert json.loads((out / "config.json").read_text())["steps"] == 8
    mark_run_state(out, "interrupted")  # stopped: a resume the loop refuses, as before
    with pytest.raises(ResumeError, match="lr: checkpoint"):
        run_experiment("s", make, _study, ["steps=8", "lr=0.05"], out=out)
    assert json.loads((out / "config.json").read_text())["steps"] == 8


def test_post_training_settings_do_not_block_a_resume():
    a = lm_demo.make_config("quick")
    b = apply_overrides(a, ["prompt=class Foo", "sample_tokens=8"])
    assert config_differences(*(json.dumps(json.loads(c)) for c in (
        _json(a), _json(b)))) == []
    assert config_differences(_json(a), _json(a.replace(seq_len=64))) != []
    # the cadence keys are free inside a nested TrainConfig too; its other keys are not
    nested = apply_overrides(a, ["train.log_every=7", "train.ckpt_every=3"])
    assert config_differences(_json(a), _json(nested)) == []
    assert config_differences(_json(a), _json(apply_overrides(a, ["train.lr=0.5"]))) == [
        f"train/lr: checkpoint {a.train.lr!r} vs now 0.5"]


def test_a_second_signal_stops_at_once():
    """The first Ctrl-C or SIGTERM is kept for the end of the step; a second one raises."""
    guard = CtrlC()
    try:
        guard._handler(signal.SIGTERM, None)
        assert guard.pressed and guard.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C: stopping at once"):
            guard._handler(signal.SIGINT, None)
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGINT) is not guard._handler


def test_a_stop_while_the_loop_starts_closes_what_it_opened(tmp_path, monkeypatch):
    """Ctrl-C after the run directory is opened and before the first step (here while the
    progress bar is made) aborts the checkpointer, releases the directory's lock and puts
    the signal handlers back, as a stop during a step does."""
    import moejax.train.loop as loop_module

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    closed = []
    original = Checkpointer.close
    monkeypatch.setattr(Checkpointer, "close", lambda self, abort=False: (
        closed.append(abort), original(self, abort=abort))[1])
    monkeypatch.setattr(loop_module, "progress", stopped)
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "r")
    assert closed == [True]
    assert not is_held(tmp_path / "r")
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers


def test_a_refused_resume_closes_its_checkpointer(tmp_path, monkeypatch):
    """A resume refused while the run directory is opened closes (aborts) the checkpointer
    it opened, so no save threads outlive the refusal."""
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(3, batch_size=4))
    closed = []
    original = Checkpointer.close
    monkeypatch.setattr(Checkpointer, "close", lambda self, abort=False: (
        closed.append((self.directory, abort)), original(self, abort=abort))[1])
    with pytest.raises(ResumeError, match="lr: checkpoint"):
        _run(run, CFG.replace(lr=2e-2))
    assert (str(run / "checkpoints"), True) in [(str(d), a) for d, a in closed]


def _json(cfg):
    return to_json(cfg)


# -- values refused before compute ---------------------------------------------------------
@pytest.mark.parametrize("module,override,match", [
    (lm_demo, "sample_tokens=5000", "sample_tokens=5000"),
    (lm_demo, "sample_tokens=-5", "sample_tokens=-5"),
    (lm_demo, "prompt=", "prompt='' is empty"),
    (lm_demo, "model.moe.balance_coef=inf", "balance_coef=inf: must be a finite"),
    (darex_controlled, "ps=()", "ps=\\(\\) is empty"),
    (darex_controlled, "methods=()", "methods=\\(\\) is empty"),
    (blockffn_granularity, "n_experts=(0,)", "n_experts=\\(0,\\): must be >= 1"),
    (moe_kd, "methods=()", None),
])
def test_bad_values_are_refused_at_build_time(module, override, match):
    overrides = [override] + (["dense_teacher_methods=()"] if module is moe_kd else [])
    with pytest.raises(ConfigError, match=match or "nothing to distil"):
        apply_overrides(module.make_config("quick"), overrides)


def test_a_command_line_key_given_twice_is_refused(capsys):
    for argv in (["train.lr=1e-3", "train.lr=2e-3"], ["preset=quick", "preset=full"]):
        assert cli_main("lm_demo", lm_demo.make_config, lm_demo.run, argv) == 2
        assert "is given twice" in capsys.readouterr().err


def test_a_misspelt_runner_key_is_named_and_nothing_is_written(tmp_path, capsys):
    """``prest=full`` is no config key: the refusal names the runner key it meant, not the
    study's config keys, before the run directory exists."""
    for given, meant in (("prest=full", "preset"), ("overwrit=true", "overwrite"),
                         ("repeats=2", "repeat")):
        argv = [given, f"out={tmp_path / 'run'}"]
        assert cli_main("lm_demo", lm_demo.make_config, lm_demo.run, argv) == 2
        err = capsys.readouterr().err
        assert f"unknown key {given.split('=')[0]!r} (did you mean the runner key {meant!r}?)" \
            in err and "allowed keys" not in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"key 'sed' \(did you mean 'train.seed'\?\)"):
        parse_runner("lm_demo", lm_demo.make_config, ["sed=1"])  # a config key: its own error


def test_empty_or_unusable_out_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="out= is empty"):
        parse_runner("lm_demo", lm_demo.make_config, ["out="])
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for out in (a_file, "/dev/null"):
        with pytest.raises(RunDirError, match="is a file, not a directory.*out=DIR"):
            RunDir.create(out)
    assert cli_main("lm_demo", lm_demo.make_config, lm_demo.run, [f"out={a_file}"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_memory_and_disk_errors_end_in_one_line_with_a_fix(tmp_path, capsys):
    def oom(cfg, run):
        raise MemoryError

    def disk_full(cfg, run):
        raise CheckpointWriteError(28, "a checkpoint save failed: No space left on device")

    make = lambda preset: TrainConfig()  # noqa: E731
    assert cli_main("s", make, oom, [f"out={tmp_path / 'a'}"]) == 1
    assert "ran out of host memory. Fix: lower the batch size" in capsys.readouterr().err
    assert cli_main("s", make, disk_full, [f"out={tmp_path / 'b'}"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err

    def diverged(cfg, run):
        raise NonFiniteError("step 3 (data position 3): non-finite loss nan; the update was "
                             "NOT applied and nothing was saved")

    assert cli_main("s", make, diverged, [f"out={tmp_path / 'c'}"]) == 1
    err = capsys.readouterr().err
    assert "update was NOT applied and nothing was saved" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    def cache_full(cfg, run):  # an atomic write of the substrate cache on a full disk
        raise OSError(28, "No space left on device", "/cache/subs/x/model.safetensors")

    assert cli_main("s", make, cache_full, [f"out={tmp_path / 'd'}"]) == 1
    err = capsys.readouterr().err
    assert "disk full writing /cache/subs/x/model.safetensors" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # a path component the filesystem refuses: one line naming out=, exit 2
    assert cli_main("s", make, oom, [f"out={tmp_path / ('x' * 300)}"]) == 2
    err = capsys.readouterr().err
    assert "out=" in err and "File name too long" in err and "Traceback" not in err


# -- delta files ---------------------------------------------------------------------------
def _delta_file(tmp_path, edit=None, arrays=None):
    import jax.numpy as jnp

    stored = storage.encode({"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)})
    meta = json.loads(json.dumps(stored.meta))
    arrays = dict(stored.arrays, **(arrays or {}))
    if edit:
        edit(meta)
    path = tmp_path / "d.npz"
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return str(path)


@pytest.mark.parametrize("case,match", [
    ("float64", "stored as float64 but the metadata declares float32"),
    ("huge", "decode to .* GiB, more than the bound"),
    ("leaves_not_records", "leaf 0: malformed metadata 5"),
    ("object_dtype", "dtype 'object' is not a numeric dtype"),
    ("negative", "negative dimension"),
])
def test_damaged_delta_files_are_refused_naming_the_file(tmp_path, case, match):
    edits = {
        "huge": lambda m: m["leaves"][0].update(shape=[1 << 20, 1 << 14]),
        "leaves_not_records": lambda m: m.update(leaves=[5]),
        "object_dtype": lambda m: m["leaves"][0].update(dtype="object"),
        "negative": lambda m: m["leaves"][0].update(shape=[-2, -3]),
    }
    arrays = ({"leaf0.values": np.arange(6.0).reshape(2, 3)} if case == "float64" else None)
    path = _delta_file(tmp_path, edits.get(case), arrays)
    with pytest.raises(ValueError, match=match) as e:
        storage.load(path, max_bytes=1 << 30)
    assert "d.npz" in str(e.value)


# -- substrate cache -----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "metrics"])
def test_damaged_substrate_cache_is_rebuilt(tiny_recipes, damage, caplog):
    sub = substrates.get("vit_mnist5k", "quick", cache_dir=tiny_recipes)
    d = sub.path
    weights = d / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0x01
        weights.write_bytes(bytes(raw))
    elif damage == "truncate":
        weights.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        (d / "metrics.json").write_text("{not json")
    again = substrates.get("vit_mnist5k", "quick", cache_dir=tiny_recipes)
    assert "damaged" in caplog.text and str(d) in caplog.text
    assert list(d.parent.glob(f"{d.name}.corrupt-*"))  # the damaged entry was kept aside
    assert (again.path / "integrity.json").is_file()
    x = np.zeros((2, 28, 28, 1), np.float32)
    np.testing.assert_allclose(again.model(x)[0], sub.model(x)[0], rtol=1e-5, atol=1e-6)


def test_unusable_substrate_dir_says_how_to_fix_it(tmp_path, monkeypatch):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    monkeypatch.setenv("MOEJAX_SUBSTRATE_DIR", str(a_file))
    with pytest.raises(OSError, match="MOEJAX_SUBSTRATE_DIR"):
        substrates.build("mlp_mnist5k")


def test_wrong_typed_safetensors_header_fields_name_the_file(tmp_path):
    header = {"w": {"dtype": ["F32"], "shape": ["2"], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8)
    with pytest.raises(WeightFileError, match="bad.safetensors.*dtype must be a string"):
        read_safetensors(path)


def test_a_weight_path_that_is_a_directory_or_under_a_file_is_named(tmp_path):
    """Reading a folder as a weight file says it is a folder (not "does not exist"); writing
    one over a folder, or under a file, is refused before any byte is written."""
    for read in (read_safetensors, tokenizer_from_json):
        with pytest.raises(WeightFileError, match=f"{tmp_path}: a directory, not a"):
            read(tmp_path)
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    w = {"w": np.ones(2, np.float32)}
    with pytest.raises(IsADirectoryError, match="it is a directory. Fix: name a file"):
        export_params(w, tmp_path)
    with pytest.raises(UnusableDirError, match="taken is a file, not a directory"):
        export_params(w, a_file / "w.safetensors")
    assert a_file.read_text() == "x" and sorted(os.listdir(tmp_path)) == ["taken"]


# -- token ids -----------------------------------------------------------------------------
def test_negative_token_ids_are_refused(tmp_path):
    class Negative(ToySource):
        def batch(self, position):
            b = super().batch(position)
            b["inputs"] = b["inputs"].copy()
            b["inputs"][0, 0] = -3
            return b

    with pytest.raises(ValueError, match="negative token id -3"):
        train(TinyMoELM(nnx.Rngs(0)), Negative(batch_size=4), ONE_STEP,
              progress=False)


# -- SIGTERM -------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_the_run_resumes(tmp_path):
    d = str(tmp_path / "r")
    p = subprocess.Popen([sys.executable, "-c", _SIGINT_RUN.format(root=ROOT, d=d)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.stdout.readline().startswith("START")
    t0 = time.time()
    while latest_step(os.path.join(d, "checkpoints")) is None and time.time() - t0 < 90:
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("hung after SIGTERM")
    assert p.returncode != 0 and "interrupted by SIGTERM after step" in err, err[-2000:]
    ck = Checkpointer(os.path.join(d, "checkpoints"))
    state, _ = ck.restore_latest(_template(TrainConfig(steps=400, batch_size=4, lr=1e-2)))
    ck.close()
    assert int(state.step) >= 1
    shutil.rmtree(d)


def test_a_stop_held_back_comes_once_the_block_ends():
    """Signals that come inside ``stops_deferred`` reach their handlers as it ends, the first
    one only, and the handlers in force before come back; an ignored signal stays ignored."""
    with sigterm_as_interrupt("stopped by SIGTERM"):
        handler = signal.getsignal(signal.SIGTERM)
        reached = []
        with pytest.raises(KeyboardInterrupt, match="stopped by SIGTERM"):
            with stops_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                reached.append("end of block")
        assert reached == ["end of block"]
        assert signal.getsignal(signal.SIGTERM) is handler
        with stops_deferred():  # nothing came: nothing is raised
            pass
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stops_deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, ignored)


# -- result files --------------------------------------------------------------------------
def test_result_files_are_readable_like_ordinary_files(tmp_path):
    old = os.umask(0o022)
    try:
        run = RunDir.create(tmp_path / "r", TrainConfig())
        run.table("t", [{"a": 1}])
        run.finish("done")
    finally:
        os.umask(old)
    for name in ("config.json", "t.csv", "t.md", "summary.md"):
        assert (tmp_path / "r" / name).stat().st_mode & 0o777 == 0o644, name


def test_the_file_mode_is_read_without_clearing_the_umask(monkeypatch):
    """Where the kernel reports the umask, it is read, not set to 0 and back: a file another
    thread creates meanwhile (an async checkpoint save) would be world-writable."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status here")
    old = os.umask(0o027)
    try:
        set_to = []
        real = os.umask
        monkeypatch.setattr(os, "umask", lambda m: set_to.append(m) or real(m))
        assert default_file_mode() == 0o640 and set_to == []
    finally:
        monkeypatch.undo()
        os.umask(old)


def test_something_set_aside_twice_within_a_second_keeps_both(tmp_path, monkeypatch):
    """Names of what is moved aside carry the time to the second: a second move of a cache
    directory within it failed (a directory cannot replace a non-empty one), and of a file
    replaced the first copy."""
    import types

    # the one second, on moejax.files' clock alone
    monkeypatch.setattr(moejax.files, "time",
                        types.SimpleNamespace(strftime=lambda fmt, *a: "20261201T000000"))
    for kind in ("dir", "file"):
        entry = tmp_path / kind
        aside = []
        for i in range(3):
            if kind == "dir":
                entry.mkdir()
                (entry / "x").write_text(str(i))
            else:
                entry.write_text(str(i))
            aside.append(move_aside(entry))
        assert len(set(aside)) == 3 and not entry.exists()
        assert [(p / "x" if kind == "dir" else p).read_text() for p in aside] == ["0", "1", "2"]
