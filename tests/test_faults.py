"""Fault injection on a training run's checkpoints and run directory: every fault gets a clear
error and loses nothing. Checkpoints (bit flips, missing files, stale saves, failing and
interrupted saves), the run directory (locks, metrics logs, config and data drift on resume);
plus a load test of many interrupted and corrupted saves whose resumptions must match the
uninterrupted run bit for bit. The inputs a run reads besides: ``test_faults_inputs.py``."""

from __future__ import annotations

import gc
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from moejax.integrity import (
    CorruptDataError,
    array_checksum,
    shard_checksums,
    verify_shard_checksums,
)
from moejax.train.checkpoint import (
    Checkpointer,
    CheckpointWriteError,
    CorruptCheckpointError,
    latest_step,
)
from moejax.train.checkpoint_format import release_orbax_threads
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.logs import CsvLog
from moejax.train.loop import ResumeError, read_csv, train
from moejax.train.run_state import check_resume
from moejax.train.step import init_state
from tests.test_train_loop import Crash
from tests.test_train_loop import CrashingSource as CrashAt
from tests.toy_models import TinyMoELM, ToySource, tree_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup_steps=1, schedule="cosine",
                  ckpt_every=2, log_every=1, keep_checkpoints=10, seed=1)
ONE_STEP = CFG.replace(steps=1, ckpt_every=0, keep_checkpoints=3)  # a call without a run_dir


# orbax's abandoned reads of the corrupted checkpoints collected after each test, their
# "exception ignored" reports expected there (conftest's abandoned_reads_collected)
pytestmark = [pytest.mark.usefixtures("abandoned_reads_collected"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(scope="module", autouse=True)
def _collect_only_this_modules_objects():
    """Each test's collection scans only what this module made: the heap the suite built
    before it (seconds to scan, late in the suite) is frozen while it runs."""
    gc.freeze()
    yield
    gc.unfreeze()


def _params(model):
    return nnx.state(model, nnx.Param)


def _run(run_dir, cfg=CFG, source=None, model=None):
    model = model or TinyMoELM(nnx.Rngs(0))
    hist = train(model, source or ToySource(batch_size=4), cfg, run_dir=str(run_dir),
                 progress=False)
    return model, hist


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run: final params and per-step losses."""
    model, hist = _run(tmp_path_factory.mktemp("straight") / "run")
    return _params(model), [h["loss"] for h in hist]


def _template(cfg=CFG):
    g, p, r = nnx.split(TinyMoELM(nnx.Rngs(0)), nnx.Param, ...)
    return init_state(p, r, make_optimizer(cfg, make_schedule(cfg)), cfg.seed)


def _data_files(step_dir):
    return sorted(f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"),
                                       recursive=True) if os.path.isfile(f))


def _invert_file(path):
    raw = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(b ^ 0xFF for b in raw))


# -- checkpoints: corruption ---------------------------------------------------------------
def test_bit_flips_are_detected_or_harmless(tmp_path):
    """A single flipped bit anywhere in the array data is either detected (checksum or
    decode failure) or provably harmless (every array verifies); never silently loaded."""
    _run(tmp_path / "r", CFG.replace(steps=2))
    ck = Checkpointer(tmp_path / "r" / "checkpoints")
    tmpl = _template()
    ref, _ = ck.restore(tmpl, 2)
    detected = harmless = 0
    for f in _data_files(tmp_path / "r" / "checkpoints" / "2"):
        raw = open(f, "rb").read()
        for off in range(0, len(raw), max(1, len(raw) // 4)):
            b = bytearray(raw)
            b[off] ^= 0x04
            open(f, "wb").write(bytes(b))
            try:
                got, _ = ck.restore(tmpl, 2)
            except CorruptCheckpointError as e:
                assert "step 2" in str(e)
                detected += 1
            else:
                assert tree_equal(got.params, ref.params) and tree_equal(got.opt_state,
                                                                         ref.opt_state)
                harmless += 1
            finally:
                open(f, "wb").write(raw)
    ck.close()
    assert detected >= 3, (detected, harmless)


def test_corrupt_newest_step_falls_back_and_resume_is_exact(tmp_path, straight, caplog):
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(5, batch_size=4))
    assert latest_step(run / "checkpoints") == 4
    for f in _data_files(run / "checkpoints" / "4"):
        _invert_file(f)
    with pytest.raises(CorruptCheckpointError):
        Checkpointer(run / "checkpoints").restore(_template(), 4)
    model, hist = _run(run)
    assert "falling back" in caplog.text and "step 4" in caplog.text
    assert [h["step"] for h in hist] == [3, 4, 5, 6]  # resumed from step 2
    assert tree_equal(_params(model), straight[0])
    assert [r["step"] for r in read_csv(run / "metrics.csv")] == ["1", "2", "3", "4", "5", "6"]
    assert os.listdir(run / "checkpoints" / ".corrupt")  # the bad step was kept aside


@pytest.mark.parametrize("victim", ["state/_METADATA", "_CHECKPOINT_METADATA", "meta"])
def test_missing_files_are_named(tmp_path, victim):
    _run(tmp_path / "r", CFG.replace(steps=2))
    p = tmp_path / "r" / "checkpoints" / "2" / victim
    shutil.rmtree(p) if p.is_dir() else p.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"step 2 .*{victim.split('/')[-1]}"):
        Checkpointer(tmp_path / "r" / "checkpoints").restore(_template())
    with pytest.raises(CorruptCheckpointError, match="no checkpoint .* verifies"):
        _run(tmp_path / "r", CFG.replace(steps=4))


def test_stale_uncommitted_steps_are_moved_aside(tmp_path, straight):
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(3, batch_size=4))
    ck = run / "checkpoints"
    shutil.copytree(ck / "2", ck / "4")  # a half-copied step the run will want to save
    (ck / "4" / "commit_success.txt").unlink()
    os.makedirs(ck / "6.orbax-checkpoint-tmp-99")
    model, _ = _run(run)
    assert tree_equal(_params(model), straight[0])
    stale = sorted(os.listdir(ck / ".stale"))
    assert [s.split("-")[0] for s in stale] == ["4", "6.orbax"]
    assert latest_step(ck) == 6


def test_all_steps_uncommitted_restarts_and_keeps_old_metrics(tmp_path, straight):
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(5, batch_size=4))
    for s in ("2", "4"):
        (run / "checkpoints" / s / "commit_success.txt").unlink()
    model, hist = _run(run)
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6]
    assert tree_equal(_params(model), straight[0])
    backups = glob.glob(str(run / "metrics.csv.before-resume-at-0-*"))
    assert len(backups) == 1 and len(read_csv(backups[0])) == 5  # nothing lost


def test_a_metrics_log_rewritten_on_resume_is_whole_or_untouched(tmp_path, monkeypatch):
    """Resuming trims a metrics log back to the resumed step by rewriting it; a failure in
    the middle of that (a kill, a full disk) leaves the old file as it was, not cut short."""
    import csv

    path = tmp_path / "metrics.csv"
    CsvLog(str(path), 0).write([{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)])
    before = path.read_text()

    def dies(self, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", dies)
    with pytest.raises(OSError, match="No space"):
        CsvLog(str(path), 3)  # nothing to drop: no backup copy, the rewrite alone
    assert path.read_text() == before
    monkeypatch.undo()
    CsvLog(str(path), 2)
    assert [r["step"] for r in read_csv(path)] == ["1", "2"]


def test_a_metrics_line_cut_off_by_a_kill_is_not_read_as_a_row(tmp_path):
    """A kill or a full disk can leave the last line without its end: "1" of "13,...", which
    was kept on resume as a row of step 1 with empty cells. It is dropped, the old file
    kept beside it."""
    path = tmp_path / "metrics.csv"
    CsvLog(str(path), 0).write([{"step": s, "loss": 1.0 / s} for s in range(1, 13)])
    whole = path.read_text()
    path.write_text(whole + "1")
    CsvLog(str(path), 12).write([{"step": 13, "loss": 0.5}])
    rows = read_csv(path)
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 14)]
    assert all(r["loss"] for r in rows)
    backup = glob.glob(str(path) + ".before-resume-at-12-*")
    assert len(backup) == 1 and open(backup[0]).read() == whole + "1"
    # resumed at step 12 again within the same second: the first copy is kept beside the new
    path.write_text(path.read_text() + "14,0.25\n")
    CsvLog(str(path), 12)
    backups = glob.glob(str(path) + ".before-resume-at-12-*")
    assert len(backups) == 2 and whole + "1" in [open(b).read() for b in backups]


# -- checkpoints: failing and interrupted saves ---------------------------------------------
_FAILING_SAVE = """
import os, sys, errno
sys.path.insert(0, {root!r})
from flax import nnx
from orbax.checkpoint._src.path import atomicity
from moejax.train.loop import train
from moejax.train.hparams import TrainConfig
from tests.toy_models import TinyMoELM, ToySource
cfg = TrainConfig(steps=4, batch_size=4, lr=1e-2, ckpt_every=2, log_every=1)
for i, exc in enumerate([OSError(errno.EROFS, 'Read-only file system'), KeyboardInterrupt()]):
    async def fail(self, *a, exc=exc, **k):
        raise exc
    atomicity.AtomicRenameTemporaryPath.create = fail
    try:
        train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg,
              run_dir=os.path.join({d!r}, str(i)), progress=False)
        print("NO ERROR", flush=True)
    except BaseException as e:
        print("RAISED", type(e).__name__, e, flush=True)
sys.exit(3)
"""


@pytest.mark.slow
def test_failing_or_interrupted_save_exits_without_hanging(tmp_path):
    """A save that fails inside orbax (read-only disk), then one interrupted by Ctrl-C: both
    raise and the process exits; orbax's waiting threads are released (they used to hang the
    interpreter at exit)."""
    code = _FAILING_SAVE.format(root=ROOT, d=str(tmp_path))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=90, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    raised = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("RAISED")]
    assert raised == ["CheckpointWriteError", "KeyboardInterrupt"], r.stdout
    assert time.time() - t0 < 80
    for i in (0, 1):
        assert latest_step(tmp_path / str(i) / "checkpoints") is None


def test_an_orbax_without_the_signalling_threads_is_named_not_ignored(monkeypatch):
    """Releasing orbax's waiting threads reads a private orbax module; where a newer orbax
    moved it, a warning says a failed save may hang, and nothing is touched."""
    from orbax.checkpoint._src.futures import future

    monkeypatch.delattr(future, "_SignalingThread")
    with pytest.warns(RuntimeWarning, match="this orbax version moved them"):
        assert release_orbax_threads() == 0


def test_unwritable_directory_fails_before_saving(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointWriteError, match="cannot create the checkpoint directory"):
        Checkpointer(tmp_path / "file" / "ck")
    ck = Checkpointer(tmp_path / "ck")
    os.rename(tmp_path / "ck", tmp_path / "gone")
    (tmp_path / "ck").write_text("now a file")
    with pytest.raises(CheckpointWriteError, match="Nothing was saved"):
        ck.save(_template(), data_position=0)
    ck.close()


_SIGINT_RUN = """
import sys
sys.path.insert(0, {root!r})
from flax import nnx
from moejax.train.loop import train
from moejax.train.hparams import TrainConfig
from tests.toy_models import TinyMoELM, ToySource
cfg = TrainConfig(steps=400, batch_size=4, lr=1e-2, ckpt_every=1, log_every=1,
                  keep_checkpoints=2)
print("START", flush=True)
train(TinyMoELM(nnx.Rngs(0)), ToySource(batch_size=4), cfg, run_dir={d!r}, progress=False)
"""


@pytest.mark.slow
def test_ctrl_c_during_saves_never_hangs(tmp_path):
    """A real SIGINT at a random moment of a run that checkpoints every step: the process stops
    promptly with KeyboardInterrupt (no hang, no swallowed Ctrl-C) and its directory resumes."""
    rng = np.random.default_rng(0)
    for i, delay in enumerate(rng.uniform(0.0, 0.3, size=1)):
        d = str(tmp_path / f"r{i}")
        p = subprocess.Popen([sys.executable, "-c", _SIGINT_RUN.format(root=ROOT, d=d)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert p.stdout.readline().startswith("START")
        t0 = time.time()  # wait until the run is saving every step, then interrupt it
        while latest_step(os.path.join(d, "checkpoints")) is None and time.time() - t0 < 90:
            time.sleep(0.02)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"hung after SIGINT at +{delay:.2f}s")
        assert p.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
        tmpl = _template(TrainConfig(steps=400, batch_size=4, lr=1e-2))
        ck = Checkpointer(os.path.join(d, "checkpoints"))
        state, _ = ck.restore_latest(tmpl)
        assert 1 <= int(state.step) < 400
        ck.close()


def test_changed_config_is_refused_unless_forced(tmp_path, straight):
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=CrashAt(3, batch_size=4))
    before = (run / "config.json").read_text()
    for change, key in ((dict(lr=2e-2), "lr"), (dict(seed=7), "seed")):
        with pytest.raises(ResumeError, match=f"{key}: checkpoint .* vs now"):
            _run(run, CFG.replace(**change))
        assert (run / "config.json").read_text() == before  # validated before writing
    _run(run, CFG.replace(log_every=3, ckpt_every=1))  # cadence changes are free
    model, _ = _run(run, CFG.replace(steps=8, resume="force"))
    assert latest_step(run / "checkpoints") == 8
    with pytest.raises(ResumeError, match="step 8, past this run's steps=6"):
        _run(run)


def test_check_resume_refuses_from_metadata_alone(tmp_path, straight):
    """A study calls check_resume before its first evaluation: the same refusals as the
    loop's, from the checkpoint's metadata, and None for a directory without checkpoints."""
    run = tmp_path / "r"
    assert check_resume(run, CFG) is None
    with pytest.raises(Crash):
        _run(run, source=CrashAt(3, batch_size=4))
    assert check_resume(run, CFG) == latest_step(run / "checkpoints")
    with pytest.raises(ResumeError, match="lr: checkpoint"):
        check_resume(run, CFG.replace(lr=2e-2))
    assert check_resume(run, CFG.replace(lr=2e-2, resume="force")) is not None
    with pytest.raises(ResumeError, match="past this run's steps=1"):
        check_resume(run, CFG.replace(steps=1))
    # a record it cannot read is left to the loop, which sets the step aside and falls back
    newest = latest_step(run / "checkpoints")
    (run / "checkpoints" / str(newest) / "meta" / "metadata").write_text("{not json")
    assert check_resume(run, CFG.replace(lr=2e-2)) == newest


# -- load test ---------------------------------------------------------------------------
def _damage(run, rng) -> str:
    """One random fault to the newest checkpoint: none, a bit flip in its array data, a
    deleted ``_METADATA``, or a stale half-copied newer step directory."""
    ck = run / "checkpoints"
    step = latest_step(ck)
    kind = ["none", "flip", "metadata", "stale"][int(rng.integers(4))]
    if step is None or kind == "none":
        return "none"
    if kind == "flip":
        for f in _data_files(ck / str(step)):
            _invert_file(f)
    elif kind == "metadata":
        (ck / str(step) / "state" / "_METADATA").unlink()
    else:
        shutil.copytree(ck / str(step), ck / str(step + 1))
        (ck / str(step + 1) / "commit_success.txt").unlink()
    return kind


@pytest.mark.slow
def test_load_many_interrupted_and_corrupted_saves_resume_bitwise(tmp_path):
    """Ten rounds: crash the run at a random data position, damage the newest checkpoint
    at random, resume. When it finishes, the model equals the uninterrupted run's bit for bit
    and metrics.csv holds each step once, with the uninterrupted losses."""
    cfg = CFG.replace(steps=10, ckpt_every=1, keep_checkpoints=3)
    model_a, hist_a = _run(tmp_path / "straight", cfg)
    run, rng = tmp_path / "r", np.random.default_rng(0)
    faults = []
    for _ in range(10):
        crash_at = int(rng.integers(1, cfg.steps + 2))
        try:
            _run(run, cfg, source=CrashAt(crash_at, batch_size=4))
        except Crash:
            pass
        faults.append(_damage(run, rng))
    for _ in range(cfg.steps):  # a damaged final step may need several resumptions
        try:
            model_b, _ = _run(run, cfg)
            break
        except CorruptCheckpointError:  # every kept step was damaged: start over
            shutil.rmtree(run / "checkpoints")
    assert tree_equal(_params(model_b), _params(model_a))
    rows = read_csv(run / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, cfg.steps + 1))
    assert [float(r["loss"]) for r in rows] == pytest.approx([h["loss"] for h in hist_a],
                                                             rel=0, abs=0)
    assert {"flip", "metadata", "stale"} <= set(faults)


def test_shard_checksums_cover_each_region_and_verify_across_layouts():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    whole = shard_checksums({"w": a})
    assert list(whole) == ["w@0:4,0:6"]
    # regions saved by other processes, checked on an array held whole here
    regions = {"w@0:2,0:6": array_checksum(a[:2]), "w@2:4,0:6": array_checksum(a[2:])}
    assert verify_shard_checksums({"w": a}, regions, "ckpt") == 2
    regions["w@2:4,0:6"] = array_checksum(a[2:] + 1)
    with pytest.raises(CorruptDataError, match=r"ckpt is corrupt: 1 shards differ .*w@2:4,0:6"):
        verify_shard_checksums({"w": a}, regions, "ckpt")
    with pytest.raises(CorruptDataError, match=r"missing arrays \['v'\]"):
        verify_shard_checksums({"w": a}, {"v@0:1": "00000000"}, "ckpt")
