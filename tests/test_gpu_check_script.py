"""scripts/gpu_check.sh's stages call the benchmark each names with its arguments, mark a passed
stage done, skip a done stage on the next run and refuse an unknown stage (a stand-in python
records the calls; no GPU needed)."""

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *stages):
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PYTHON=str(fake))
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), str(tmp_path / "out"),
                           *stages], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    return proc, [c for c in lines if c.startswith("-m ")]  # the benchmarks, not the probes


def test_stages_call_their_benchmark_and_resume(tmp_path):
    proc, calls = _run(tmp_path, "grouped_f32", "speculative")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert calls == [
        f"-m experiments.bench_grouped preset=full variant=f32 out={out}/bench_grouped_f32",
        f"-m experiments.bench_speculative preset=full n_prompts=4 max_new_tokens=128 "
        f"draft_lens=(2,4) out={out}/bench_speculative"]
    assert (out / ".done-grouped_f32").exists() and (out / ".done-speculative").exists()
    _, again = _run(tmp_path, "grouped_f32")
    assert again == calls  # done: not called again


def test_an_unknown_stage_is_refused(tmp_path):
    proc, calls = _run(tmp_path, "grouped_f64")
    assert proc.returncode != 0 and "unknown stage 'grouped_f64'" in proc.stderr
    assert calls == []
