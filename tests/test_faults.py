"""Fault injection: every fault class of the reliability review gets a clear error and loses
nothing. Checkpoints (bit flips, missing files, stale saves, failing and interrupted saves,
locks, config drift on resume), delta files, compressed DeRS checkpoints, weight imports,
tokenizer ids and configs; plus a load test of many interrupted and corrupted saves whose
resumptions must match the uninterrupted run bit for bit."""

from __future__ import annotations

import gc
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.delta import storage
from moejax.integrity import CorruptDataError, array_checksum, verify_checksums
from moejax.io import WeightFileError
from moejax.train.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointWriteError,
    CorruptCheckpointError,
    latest_step,
)
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.loop import ResumeError, read_csv, train
from moejax.train.run_lock import RunLock, RunLockedError, is_held
from moejax.train.run_state import check_resume
from moejax.train.step import NonFiniteError, init_state, lm_loss_fn
from tests.test_train_loop import Crash
from tests.test_train_loop import CrashingSource as CrashAt
from tests.toy_models import TinyMoELM, ToySource, tree_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup_steps=1, schedule="cosine",
                  ckpt_every=2, log_every=1, keep_checkpoints=10, seed=1)
ONE_STEP = CFG.replace(steps=1, ckpt_every=0, keep_checkpoints=3)  # a call without a run_dir


# A restore of a deliberately corrupted checkpoint fails inside orbax's asynchronous reads,
# which leave their unfinished read coroutines to the garbage collector: collected here, after
# each test, so their "exception ignored" reports stay with the test that caused them (and
# are expected there) rather than surfacing in whichever test runs next.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module", autouse=True)
def _collect_only_this_modules_objects():
    """Each test's collection scans only what this module made: the heap the suite built
    before it (seconds to scan, late in the suite) is frozen while it runs."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _collect_abandoned_reads():
    yield
    gc.collect()


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

    from moejax.train.logs import CsvLog

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
    from moejax.train.logs import CsvLog

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

    from moejax.train.checkpoint_format import release_orbax_threads

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


# -- run directory: locks and resume semantics ---------------------------------------------
def test_run_lock_excludes_a_second_run_and_recovers_stale_locks(tmp_path):
    with RunLock(tmp_path / "r"):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}.*out="):
            RunLock(tmp_path / "r").acquire()
        with pytest.raises(RunLockedError):
            _run(tmp_path / "r", CFG.replace(steps=1))
    assert not (tmp_path / "r" / "metrics.csv").exists()  # the refused run wrote nothing
    # a lock file left by a process killed with -9 is taken over
    code = (f"import sys, os; sys.path.insert(0, {ROOT!r}); from moejax.train.run_lock import "
            f"RunLock; RunLock({str(tmp_path / 'r')!r}).acquire(); print('held', flush=True); "
            "import time; time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(RunLockedError, match=f"pid {p.pid}"):
        RunLock(tmp_path / "r").acquire()
    p.kill()
    p.wait()
    _run(tmp_path / "r", CFG.replace(steps=1))  # stale lock: recovered


def test_a_readers_instant_check_does_not_refuse_a_run_starting_then(tmp_path):
    """A results document checks whether a run holds a directory by taking its lock shared
    for an instant; a run that starts in that instant waits it out instead of being refused
    as if another run held the directory."""
    import fcntl
    import threading

    lock = tmp_path / "r" / ".lock"
    lock.parent.mkdir()
    lock.write_text("")
    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the reader, caught mid-check
    reader = threading.Timer(0.05, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd)))
    reader.start()
    with RunLock(tmp_path / "r") as run:  # refused (RunLockedError) by a single try
        assert run._fd is not None and is_held(tmp_path / "r")
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    reader.join()
    assert not is_held(tmp_path / "r")


def _tb_events(path):
    """The events of a TensorBoard event file (TFRecord: length, its CRC, data, data CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    data, out, i = open(path, "rb").read(), [], 0
    while i < len(data):
        n = struct.unpack("<Q", data[i:i + 8])[0]
        event = Event()
        event.ParseFromString(data[i + 12:i + 12 + n])
        out.append(event)
        i += 12 + n + 4
    return out


def test_a_resumed_run_purges_its_tensorboard_events_past_the_checkpoint(tmp_path, monkeypatch):
    """The killed run logged step 5 after its checkpoint of step 4, and the resumed run logs
    it again: without a purge TensorBoard drew both. The resumed run's event file starts with
    TensorBoard's purge marker (a session start at step 5), as the metrics CSV drops its rows
    past step 4. tensorboardX names a file by the second and opens it for writing: a run
    resumed within the same second overwrote the killed run's events (the clock is held
    still here to make that second the same)."""
    tbx = pytest.importorskip("tensorboardX.event_file_writer")
    from tensorboardX.proto.event_pb2 import SessionLog

    # tensorboardX's own clock only (its module's name `time`)
    monkeypatch.setattr(tbx, "time", types.SimpleNamespace(time=lambda: 1764561600.25))
    cfg, run = CFG.replace(tensorboard=True), tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, cfg, source=CrashAt(5, batch_size=4))
    first = glob.glob(str(run / "tb" / "events.*"))
    assert len(first) == 1
    logged = {e.step for e in _tb_events(first[0]) if e.summary.value}
    assert logged == {1, 2, 3, 4, 5}
    _run(run, cfg)
    assert {e.step for e in _tb_events(first[0]) if e.summary.value} == logged  # kept
    (second,) = set(glob.glob(str(run / "tb" / "events.*"))) - set(first)
    starts = [e.step for e in _tb_events(second) if e.session_log.status == SessionLog.START]
    assert starts == [5]
    assert {e.step for e in _tb_events(second) if e.summary.value} == {5, 6}


def test_setup_failure_releases_the_lock(tmp_path, monkeypatch):
    import moejax.train.logs as logs_mod

    def no_tb(self, logdir, **kw):
        raise ImportError("train.tensorboard=True needs tensorboardX")

    monkeypatch.setattr(logs_mod.TensorBoardLog, "__init__", no_tb)
    with pytest.raises(ImportError, match="tensorboardX"):
        _run(tmp_path / "r", CFG.replace(steps=1, tensorboard=True))
    _run(tmp_path / "r", CFG.replace(steps=1))  # not locked out by the failed run


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


def test_another_data_stream_is_refused_unless_forced(tmp_path):
    """Each checkpoint records its source's fingerprint (moejax.data's loaders set one); a
    resume from a source of another fingerprint is refused as a changed config is, before
    anything is written, and a source that names none is not compared."""
    def named(source, fingerprint):
        source.fingerprint = fingerprint
        return source

    a, b = "lm/chitchat/train/seq16/seed0", "lm/chitchat/train/seq16/seed1"
    run = tmp_path / "r"
    with pytest.raises(Crash):
        _run(run, source=named(CrashAt(3, batch_size=4), a))
    ckpt = Checkpointer(run / "checkpoints")
    try:
        assert ckpt.read_meta(2)["data"] == a
    finally:
        ckpt.close()
    before = (run / "config.json").read_text()
    with pytest.raises(ResumeError, match=f"data: checkpoint '{a}' vs now '{b}'"):
        _run(run, source=named(ToySource(batch_size=4, seed=1), b))
    assert (run / "config.json").read_text() == before and latest_step(run / "checkpoints") == 2
    with pytest.raises(ResumeError, match="another config or data"):
        check_resume(run, CFG, data=b)
    assert check_resume(run, CFG, data=a) == check_resume(run, CFG) == 2
    assert check_resume(run, CFG.replace(resume="force"), data=b) == 2
    with pytest.raises(Crash):  # the same stream resumes
        _run(run, source=named(CrashAt(5, batch_size=4), a))
    assert latest_step(run / "checkpoints") == 4
    _, hist = _run(run)  # a plain source names no stream: not compared
    assert [h["step"] for h in hist] == [5, 6]


def test_mismatched_model_does_not_touch_the_run_dir(tmp_path):
    run = tmp_path / "r"
    _run(run, CFG.replace(steps=2))
    before = (run / "config.json").read_text()
    with pytest.raises(CheckpointMismatchError):
        _run(run, CFG.replace(steps=2), model=TinyMoELM(nnx.Rngs(0), d=10))
    assert (run / "config.json").read_text() == before


def test_failed_train_leaves_the_callers_model_usable(tmp_path):
    model = TinyMoELM(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, _params(model))

    def nan_loss(m, batch, key):
        loss, metrics = lm_loss_fn(m, batch, key)
        return loss * jnp.nan, metrics

    with pytest.raises(NonFiniteError):
        train(model, ToySource(batch_size=4), CFG, loss_fn=nan_loss, run_dir=str(tmp_path),
              progress=False)
    assert tree_equal(jax.tree.map(np.asarray, _params(model)), before)
    logits, _ = model(ToySource(batch_size=2).batch(0)["inputs"])
    assert np.isfinite(np.asarray(logits)).all()
    assert latest_step(tmp_path / "checkpoints") is None


def test_token_ids_past_the_vocabulary_fail_before_compute():
    from moejax.nn.decoder import DecoderLM, dense_decoder_config

    cfg = dense_decoder_config(vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_hidden=16)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="token id 15 but the model's vocab_size is 8"):
        train(model, ToySource(batch_size=4), ONE_STEP, progress=False)


def test_a_classifiers_token_and_class_ids_are_checked_before_compute():
    """A SequenceClassifier keeps its config on its encoder, so its token ids went unchecked,
    and no model's labels were: labels 0..4 for a head of 3 classes gave a NaN loss, blamed
    on the learning rate."""
    from moejax.data.batches import ClassificationBatches
    from moejax.evaluate import classifier_loss_fn
    from moejax.nn.encoder import SequenceClassifier, bert_encoder_config

    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=1, n_heads=2, d_hidden=16,
                              max_position=8)
    rng = np.random.default_rng(0)
    tokens, labels = rng.integers(0, 20, (16, 6)), rng.integers(0, 5, 16)
    for x, y, match in ((tokens, labels, "class id 4 but the model has 3 classes"),
                        (tokens + 20, labels % 3, "token id .* but the model's vocab_size is 20")):
        model = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=match):
            train(model, ClassificationBatches(x, y, batch_size=4), ONE_STEP,
                  loss_fn=classifier_loss_fn, progress=False)


# -- delta files, compressed checkpoints, imports -----------------------------------------
@pytest.fixture
def delta_file(tmp_path):
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(16, 8)).astype(np.float32),
            "b": np.where(rng.random((32,)) < 0.1, 1.0, 0.0).astype(np.float32)}
    path = str(tmp_path / "d.npz")
    storage.save(path, storage.encode(tree))
    return path, tree


def test_delta_file_damage_is_named(delta_file, tmp_path):
    path, tree = delta_file
    raw = open(path, "rb").read()
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0x01
    cases = {"flip.npz": bytes(flipped), "cut.npz": raw[: len(raw) // 2], "zero.npz": b""}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name} is corrupt or not a delta file"):
            storage.load(str(tmp_path / name))
    with pytest.raises(ValueError, match="does not end with '.npz'"):
        storage.load(path[:-4])
    got = storage.decode(storage.load(path), like=tree)
    np.testing.assert_array_equal(np.asarray(got["a"]), tree["a"])


def test_crafted_delta_members_are_named(delta_file, tmp_path):
    import io
    import zipfile

    path, _ = delta_file
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    inner = io.BytesIO()
    np.savez(inner, x=np.zeros(3))
    # a member that is itself an npz; an .npy whose header declares 4 PiB
    huge = io.BytesIO()
    np.lib.format.write_array_header_1_0(huge, {"descr": "<f4", "fortran_order": False,
                                                "shape": (2**50,)})
    for name, extra in (("nested.npz", ("leaf0.values", inner.getvalue())),
                        ("huge.npz", ("leaf0.values.npy", huge.getvalue() + bytes(64)))):
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            for k, v in members.items():
                if k != "leaf0.values":
                    buf = io.BytesIO()
                    np.save(buf, v)
                    zf.writestr(k + ".npy", buf.getvalue())
            zf.writestr(*extra)
        with pytest.raises(ValueError, match=f"{name} is corrupt or not a delta file"):
            storage.load(str(tmp_path / name))


def test_delta_metadata_inconsistencies_are_named(delta_file):
    path, tree = delta_file
    stored = storage.load(path)
    meta = json.loads(json.dumps(stored.meta))
    meta["leaves"][0]["shape"] = [16, 9]
    with pytest.raises(ValueError, match="leaf 0 \\('a'\\): 128 values for shape \\(16, 9\\)"):
        storage.decode(storage.StoredDelta(stored.arrays, meta))
    sparse = next(i for i, m in enumerate(stored.meta["leaves"]) if m["kind"] == "sparse")
    arrays = dict(stored.arrays)
    idx = arrays[f"leaf{sparse}.index"].copy()
    idx[-1] = 200
    arrays[f"leaf{sparse}.index"] = idx
    with pytest.raises(ValueError, match="sparse index 200 out of range"):
        storage.decode(storage.StoredDelta(arrays, stored.meta))
    with pytest.raises(ValueError, match="shapes differ from `like`"):
        storage.decode(stored, like={"a": np.zeros((8, 16)), "b": np.zeros(32)})


def test_quantised_delta_damage_is_named_not_decoded_into_wrong_values():
    """A quantised leaf's block arrays and settings are checked against each other: a step of
    the wrong block shape would broadcast into wrong weights (an error of 0.9 here)."""
    from moejax.delta.quant import quantize_tree

    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(8, 16)).astype(np.float32)}
    stored = storage.encode(quantize_tree(tree, 4, granularity="channel"))
    asym = storage.encode(quantize_tree(tree, 3, symmetric=False, granularity="group",
                                        group_size=4))

    def refused(st, match, arrays=None, **meta):
        m = json.loads(json.dumps(st.meta))
        m["leaves"][0].update(meta)
        with pytest.raises(ValueError, match=match):
            storage.decode(storage.StoredDelta({**st.arrays, **(arrays or {})}, m))

    step = stored.arrays["leaf0.step"]
    refused(stored, r"leaf 0 \('w'\): step stored as float32 \(1, 1, 1\); the leaf's blocks "
            r"need float32 \(1, 1, 16\)", {"leaf0.step": step[:, :, :1]})
    refused(stored, "step stored as float64", {"leaf0.step": step.astype(np.float64)})
    refused(stored, "granularity='tensor '", granularity="tensor ")
    refused(stored, "group_size=5 must divide d_in=8", granularity="group", group_size=5)
    refused(stored, "in_axis=3 is outside", in_axis=3)
    refused(stored, "levels=3 at 4 bits", levels=3)
    refused(stored, "symmetric must be a bool", symmetric=1)
    codes = stored.arrays["leaf0.codes"].copy()
    codes[0] = 0xFF  # two codes of 15 at 4 bits, symmetric: 15 levels, 0..14
    refused(stored, "a code past the 15 levels of 4-bit codes", {"leaf0.codes": codes})
    refused(stored, "64 code int64 entries, shape \\(8, 16\\) at 4 bits needs 64 uint8 bytes",
            {"leaf0.codes": stored.arrays["leaf0.codes"].astype(np.int64)})
    refused(asym, r"offset stored as float32 \(1, 1, 16\)",
            {"leaf0.offset": asym.arrays["leaf0.offset"][:1]})
    for st in (stored, asym):  # the undamaged ones still decode
        storage.decode(st, like=tree)


def test_compressed_ders_checkpoint_corruption_detected(tmp_path):
    from moejax.ders_compress.ckpt import load_compressed, save_compressed
    from moejax.ders_compress.compress import CompressedDeRS

    rng = np.random.default_rng(0)
    base = {0: {"w_up": rng.normal(size=(8, 16)).astype(np.float32)}}
    delta = {"e0": rng.normal(size=(8, 16)).astype(np.float32)}
    c = CompressedDeRS(base, {"embed": rng.normal(size=(4, 8)).astype(np.float32)},
                       storage.encode(delta), {"note": "test"})
    path = save_compressed(tmp_path / "c", c)
    got, _ = load_compressed(path)
    np.testing.assert_array_equal(got.base[0]["w_up"], base[0]["w_up"])
    for f in _data_files_any(path):
        _invert_file(f)
    with pytest.raises(CorruptDataError, match="is corrupt"):
        load_compressed(path)
    # a meta record that lost its checksums cannot vouch for the arrays: refused, not loaded
    import orbax.checkpoint as ocp

    from moejax.ders_compress.ckpt import FORMAT
    bare = str(tmp_path / "bare")
    tree = {"base": {"0": base[0]}, "rest": dict(c.rest), "deltas": dict(c.stored.arrays)}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(bare, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(tree),
            meta=ocp.args.JsonSave({"format": FORMAT, "ders": c.meta, "storage": c.stored.meta,
                                    "model_config": None})))
    with pytest.raises(CorruptDataError, match="no array checksums"):
        load_compressed(bare)
    # its meta record decides how the deltas are put back: an edit to it is caught
    path = save_compressed(tmp_path / "edited", c)
    record = os.path.join(path, "meta", "metadata")
    meta = json.load(open(record))
    assert meta["format"] == FORMAT and meta["ders"] == {"note": "test"}
    json.dump({**meta, "ders": {"note": "edited"}}, open(record, "w"))
    with pytest.raises(CorruptDataError, match="meta record .* was changed"):
        load_compressed(path)
    from moejax.integrity import tree_checksums  # a v1 record (no meta_checksum) still loads
    v1 = str(tmp_path / "v1")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(v1, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(tree),
            meta=ocp.args.JsonSave({"format": "moejax-ders-compressed-v1", "ders": c.meta,
                                    "storage": c.stored.meta, "model_config": None,
                                    "checksums": tree_checksums(tree)})))
    np.testing.assert_array_equal(load_compressed(v1)[0].base[0]["w_up"], base[0]["w_up"])


def _data_files_any(path):
    return [f for f in glob.glob(os.path.join(path, "**", "d", "*"), recursive=True)
            if os.path.isfile(f)]


def test_checksum_properties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    assert array_checksum(x) == array_checksum(x.copy())
    assert array_checksum(x) != array_checksum(x.reshape(7, 5))  # shape is part of it
    assert array_checksum(x) != array_checksum(x.view(np.int32))  # so is dtype
    y = x.copy()
    y.view(np.uint8).reshape(-1)[13] ^= 0x80
    assert array_checksum(x) != array_checksum(y)
    tree = {"p": {"w": x}, "s": np.int32(3)}
    from moejax.integrity import tree_checksums

    sums = tree_checksums(tree)
    verify_checksums(tree, sums, "t")
    with pytest.raises(CorruptDataError, match="p/w"):
        verify_checksums({"p": {"w": y}, "s": np.int32(3)}, sums, "t")
    # numpy's own dtypes keep the checksums saved files already hold
    assert array_checksum(np.arange(6, dtype=np.float32).reshape(2, 3)) == "ba750485"
    # bfloat16 (a bare 2-byte void to numpy) is named: unlike float16 or uint16 of its bytes
    b = x.astype(jnp.bfloat16)
    assert array_checksum(b) == array_checksum(b.copy())
    assert array_checksum(b) not in {array_checksum(b.view(np.uint16)),
                                      array_checksum(b.view(np.float16))}


def test_safetensors_import_rejects_integers_and_non_finite(tmp_path):
    from moejax.io.safetensors_io import export_params, import_params

    make = lambda: TinyMoELM(nnx.Rngs(0))  # noqa: E731
    from moejax.io._common import flat_params

    flat = {k: np.asarray(v) for k, v in flat_params(make()).items()}
    ints = dict(flat, **{"head/kernel": np.ones(flat["head/kernel"].shape, np.int32)})
    export_params(ints, tmp_path / "int.safetensors")
    with pytest.raises(WeightFileError, match="'head/kernel' has integer dtype int32"):
        import_params(tmp_path / "int.safetensors", make)
    nans = dict(flat)
    nans["embed/embedding"] = flat["embed/embedding"].copy()
    nans["embed/embedding"][1, 2] = np.nan
    nans["embed/embedding"][3, 0] = np.inf
    export_params(nans, tmp_path / "nan.safetensors")
    with pytest.raises(WeightFileError, match="'embed/embedding' holds 2 NaN/inf values"):
        import_params(tmp_path / "nan.safetensors", make)
    export_params(flat, tmp_path / "ok.safetensors")
    import_params(tmp_path / "ok.safetensors", make)


# -- tokenizer and configs ------------------------------------------------------------------
def test_byte_tokenizer_rejects_out_of_vocabulary_ids():
    from moejax.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    assert tok.decode([1, 3 + ord("h"), 3 + ord("i"), 2]) == "hi"
    for bad in ([259], [5, 300], [-1]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode(bad)


@pytest.mark.parametrize("build,match", [
    (lambda: TrainConfig(seed=-1), "seed=-1"),
    (lambda: TrainConfig(lr=float("inf")), "lr=inf"),
    (lambda: TrainConfig(lr=float("nan")), "nan"),
    (lambda: __import__("moejax.substrates.lm", fromlist=["x"]).LMSubstrateConfig(seq_len=0),
     "seq_len=0"),
    (lambda: __import__("moejax.substrates.lm", fromlist=["x"]).LMSubstrateConfig(
        eval_batches=0), "eval_batches=0"),
    (lambda: __import__("moejax.nn.moe_lm", fromlist=["x"]).MoELMConfig(d_model=30,
                                                                        n_heads=4),
     "d_model=30 is not divisible"),
    (lambda: __import__("moejax.nn.moe", fromlist=["x"]).MoEConfig(n_experts=2, top_k=3),
     "top_k=3"),
    (lambda: __import__("moejax.nn.moe", fromlist=["x"]).MoEConfig(capacity_factor=0.0),
     "capacity_factor=0.0"),
    (lambda: __import__("moejax.sparse_lm", fromlist=["x"]).SparseLMConfig(d_model=30),
     "not divisible"),
])
def test_configs_fail_at_construction(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_study_overrides_fail_before_compute():
    from experiments.blockffn import speculative
    from experiments.darex import encoder
    from experiments.ders import compression as ders_compression
    from experiments.ders import upcycling

    cfg = ders_compression.make_config("quick")
    for bad, match in (("ckpt_drop=1.0", "ckpt_drop=1.0"), ("eval_batches=0", "eval_batches"),
                       ("train.seed=-1", "seed"),
                       ("substrate.seq_len=2000", "exceeds the substrates' max_seq_len, 1024")):
        with pytest.raises(ConfigError, match=match):
            apply_overrides(cfg, [bad])
    # a training window longer than the model's positions: refused, not trained on
    with pytest.raises(ConfigError, match="exceeds SmolLM2's context, 8192"):
        apply_overrides(upcycling.make_config("quick"),
                        ["substrate.source=smollm2", "substrate.seq_len=9000"])
    with pytest.raises(ConfigError, match=r"seq_len=2000 \(the training window\) exceeds"):
        apply_overrides(speculative.make_config("quick"), ["seq_len=2000"])
    with pytest.raises(ConfigError, match="seq_len=600 exceeds MiniLM's 512 positions"):
        apply_overrides(encoder.make_config("quick"), ["seq_len=600"])
    r = subprocess.run([sys.executable, "-m", "experiments.ders.compression", "ckpt_drop=1.0",
                        "out=" + os.devnull], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 2 and "ckpt_drop=1.0 must be in [0, 1)" in r.stderr


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
    from moejax.integrity import shard_checksums, verify_shard_checksums

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
