"""``python -m experiments.full_smoke``: each study in its own Python. With ``preset=quick
devices=2`` (``make smoke-devices``) its training loop's mesh spans 2 CPU devices (here one
study; the sweep over all of them is the make target, too long for the suite); a stopped run
ends the study it was running and says what its table holds."""

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.full_smoke import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_study_smokes_on_two_cpu_devices_and_the_table_says_so(tmp_path):
    out = tmp_path / "smoke"
    code = main(["only=lm_demo", "preset=quick", "devices=2", f"out={out}", "timeout=600",
                 "lm_demo.model.n_layers=1"])
    log = (out / "lm_demo.log").read_text()
    assert code == 0, log[-3000:]
    (row,) = list(csv.DictReader((out / "full_smoke.csv").open()))
    assert row["devices"] == "2" and row["result"] == "OK", row
    assert row["depth"] == "model.n_layers=1"
    summary = (out / "summary.md").read_text()
    assert "Quick presets as smoke runs on 2 CPU devices" in summary
    assert "1 of 1 quick presets proven (smoke on 2 CPU devices)" in summary
    # the study's own run: quick preset, smoke, in the child's out directory
    assert "preset=quick" in (out / "lm_demo" / "run.json").read_text()


def _naming(text: str) -> list[int]:
    """The live processes whose command line holds ``text`` (Linux's /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode("utf-8", "replace"):
                pids.append(int(d.name))
        except OSError:  # ended while read
            pass
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("sig, why", [(signal.SIGTERM, "stopped by SIGTERM"),
                                      (signal.SIGINT, "stopped by Ctrl-C")])
@pytest.mark.parametrize("starting", [False, True], ids=["running", "starting"])
def test_a_stopped_run_ends_the_study_it_was_running(tmp_path, sig, why, starting):
    """The study runs in a session of its own (so that its timeout ends all its processes),
    which neither Ctrl-C nor a SIGTERM to the runner reaches: the runner ends it before it
    exits, in one line naming the study and what the table holds, with the shell's 130. So
    too when the stop comes while the study starts: its Python already runs, and the runner
    has not yet got its process back (here ``Popen`` held 3 s after the study's exec)."""
    out = tmp_path / "smoke"
    # Ctrl-C raised as from a terminal: a suite started in the background runs with SIGINT
    # ignored, which its processes inherit (and a fork-time reset would fork a threaded jax)
    slow = ("import subprocess, time; subprocess.Popen.__init__ = lambda self, *a, "
            "_init=subprocess.Popen.__init__, **k: (_init(self, *a, **k), time.sleep(3))[0]; "
            if starting else "")
    runner = (f"{slow}import runpy, signal, sys; "
              "signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv[0] = 'full_smoke'; runpy.run_module('experiments.full_smoke', "
              "run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", runner, "only=lm_demo", "preset=quick",
                             f"out={out}", "timeout=600"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    study = str(out / "lm_demo")  # in the study's command line, not in the runner's
    try:
        deadline = time.time() + 120
        while not _naming(study):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"[full_smoke] {why} during lm_demo: the table in {out} holds the 0 studies that "
        "finished before it")
    assert _naming(study) == []
