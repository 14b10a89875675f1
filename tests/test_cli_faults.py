"""The heavier command-line fault cases, each a real ``python -m experiments.<study>`` in a
subprocess, run side by side (threads waiting on processes) so that together they cost about
as much as the slowest chain:

* the command ``run.json`` records is shell-quoted and reproduces the run (a prompt holding
  quotes and `` smoke=true`` included): run again elsewhere, it writes the same tables, and
  both runs are indexed;
* resuming with a changed config is refused with exit 2 and no traceback, before the study's
  first evaluation;
* ``MOEJAX_DATA_DIR`` naming a file is refused with exit 2 and no traceback;
* an expert axis that does not divide the expert count is refused with exit 2 and no
  traceback, before anything compiles.
"""

import csv
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from moejax.train.distributed import cpu_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "prompt=it's a \"quoted\" smoke=true prompt"


def _study(argv, tmp, extra_env=None, timeout=300):
    env = dict(os.environ)  # the suite's XLA flags, which key its compilation cache
    env.update(MOEJAX_RUN_INDEX=str(tmp / "index.jsonl"), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def _tables(path):
    """The run's tables without its timings (the only columns a rerun may change)."""
    return {name: [{k: v for k, v in row.items() if "per_s" not in k}
                   for row in csv.DictReader(open(path / f"{name}.csv"))]
            for name in ("summary", "router")}


TINY = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=0", "train.log_every=1",
        "train.eval_every=2", "train.ckpt_every=2", "eval_batches=1", "sample_tokens=4"]


def _rerun_and_resume(tmp):
    """lm_demo, then its recorded command run again in another directory, then the first
    directory resumed with another learning rate."""
    first = tmp / "lm1"
    a = _study(["experiments.lm_demo", *TINY, PROMPT, f"out={first}"], tmp)
    assert a.returncode == 0, a.stderr[-2000:]
    record = json.loads((first / "run.json").read_text())
    argv = shlex.split(record["command"])
    assert argv[:3] == ["python", "-m", "experiments.lm_demo"] and PROMPT in argv
    second = tmp / "lm2"
    argv = [f"out={second}" if arg.startswith("out=") else arg for arg in argv[2:]]
    b = _study(argv, tmp)
    assert b.returncode == 0, b.stderr[-2000:]
    tables = _tables(first), _tables(second)
    resumed = _study(["experiments.lm_demo", *TINY, PROMPT, "train.lr=0.01",
                      "overwrite=true", f"out={first}"], tmp)
    return record, json.loads((second / "run.json").read_text()), *tables, resumed


def _data_dir_file(tmp):
    afile = tmp / "not_a_dir"
    afile.write_text("x")
    return _study(["experiments.darex.encoder", "smoke=true", f"out={tmp / 'enc'}"], tmp,
                  {"MOEJAX_DATA_DIR": str(afile)})


def _expert_axis(tmp):
    return _study(["experiments.lm_demo", "smoke=true", "train.mesh_data=2",
                   "train.mesh_expert=3", "train.batch_size=6", f"out={tmp / 'ep'}"], tmp,
                  cpu_devices_env(6, {}))


def _refused(r, *needles):
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("WARNING")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert err and err[0].startswith("error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_command_line_faults_side_by_side(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        chain = pool.submit(_rerun_and_resume, tmp_path)
        data_dir = pool.submit(_data_dir_file, tmp_path)
        axis = pool.submit(_expert_axis, tmp_path)
        (first, second, tables1, tables2, resumed), data_dir, axis = (
            chain.result(), data_dir.result(), axis.result())
    # the recorded command reproduces the run: same config, same tables, and it is indexed
    assert second["config_hash"] == first["config_hash"]
    assert tables2 == tables1
    index = [json.loads(line) for line in open(tmp_path / "index.jsonl")]
    assert len([e for e in index if e.get("study") == "lm_demo"]) == 2
    # resuming with another lr: refused from the checkpoint's metadata, before evaluating
    _refused(resumed, "train/lr: checkpoint 0.003 vs now 0.01", "train.resume=force")
    assert "evaluat" not in resumed.stderr.lower()
    _refused(data_dir, "is a file, not a directory", "MOEJAX_DATA_DIR")
    _refused(axis, "does not divide model.moe.n_experts=8")
    assert not (tmp_path / "ep" / "train").exists()
