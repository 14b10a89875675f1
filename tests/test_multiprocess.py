"""Two local CPU processes with 4 devices each on JAX's distributed runtime (gloo collectives):
an MoE LM with expert parallelism and FSDP over a (2, 4) mesh spanning both processes trains
20 steps through the training loop (each process loads only its half of every global batch;
both write the orbax checkpoint; each device holds 1/8 of the parameters and optimizer
state) and reports the losses of the single-device run of the same steps; the
checkpoint the single device wrote restores onto the 8-device mesh, and the one the 8 devices
wrote restores onto a single device, both with the checkpoint integrity checks, and both give
the same parameters."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.nn.decoder import DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.train import mesh as mesh_lib
from moejax.train.checkpoint import Checkpointer
from moejax.train.distributed import cpu_devices_env
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.loop import train
from moejax.train.step import init_state
from tests.toy_models import ToySource, tree_max_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = TrainConfig(steps=20, batch_size=8, lr=1e-2, warmup_steps=0, schedule="constant",
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


def test_cpu_devices_env_sets_the_device_count_and_keeps_other_flags():
    env = cpu_devices_env(8, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --a=1",
                              "JAX_PLATFORMS": "cuda", "HOME": "/h"})
    assert env == {"XLA_FLAGS": "--a=1", "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu",
                   "HOME": "/h"}
    assert cpu_devices_env(3, {}) == {"JAX_NUM_CPU_DEVICES": "3", "JAX_PLATFORMS": "cpu"}
