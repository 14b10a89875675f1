"""A subprocess of tests/test_checkpoint.py (started with the environment of
``cpu_devices_env(8)``): train a tiny MoE LM two steps on an 4 x 2 mesh of 8 simulated devices,
checkpoint it into ``argv[1]`` and save its parameters beside it."""

import os
import sys

import jax
import numpy as np
from flax import nnx

from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern
from moejax.train import TrainConfig, train


def main(out: str) -> None:
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=16)
    cfg = DecoderConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2,
                        max_seq_len=16, ffn_slots=layer_pattern(
                            2, DenseFFNConfig(d_hidden=32, activation="swiglu"), moe, every=2))
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)

    def source(i):
        t = rng.integers(0, 64, (8, 9)).astype(np.int32)
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "mask": np.ones((8, 8), np.float32)}

    train(model, source, TrainConfig(steps=2, batch_size=8, ckpt_every=2, mesh_data=4,
                                     mesh_expert=2, warmup_steps=0), run_dir=out,
          progress=False)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    np.savez(os.path.join(out, "saved.npz"), **{
        "/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
        for p, v in jax.tree_util.tree_flatten_with_path(params)[0]})
    print("devices", jax.device_count())


if __name__ == "__main__":
    main(sys.argv[1])
