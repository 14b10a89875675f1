"""Two local CPU processes with 4 devices each on JAX's distributed runtime (gloo collectives):
an MoE LM with expert parallelism and FSDP over a (2, 4) mesh spanning both processes trains
10 steps through the training loop (each process loads only its half of every global batch;
both write the orbax checkpoint; each device holds 1/8 of the parameters and optimizer
state) and reports the losses of the single-device run of the same steps; the
checkpoint the single device wrote restores onto the 8-device mesh, and the one the 8 devices
wrote restores onto a single device, both with the checkpoint integrity checks, and both give
the same parameters. A process killed mid-run ends the other in one line and exit code 75
(not JAX's C++ abort), with the checkpoint written restorable."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.harness import experiment
from moejax.nn.decoder import DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.train import distributed, loop
from moejax.train import mesh as mesh_lib
from moejax.train.checkpoint import Checkpointer
from moejax.train.distributed import EXIT_PEER_LOST, cpu_devices_env
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.loop import train
from moejax.train.step import init_state
from tests.toy_models import ToySource, tree_max_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = TrainConfig(steps=10, batch_size=8, lr=1e-2, warmup_steps=0, schedule="constant",
                  mesh_data=2, mesh_expert=4, fsdp=True)
MODEL = MoELMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16,
                    moe=MoEConfig(n_experts=8, top_k=2, d_expert=32))


def new_model():
    return DecoderLM(MODEL.decoder_config(), rngs=nnx.Rngs(0))


def template(mesh=None):
    """A train state shaped like the loop's (its optimizer), placed on ``mesh`` or here."""
    graphdef, params, rest = nnx.split(new_model(), nnx.Param, ...)
    state = init_state(params, rest, make_optimizer(CFG, make_schedule(CFG)), CFG.seed)
    return state if mesh is None else mesh_lib.shard_tree(state, mesh)


_WORKER = r"""
import json, sys
sys.path.insert(0, ROOT)
from moejax.train.distributed import initialize_from_env, local_batch
assert initialize_from_env()
import jax
from moejax.train import mesh as mesh_lib
from moejax.train.checkpoint import Checkpointer
from moejax.train.loop import train
from tests.test_multiprocess import CFG, new_model, template
from tests.toy_models import ToySource, tree_max_diff
assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.devices())
src = ToySource(batch_size=8)
assert local_batch(src, 0)["inputs"].shape[0] == 4  # only this process's rows
mesh = mesh_lib.make_mesh(CFG.mesh_data, CFG.mesh_expert)
state = mesh_lib.shard_tree(template(), mesh, fsdp=True)
leaves = jax.tree.leaves(state)
per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
assert per_device <= 1.05 * sum(x.nbytes for x in leaves) / 8, per_device  # FSDP: 1/8 each
hist = train(new_model(), src, CFG, run_dir=RUN_DIR + "/eight", mesh=mesh, progress=False)
ours, _ = Checkpointer(RUN_DIR + "/eight/checkpoints").restore(template(mesh))
theirs, _ = Checkpointer(RUN_DIR + "/one/checkpoints").restore(template(mesh))
specs = [x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(theirs.params)
         if "w_up" in jax.tree_util.keystr(p)]
assert specs and all(s[0] == "expert" for s in specs), specs
# every shard of a multi-host checkpoint carries a checksum, and restore verifies them: a
# tampered record (its own checksum redone, as damaged data would look) is caught by the
# process that holds the shard
import os, shutil
from jax.experimental import multihost_utils
from moejax.integrity import json_checksum
from moejax.train.checkpoint import CorruptCheckpointError
ckdir = RUN_DIR + "/tampered"
if jax.process_index() == 0:
    shutil.copytree(RUN_DIR + "/eight/checkpoints", ckdir)
multihost_utils.sync_global_devices("copied")
step = max(int(n) for n in os.listdir(ckdir) if n.isdigit())
meta_file = os.path.join(ckdir, str(step), "meta", "metadata")
meta = json.load(open(meta_file))
assert meta["checksums"] is None and len(meta["shard_checksums"]) > 8, meta.keys()
key = sorted(k for k in meta["shard_checksums"] if "w_up" in k)[-1]
multihost_utils.sync_global_devices("read")
if jax.process_index() == 0:
    meta["shard_checksums"][key] = "00000000"
    meta["meta_checksum"] = json_checksum(meta, exclude="meta_checksum")
    json.dump(meta, open(meta_file, "w"))
multihost_utils.sync_global_devices("tampered")
try:
    Checkpointer(ckdir).restore(template(mesh), step)
    caught = ""
except CorruptCheckpointError as e:
    caught = str(e)
assert not caught or key in caught, caught
gather = lambda t: jax.tree.map(lambda x: jax.experimental.multihost_utils.process_allgather(
    x, tiled=True), t)
print("RESULT", json.dumps({"pid": jax.process_index(), "losses": [h["loss"] for h in hist],
                            "diff": tree_max_diff(gather(ours.params), gather(theirs.params)),
                            "caught": bool(caught)}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_with_expert_parallelism_match_one_device(tmp_path):
    assert jax.device_count() == 1
    one = train(new_model(), ToySource(batch_size=8),
                CFG.replace(mesh_data=1, mesh_expert=1, fsdp=False), run_dir=str(tmp_path / "one"),
                progress=False)
    port = _free_port()
    code = _WORKER.replace("ROOT", repr(ROOT), 1).replace("RUN_DIR", repr(str(tmp_path)))
    procs = []
    for pid in range(2):
        env = dict(cpu_devices_env(4), MOEJAX_COORDINATOR=f"127.0.0.1:{port}",
                   MOEJAX_NUM_PROCESSES="2", MOEJAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=400)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in outs:
        if rc != 0 and ("gloo" in err.lower() and "not" in err.lower()):
            pytest.skip(f"CPU multi-process collectives unavailable here: {err[-500:]}")
        assert rc == 0, out[-2000:] + err[-4000:]
    results = [json.loads(o.split("RESULT", 1)[1]) for _, o, _ in outs]
    assert sorted(r["pid"] for r in results) == [0, 1]
    assert sum(r["caught"] for r in results) >= 1  # the tampered shard's holder caught it
    ref = [h["loss"] for h in one]
    for r in results:
        np.testing.assert_allclose(r["losses"], ref, rtol=2e-5, atol=1e-6)
        assert r["diff"] < 1e-4, r["diff"]
    # the 8-device checkpoint on one device
    eight, _ = Checkpointer(str(tmp_path / "eight" / "checkpoints")).restore(template())
    mine, _ = Checkpointer(str(tmp_path / "one" / "checkpoints")).restore(template())
    assert int(eight.step) == int(mine.step) == CFG.steps
    assert tree_max_diff(eight.params, mine.params) < 1e-4


_DYING_WORKER = r"""
import sys
sys.path.insert(0, ROOT)
import jax
from moejax.config import ConfigError
from moejax.harness.experiment import main
from moejax.train.loop import train
from tests.test_multiprocess import CFG, new_model
from tests.toy_models import ToySource

def run(cfg, run):  # a long run that checkpoints every 5 steps into a directory both share
    if FAIL and jax.process_index() == 1:
        raise ConfigError("process 1 refuses its config")
    train(new_model(), ToySource(batch_size=8), cfg, run_dir=RUN_DIR, progress=False)
    return {}

sys.exit(main("dying", lambda preset: CFG.replace(steps=100000, ckpt_every=5), run,
              ["out=" + OUT]))
"""


def _start_pair(tmp_path, fail: bool) -> list:
    port, shared = _free_port(), tmp_path / "shared"
    procs = []
    for pid in range(2):
        out = repr(str(tmp_path / f"p{pid}"))
        code = (_DYING_WORKER.replace("ROOT", repr(ROOT), 1).replace("FAIL", repr(fail))
                .replace("RUN_DIR", repr(str(shared))).replace("OUT", out))
        env = dict(cpu_devices_env(4), MOEJAX_COORDINATOR=f"127.0.0.1:{port}",
                   MOEJAX_NUM_PROCESSES="2", MOEJAX_PROCESS_ID=str(pid),
                   MOEJAX_HEARTBEAT_TIMEOUT="10")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.slow
def test_a_process_that_fails_leaves_at_once_and_the_other_says_so(tmp_path):
    """One of two processes refuses its config (exit 2): it leaves without waiting for the
    other, which is blocked in its first collective and exits with EXIT_PEER_LOST within
    the heartbeat timeout: no process waits on a failed one."""
    procs = _start_pair(tmp_path, fail=True)
    t0 = time.time()
    try:
        _, err1 = procs[1].communicate(timeout=120)
        _, err0 = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    assert procs[1].returncode == 2, err1[-2000:]
    assert err1.strip().splitlines()[-1] == "error: process 1 refuses its config"
    assert procs[0].returncode == EXIT_PEER_LOST, err0[-2000:]
    assert "lost another process (process 1 stopped)" in err0.strip().splitlines()[-1]
    assert time.time() - t0 < 100


@pytest.mark.slow
def test_a_dead_peer_ends_the_survivor_in_one_line_naming_the_checkpoint(tmp_path):
    """SIGKILL one of two training processes: the other exits within seconds with
    EXIT_PEER_LOST and one line naming the checkpoint that resumes the run (not JAX's C++
    abort on missed heartbeats), and that checkpoint restores."""
    procs, shared = _start_pair(tmp_path, fail=False), tmp_path / "shared"
    try:
        ckpts = shared / "checkpoints"
        deadline = time.time() + 300
        while not (ckpts.is_dir() and any(n.name.isdigit() and int(n.name) >= 10
                                          for n in ckpts.iterdir())):
            if time.time() > deadline or procs[0].poll() is not None:
                for p in procs:
                    p.kill()
                pytest.fail("no checkpoint of step 10 within 300 s, or process 0 ended "
                            f"(exit {procs[0].poll()}): "
                            f"{procs[0].communicate(timeout=30)[1][-3000:]}")
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        out, err = procs[0].communicate(timeout=120)
        waited = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    if "gloo" in err.lower() and "not available" in err.lower():
        pytest.skip(f"CPU multi-process collectives unavailable here: {err[-500:]}")
    last = err.strip().splitlines()[-1]
    assert procs[0].returncode == EXIT_PEER_LOST, (procs[0].returncode, waited, err[-3000:])
    # the watcher's line ("lost another process (process 1 stopped)"), or the loop's when the
    # collective failed first ("lost another process during step S (...)", naming the
    # checkpoint that resumes the run)
    assert last.startswith("error: process 0 of 2 lost another process "), last
    assert "start the same command on every process again" in last
    assert waited < 60, waited  # the heartbeat timeout is 10 s here
    print(f"survivor exited after {waited:.1f} s: {last}")
    restored, _ = Checkpointer(str(ckpts)).restore(template())  # the newest complete step
    assert int(restored.step) >= 10


_GLOO_RESET = ("UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection "
               "closed by peer [127.0.0.1]:32925")


def test_a_failed_collective_ends_the_loop_naming_the_step_and_the_checkpoint(
        tmp_path, monkeypatch, capsys):
    """The other path: a collective fails in Python before the watcher notices (gloo's
    "connection closed by peer"), so the loop raises PeerLostError naming the step and the
    checkpoint that resumes it, without closing the checkpointer (its barriers would wait on
    the dead process), and a study's main exits with EXIT_PEER_LOST at once."""
    assert distributed.is_peer_failure(ValueError(_GLOO_RESET), processes=2)
    assert not distributed.is_peer_failure(ValueError(_GLOO_RESET), processes=1)
    assert not distributed.is_peer_failure(ValueError("shapes (3,) and (4,) differ"), 2)

    class Dying(ToySource):
        def batch(self, position):
            if position == 7:  # the 8th step's collective
                raise ValueError(_GLOO_RESET)
            return super().batch(position)

    monkeypatch.setattr(loop, "is_peer_failure", lambda e: distributed.is_peer_failure(e, 2))
    closed = []
    monkeypatch.setattr(Checkpointer, "close", lambda self, abort=False: closed.append(abort))
    cfg = CFG.replace(mesh_data=1, mesh_expert=1, fsdp=False, steps=50, ckpt_every=5)
    with pytest.raises(distributed.PeerLostError) as info:
        train(new_model(), Dying(batch_size=8), cfg, run_dir=str(tmp_path), progress=False)
    msg = str(info.value)
    assert msg.startswith("process 0 of 1 lost another process during step 8 (ValueError: "), msg
    assert f"the newest complete checkpoint (step 5 in {tmp_path}" in msg
    assert msg.endswith("resumes the run exactly: start the same command on every process again")
    assert closed == []  # not closed: that would wait on the dead process

    def run(cfg, run):
        raise info.value

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(experiment.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as exited:
        experiment.main("dying", lambda preset: cfg, run, [f"out={tmp_path / 'study'}"])
    assert exited.value.code == distributed.EXIT_PEER_LOST
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {msg}"


def test_cpu_devices_env_sets_the_device_count_and_keeps_other_flags():
    big_pool = {"PJRT_NPROC": "64"}  # no jaxlib asks for more (moejax.cpu_pool)
    env = cpu_devices_env(8, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --a=1",
                              "JAX_PLATFORMS": "cuda", "HOME": "/h", **big_pool})
    assert env == {"XLA_FLAGS": "--a=1", "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu",
                   "HOME": "/h", **big_pool}
    assert cpu_devices_env(3, big_pool) == {"JAX_NUM_CPU_DEVICES": "3", "JAX_PLATFORMS": "cpu",
                                            **big_pool}
