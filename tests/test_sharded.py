"""Sharded (data x expert) train step == single-device step, on 8 fake CPU devices.

Runs in a subprocess because the device count must be set before JAX starts."""

import pytest

from tests.devices import run_on_devices

_SCRIPT = r"""
import sys
sys.path.insert(0, ROOT)
import jax, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import init_train_state, lm_loss_fn, make_train_step
from moejax.train import mesh as mesh_lib
from tests.toy_models import TinyMoELM, ToySource, tree_max_diff

assert jax.device_count() == 8, jax.devices()
cfg = TrainConfig(steps=4, batch_size=16, lr=1e-2, warmup_steps=0, schedule="constant",
                  grad_accum=2)
tx = make_optimizer(cfg)
src = ToySource(batch_size=16)

def run(mesh):
    graphdef, state = init_train_state(TinyMoELM(nnx.Rngs(0), noise=0.2), tx, 0)
    step = make_train_step(graphdef, lm_loss_fn, tx, cfg, schedule=make_schedule(cfg), mesh=mesh)
    if mesh is not None:
        state = mesh_lib.shard_tree(state, mesh)
    losses = []
    for pos in range(2):
        b = src.batch(pos) if mesh is None else mesh_lib.shard_batch(src.batch(pos), mesh)
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses

ref_state, ref_losses = run(None)
for shape in [(4, 2), (2, 4)]:
    mesh = mesh_lib.make_mesh(*shape)
    assert dict(mesh.shape) == {"data": shape[0], "expert": shape[1]}
    state, losses = run(mesh)
    w = state.params["experts"]["w_up"][...]
    assert w.sharding.spec == P("expert"), w.sharding
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape[0] == 4 // shape[1]
    mu = state.opt_state[1][0].mu["experts"]["w_up"][...]
    assert mu.sharding.spec == P("expert"), mu.sharding
    assert state.params["head"]["kernel"][...].sharding.spec == P()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    diff = tree_max_diff(state.params, ref_state.params)
    assert diff < 1e-5, (shape, diff)
    assert tree_max_diff(state.opt_state, ref_state.opt_state) < 1e-5
    print("mesh", shape, "losses", losses, "max param diff", diff)
# a mesh of explicit axes (jax.make_mesh's default) runs as the same mesh with automatic axes,
# in the step and in the loop; a mesh of other axis names is refused naming them
from moejax.train import train
explicit = jax.make_mesh((2, 4), ("data", "expert"))
assert explicit.axis_types == (jax.sharding.AxisType.Explicit,) * 2
state, losses = run(explicit)
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
assert tree_max_diff(state.params, ref_state.params) < 1e-5
loop = {name: train(TinyMoELM(nnx.Rngs(0), noise=0.2), src, cfg, mesh=m, progress=False)
        for name, m in (("auto", mesh_lib.make_mesh(2, 4)), ("explicit", explicit))}
assert len(loop["explicit"]) == cfg.steps
np.testing.assert_allclose([r["loss"] for r in loop["explicit"]],
                           [r["loss"] for r in loop["auto"]], rtol=1e-6)
try:
    train(TinyMoELM(nnx.Rngs(0)), src, cfg, mesh=jax.make_mesh((8,), ("batch",)),
          progress=False)
except ValueError as e:
    assert "mesh axes ('batch',): the training loop shards over axes named" in str(e), e
else:
    raise AssertionError("a mesh without 'data' and 'expert' axes should be refused")
print("explicit mesh OK")
# -1 fills the remaining devices; impossible meshes fail with a clear message
assert dict(mesh_lib.make_mesh(-1, 2).shape) == {"data": 4, "expert": 2}
try:
    mesh_lib.make_mesh(3, 2)
except ValueError as e:
    assert "3x2" in str(e) and "8 are available" in str(e), e
else:
    raise AssertionError("3x2 mesh on 8 devices should fail")
print("OK")
"""


@pytest.mark.slow
def test_sharded_step_matches_single_device():
    out = run_on_devices(_SCRIPT)
    assert "mesh (4, 2)" in out and "mesh (2, 4)" in out, out[-2000:]
    assert "explicit mesh OK" in out, out[-2000:]


_STUDIES = r"""
import sys
sys.path.insert(0, ROOT)
import json, pathlib
import jax
from experiments import lm_demo
from experiments.blockffn import granularity as blockffn_granularity

assert jax.device_count() == 8, jax.devices()
out = pathlib.Path(OUT)
TRAIN = ["train.batch_size=16", "train.steps=4", "train.warmup_steps=0"]
runs = [
    ("lm_demo", lm_demo, ["model.d_model=32", "model.n_layers=1", "model.moe.d_expert=32",
                          "seq_len=32", "eval_batches=1", "train.mesh_expert=4",
                          "train.eval_every=2", *TRAIN]),
    ("blockffn_granularity", blockffn_granularity,
     ["model.n_layers=1", "n_experts=(4,8)", "ffn_width=64", "seq_len=32", "eval_batches=1",
      *TRAIN]),
]
for name, study, args in runs:
    study.STUDY.run_experiment(args, out=out / name)
    record = json.loads((out / name / "run.json").read_text())
    assert (out / name / "summary.md").is_file() and record["machine"], name
    print(name, "summary written")

# a batch that does not divide over the mesh, a mesh that does not fit: refused in one line
# (exit 2) before the run directory is written or anything compiles
import contextlib, io
from moejax.harness.experiment import main
for bad, words in ((["train.batch_size=6", "train.mesh_expert=4"], "multiple of 8"),
                   (["train.mesh_expert=3"], "not divisible by mesh_expert=3"),
                   (["train.mesh_expert=16"], "not divisible by mesh_expert=16")):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main("lm_demo", lm_demo.make_config, lm_demo.run, [f"out={out / 'bad'}", *bad])
    assert rc == 2 and words in err.getvalue(), (bad, err.getvalue())
    assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
    assert not (out / "bad").exists(), bad
print("refused OK")
print("OK")
"""


@pytest.mark.slow
def test_studies_run_to_their_summary_on_eight_devices(tmp_path):
    """Training on a (data x expert) mesh, then evaluating the sharded model: each study's
    evaluator compiles for the layout its model's arrays have. A batch or mesh that does not
    fit the devices is refused before anything is written."""
    out = run_on_devices(_STUDIES.replace("OUT", repr(str(tmp_path))))
    assert "lm_demo summary written" in out and "blockffn_granularity summary written" in out
    assert "refused OK" in out
