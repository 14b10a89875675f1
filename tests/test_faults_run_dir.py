"""Fault injection on a run directory: its lock (a second run excluded, a stale lock
recovered, a reader's check no refusal, released when set-up fails), its tensorboard events
on resume, another data stream or model refused before the directory is touched, and a failed
train that leaves the caller's model usable."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.train.logs as logs_mod
from moejax.train.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    latest_step,
)
from moejax.train.loop import ResumeError, train
from moejax.train.run_lock import RunLock, RunLockedError, is_held
from moejax.train.run_state import check_resume
from moejax.train.step import NonFiniteError, lm_loss_fn
from tests.test_faults import CFG, ROOT, _params, _run
from tests.test_train_loop import Crash
from tests.test_train_loop import CrashingSource as CrashAt
from tests.toy_models import TinyMoELM, ToySource, tree_equal


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
    def no_tb(self, logdir, **kw):
        raise ImportError("train.tensorboard=True needs tensorboardX")

    monkeypatch.setattr(logs_mod.TensorBoardLog, "__init__", no_tb)
    with pytest.raises(ImportError, match="tensorboardX"):
        _run(tmp_path / "r", CFG.replace(steps=1, tensorboard=True))
    _run(tmp_path / "r", CFG.replace(steps=1))  # not locked out by the failed run



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

