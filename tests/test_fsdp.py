"""Fully sharded data parallelism (``TrainConfig.fsdp``) on 8 simulated CPU devices, in a
subprocess: on a (2, 4) mesh with expert parallelism an MoE LM's parameters and optimizer state
take 1/8 of the whole per device (checked on the placed arrays and in the compiled step's
argument bytes), and the losses equal the unsharded single-device run."""

from tests.devices import run_on_devices

_SCRIPT = r"""
import sys
sys.path.insert(0, ROOT)
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from moejax.nn.decoder import DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.train import mesh as mesh_lib
from moejax.train.hparams import TrainConfig
from moejax.train.step import init_state, lm_loss_fn, make_train_step

cfg = MoELMConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                  moe=MoEConfig(n_experts=8, top_k=2, d_expert=128))
tx = optax.adamw(3e-3)
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 8, 17)), jnp.int32)

def run(mesh, fsdp):
    tcfg = TrainConfig(steps=2, batch_size=8, fsdp=fsdp)
    graphdef, params, rest = nnx.split(DecoderLM(cfg.decoder_config(), rngs=nnx.Rngs(0)),
                                       nnx.Param, ...)
    state = init_state(params, rest, tx, 0)
    step = make_train_step(graphdef, lm_loss_fn, tx, tcfg, mesh=mesh)
    args_bytes = None
    if mesh is not None:
        state = mesh_lib.shard_tree(state, mesh, fsdp)
    losses = []
    for t in tokens:
        batch = {"inputs": t[:, :-1], "targets": t[:, 1:], "mask": jnp.ones((8, 16))}
        if mesh is not None:
            batch = mesh_lib.shard_batch(batch, mesh)
            if args_bytes is None:
                with jax.set_mesh(mesh):
                    compiled = step.jitted(state).lower(state, batch).compile()
                args_bytes = compiled.memory_analysis().argument_size_in_bytes
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    leaves = jax.tree.leaves(state)
    total = sum(x.nbytes for x in leaves)
    per_device = sum(max(s.data.nbytes for s in x.addressable_shards) for x in leaves)
    return losses, total, per_device, args_bytes

ref, total, _, _ = run(None, False)
for shape in [(2, 4)]:
    mesh = mesh_lib.make_mesh(*shape)
    losses, _, per_device, args_bytes = run(mesh, True)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
    print(shape, "state bytes: total", total, "per device", per_device, "compiled arguments",
          args_bytes)
    assert per_device <= 1.05 * total / 8, (per_device, total)
    assert args_bytes <= 1.05 * total / 8 + 4096, (args_bytes, total)
print("OK")
"""


def test_fsdp_shards_state_to_an_eighth_and_trains_like_one_device():
    run_on_devices(_SCRIPT)
