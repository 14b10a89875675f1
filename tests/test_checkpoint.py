"""Checkpoints: bitwise-exact resume, incomplete/interrupted saves never count as latest,
mismatch errors naming the leaves, and the documented plain-orbax snippet."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.train.checkpoint as ck_mod
import moejax.train.checkpoint_format as ck_format
from moejax.config import from_json
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.nn.ders_moe import DeRSIndex
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_layer import MoELayer
from moejax.ops.losses import cross_entropy
from moejax.train import ForeignCheckpointError, restore_params, train
from moejax.train.checkpoint import Checkpointer, CheckpointMismatchError, latest_step
from moejax.train.distributed import cpu_devices_env
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import init_train_state, lm_loss_fn, make_train_step
from moejax.upcycle import UpcycleConfig, upcycle_model
from tests.toy_models import TinyMoELM, ToySource, logits_of, tree_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup_steps=2, schedule="cosine", seed=3)


def _fresh(cfg=CFG, **model_kw):
    """A brand-new model, optimizer, initial state and jitted step."""
    tx = make_optimizer(cfg)
    graphdef, state = init_train_state(TinyMoELM(nnx.Rngs(0), noise=0.3, **model_kw), tx, cfg.seed)
    return state, make_train_step(graphdef, lm_loss_fn, tx, cfg, schedule=make_schedule(cfg))


def _run(state, step, src, start, n):
    losses = []
    for pos in range(start, start + n):
        state, m = step(state, src.batch(pos))
        losses.append(np.asarray(m["loss"]))
    return state, losses


def _saved_run(tmp_path, steps=(2,)):
    state, step = _fresh()
    src = ToySource(batch_size=4)
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    done = 0
    for s in steps:
        state, _ = _run(state, step, src, done, s - done)
        done = s
        ckpt.save(state, data_position=done, config=CFG)
    ckpt.close()
    return state


def test_resume_reproduces_uninterrupted_run_bitwise(tmp_path):
    src = ToySource(batch_size=4)
    state, step = _fresh()
    straight, losses_a = _run(state, step, src, 0, 6)

    state, step = _fresh()
    state, losses_b = _run(state, step, src, 0, 3)
    ckpt = Checkpointer(tmp_path / "ck", async_save=True)
    ckpt.save(state, data_position=3, config=CFG)
    ckpt.close()
    del state, step

    template, step = _fresh()  # fresh model/optimizer/state
    ckpt = Checkpointer(tmp_path / "ck")
    restored, meta = ckpt.restore(template)
    assert meta["data_position"] == 3 and meta["step"] == 3 and int(restored.step) == 3
    assert from_json(meta["config"]) == CFG
    assert restored.key.dtype == np.uint32
    resumed, losses_c = _run(restored, step, src, meta["data_position"], 3)
    assert all(np.array_equal(a, b) for a, b in zip(losses_a, losses_b + losses_c))
    assert tree_equal(resumed.params, straight.params)
    assert tree_equal(resumed.opt_state, straight.opt_state)
    assert np.array_equal(resumed.key, straight.key)
    assert jax.tree.structure(resumed) == jax.tree.structure(straight)


def test_incomplete_step_dirs_are_never_latest(tmp_path):
    _saved_run(tmp_path, steps=(2,))
    d = tmp_path / "ck"
    # orbax-style temporary dir of a newer step, and a half-copied step dir without commit
    shutil.copytree(d / "2", d / "5.orbax-checkpoint-tmp-1234567")
    (d / "5.orbax-checkpoint-tmp-1234567" / "commit_success.txt").unlink()
    shutil.copytree(d / "2", d / "7")
    (d / "7" / "commit_success.txt").unlink()
    assert latest_step(d) == 2
    ckpt = Checkpointer(d)
    assert ckpt.all_steps() == [2]
    template, _ = _fresh()
    restored, meta = ckpt.restore(template)
    assert int(restored.step) == 2 and meta["data_position"] == 2
    with pytest.raises(FileNotFoundError, match="complete steps: \\[2\\]"):
        ckpt.restore(template, step=7)


_INTERRUPTED = """
import os, sys
sys.path.insert(0, {root!r})
from orbax.checkpoint._src.path import atomicity
from tests.test_checkpoint import _fresh, _run, ToySource
from moejax.train.checkpoint import Checkpointer
state, step = _fresh()
src = ToySource(batch_size=4)
ckpt = Checkpointer({d!r}, async_save={async_save})
state, _ = _run(state, step, src, 0, 2)
ckpt.save(state, data_position=2)
ckpt.wait()
async def crash(self, *a, **k):  # the process dies right before the save is finalised
    os._exit(17)
atomicity.AtomicRenameTemporaryPath.finalize = crash
state, _ = _run(state, step, src, 2, 2)
ckpt.save(state, data_position=4)
ckpt.wait()
print("NOT INTERRUPTED")
"""


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True])
def test_interrupted_save_is_not_latest(tmp_path, async_save):
    d = str(tmp_path / "ck")
    code = _INTERRUPTED.format(root=ROOT, d=d, async_save=async_save)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 17, r.stdout + r.stderr
    leftovers = [n for n in os.listdir(d) if n.startswith("4")]
    assert leftovers and all("tmp" in n for n in leftovers), os.listdir(d)
    assert latest_step(d) == 2
    template, _ = _fresh()
    restored, meta = Checkpointer(d).restore(template)
    assert int(restored.step) == 2 and meta["data_position"] == 2


def test_mismatching_model_fails_naming_leaves(tmp_path):
    _saved_run(tmp_path, steps=(1,))
    template, _ = _fresh(d=10)  # different width
    with pytest.raises(CheckpointMismatchError) as e:
        Checkpointer(tmp_path / "ck").restore(template)
    msg = str(e.value)
    assert "params/embed/embedding: saved (16, 8) float32 vs expected (16, 10) float32" in msg
    assert "opt_state/" in msg and "config" in msg
    template, _ = _fresh(n_experts=2)
    with pytest.raises(CheckpointMismatchError, match=r"params/experts/w_up: saved \(4, 8, 12\)"):
        Checkpointer(tmp_path / "ck").restore(template)
    no_bias = TinyMoELM(nnx.Rngs(0), noise=0.3)  # a leaf the checkpoint has, the model not
    no_bias.router = nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(0))
    template = init_train_state(no_bias, make_optimizer(CFG), CFG.seed)[1]
    with pytest.raises(CheckpointMismatchError,
                       match=r"params/router/bias: in checkpoint \(\(4,\) float32\) but not"):
        Checkpointer(tmp_path / "ck").restore(template)
    template, _ = _fresh()  # the same shapes in another dtype: refused, not cast silently
    template = template._replace(params=jax.tree.map(lambda x: x.astype("bfloat16"),
                                                     template.params))
    with pytest.raises(CheckpointMismatchError,
                       match=r"params/embed/embedding: saved \(16, 8\) float32 vs expected "
                             r"\(16, 8\) bfloat16"):
        Checkpointer(tmp_path / "ck").restore(template)


def test_plain_orbax_snippet_from_docstring(tmp_path):
    state = _saved_run(tmp_path, steps=(1, 2))
    doc = ck_format.__doc__
    start = doc.index("    import os\n")
    end = doc.index("\n\n", start)
    snippet = textwrap.dedent(doc[start:end]).replace("RUN_DIR/checkpoints", str(tmp_path / "ck"))
    assert "moejax" not in snippet.replace("moejax.train.checkpoint.latest_step", "")
    out = tmp_path / "out.npz"
    code = snippet + textwrap.dedent(f"""
        import json, numpy as np
        flat = {{"/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}}
        flat["__key__"] = np.asarray(jax.random.key_data(key))
        np.savez({str(out)!r}, **flat)
        print(json.dumps({{"step": int(step), "position": position}}))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info == {"step": 2, "position": 2}
    got = dict(np.load(out))
    want = nnx.to_pure_dict(state.params)
    flat_want = {
        "/".join(str(k.key) for k in p): np.asarray(v)
        for p, v in jax.tree_util.tree_flatten_with_path(want)[0]
    }
    assert set(flat_want) <= set(got)
    for k, v in flat_want.items():
        np.testing.assert_array_equal(got[k], v)
    np.testing.assert_array_equal(got["__key__"], np.asarray(state.key))


def _snippet(ckdir) -> str:
    doc = ck_format.__doc__
    start = doc.index("    import os\n")
    end = doc.index("\n\n", start)
    return textwrap.dedent(doc[start:end]).replace("RUN_DIR/checkpoints", str(ckdir))


@pytest.mark.slow
def test_plain_orbax_restores_a_checkpoint_of_8_devices_on_1_and_4(tmp_path):
    """The docstring's plain-orbax snippet, in processes that never import moejax, reads a
    checkpoint saved on a 4 x 2 mesh of 8 devices on 1 and on 4 devices, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "ckpt_saver.py"),
                        str(run)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(cpu_devices_env(8, env), PYTHONPATH=ROOT))
    assert r.returncode == 0 and "devices 8" in r.stdout, r.stderr[-2000:]
    code = _snippet(run / "checkpoints") + textwrap.dedent(f"""
        import numpy as np
        flat = {{"/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
                for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}}
        saved = np.load({str(run / "saved.npz")!r})
        assert set(saved) == set(flat), set(saved) ^ set(flat)
        for k in saved:
            np.testing.assert_array_equal(saved[k], flat[k])
        print("restored on", jax.device_count(), "at", position)
    """)
    assert "moejax" not in code

    def restore(n):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, cwd=str(tmp_path), env=cpu_devices_env(n, env))

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(restore, (1, 4)))
    for n, r in zip((1, 4), results):
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"restored on {n} at 2" in r.stdout


def test_init_from_starts_a_run_from_another_runs_parameters(tmp_path):
    """restore_params / init_from: the newest verified step's parameters alone, into a new
    model (in place) or a params pytree; other shapes are refused naming the leaves."""
    import optax

    state = _saved_run(tmp_path / "a", steps=(2,))
    want = nnx.to_pure_dict(state.params)
    model = TinyMoELM(nnx.Rngs(5), noise=0.3)
    assert not tree_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), want)
    restore_params(tmp_path / "a" / "ck", model)
    assert tree_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), want)
    # a run started from it with a zero learning rate ends where it started
    fresh = TinyMoELM(nnx.Rngs(6), noise=0.3)
    train(fresh, ToySource(batch_size=4), CFG.replace(steps=1, warmup_steps=0), tx=optax.sgd(0.0),
          init_from=tmp_path / "a" / "ck", progress=False)
    assert tree_equal(nnx.to_pure_dict(nnx.state(fresh, nnx.Param)), want)
    with pytest.raises(CheckpointMismatchError, match="saved"):
        restore_params(tmp_path / "a" / "ck", TinyMoELM(nnx.Rngs(0), noise=0.3, d=10))
    with pytest.raises(FileNotFoundError, match="no complete moejax checkpoint"):
        restore_params(tmp_path / "nothing", TinyMoELM(nnx.Rngs(0), noise=0.3))


def test_restore_params_brings_the_buffers_that_give_the_parameters_their_meaning(tmp_path):
    """A DeRS-SM model keeps its SM indices and frozen shared weights outside nnx.Param; a
    model upcycled with another key has other indices, so its parameters alone, restored
    from a run, computed another function (silently). Restored with them, it computes the
    trained model's, and an rng stream's state comes back typed."""
    dense = DecoderLM(dense_decoder_config(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
                                           d_hidden=32), rngs=nnx.Rngs(0))
    rule = UpcycleConfig(blocks="all", expert_form="sm", sm_rate=0.9, freeze_shared=True)
    trained = upcycle_model(dense, rule, jax.random.key(0))

    def loss_fn(model, batch, key, train=True):
        logits, aux = model(batch["inputs"], train=train, key=key)
        return cross_entropy(logits, batch["targets"]) + aux["aux_loss"]

    def source(pos):
        t = np.random.default_rng(pos).integers(0, 32, (4, 9)).astype(np.int32)
        return {"inputs": t[:, :-1], "targets": t[:, 1:]}

    train(trained, source, CFG.replace(steps=2, warmup_steps=0, ckpt_every=2), loss_fn=loss_fn,
          run_dir=tmp_path / "sm", progress=False)
    other = upcycle_model(dense, rule, jax.random.key(5))
    x = jnp.asarray(source(9)["inputs"])
    assert not np.allclose(np.asarray(logits_of(other, x)), np.asarray(logits_of(trained, x)))
    restore_params(tmp_path / "sm", other)
    np.testing.assert_array_equal(np.asarray(logits_of(other, x)),
                                  np.asarray(logits_of(trained, x)))
    assert tree_equal(nnx.to_pure_dict(nnx.state(other, DeRSIndex)),
                      nnx.to_pure_dict(nnx.state(trained, DeRSIndex)))

    class Noisy(nnx.Module):  # an rng stream in the model's state
        def __init__(self, rngs):
            self.moe = MoELayer(MoEConfig(n_experts=4, top_k=2, d_expert=8, router="noisy"), 8,
                                rngs=rngs)

        def __call__(self, x, train=True, key=None):
            return self.moe(x), {"aux_loss": jnp.zeros(())}

    def noisy_loss(model, batch, key, train=True):
        return jnp.mean(model(batch["x"])[0] ** 2)

    noisy = Noisy(nnx.Rngs(1))
    feats = lambda pos: {"x": np.ones((4, 3, 8), np.float32) * (pos + 1)}  # noqa: E731
    train(noisy, feats, CFG.replace(steps=2, warmup_steps=0, ckpt_every=2),
          loss_fn=noisy_loss, run_dir=tmp_path / "noisy", progress=False)
    fresh = restore_params(tmp_path / "noisy", Noisy(nnx.Rngs(7)))
    assert int(fresh.moe.rngs.count[...]) == int(noisy.moe.rngs.count[...]) == 2
    assert jnp.issubdtype(fresh.moe.rngs.key[...].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(fresh.moe.rngs.key[...])),
                                  np.asarray(jax.random.key_data(noisy.moe.rngs.key[...])))


def test_a_checkpoint_moejax_did_not_write_is_refused_and_left_alone(tmp_path):
    """A plain orbax save in a run directory's checkpoints/ is named and refused in one line
    by train(); the step is not moved to .corrupt/ nor touched."""
    import orbax.checkpoint as ocp

    ckdir = tmp_path / "run" / "checkpoints"
    with ocp.CheckpointManager(ckdir, item_handlers={
            "state": ocp.StandardCheckpointHandler()}) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(
            {"w": np.ones((2, 2), np.float32)})))
        mngr.wait_until_finished()
    before = sorted(str(p.relative_to(ckdir)) for p in ckdir.rglob("*"))
    with pytest.raises(ForeignCheckpointError, match="moejax did not write") as e:
        train(TinyMoELM(nnx.Rngs(0), noise=0.3), ToySource(batch_size=4),
              CFG.replace(steps=1, warmup_steps=0), run_dir=tmp_path / "run", progress=False)
    assert "\n" not in str(e.value)
    assert sorted(str(p.relative_to(ckdir)) for p in ckdir.rglob("*")) == before
    assert not (ckdir / ".corrupt").exists()


def test_a_full_disk_ends_in_one_line_and_leaves_no_partial_step(tmp_path, monkeypatch):
    """tensorstore reports ENOSPC as a ValueError through orbax: it becomes one
    CheckpointWriteError naming the directory and the space a step needs, and the partial
    step directory is removed; earlier complete steps stay."""
    import errno

    state, step = _fresh()
    ckpt = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    ckpt.save(state, data_position=0, config=CFG)
    state, _ = _run(state, step, ToySource(batch_size=4), 0, 1)

    def full(step_no, **kw):
        os.makedirs(tmp_path / "ck" / f"{step_no}.orbax-checkpoint-tmp" / "state")
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database: '
                         "Failed to write 1064651 bytes to file 6: No space left on device "
                         "[os_error_code='28']")

    monkeypatch.setattr(ckpt._mngr, "save", full)
    with pytest.raises(ck_mod.CheckpointWriteError) as e:
        ckpt.save(state, data_position=1, config=CFG)
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and "\n" not in msg
    assert f"disk full: a checkpoint of step 1 did not fit under {tmp_path / 'ck'}" in msg
    assert "MB" in msg and "earlier complete steps are intact" in msg
    assert sorted(os.listdir(tmp_path / "ck")) == ["0"]  # the partial step is gone
    monkeypatch.undo()
    ckpt.close()
    assert latest_step(str(tmp_path / "ck")) == 0
