"""Tiny substrate recipes for tests (no tests here): the ``tiny_recipes`` fixture in
``conftest.py`` swaps them into the substrate registry so that studies and the registry tests
build their starting points in seconds, in a temporary cache; and :data:`TINY_LM`, the
overrides that shrink a study's MoE LM to seconds."""

from __future__ import annotations

import dataclasses

from moejax.substrates import registry
from moejax.substrates.classify import ViTSubstrateConfig
from moejax.substrates.lm import LMSubstrateConfig
from moejax.train.hparams import TrainConfig

# a study's MoE LM (lm_demo, bench_dispatch) at test size, as command-line overrides
TINY_LM = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.moe.n_experts=4",
    "model.moe.d_expert=32",
    "model.d_hidden=64",
]


def tiny_train(steps: int = 4) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup_steps=1, ckpt_every=2,
                       log_every=1, eval_every=0)


def tiny_lm(name: str, preset: str) -> LMSubstrateConfig:
    code = name == "dense_lm_code"
    return LMSubstrateConfig(corpus="stdlib_code" if code else "prose/pydoc", d_model=32,
                             n_layers=2, n_heads=2, n_kv_heads=1, d_hidden=64, seq_len=32,
                             max_seq_len=64, eval_batches=2,
                             init_from="dense_lm_prose" if code else "", init_preset=preset,
                             train=tiny_train(4 if not code else 2))


def tiny_registry() -> dict:
    reg = dict(registry.SUBSTRATES)
    for n in ("dense_lm_prose", "dense_lm_code", "dense_lm_chat"):
        reg[n] = dataclasses.replace(reg[n], make_config=lambda p, n=n: tiny_lm(n, p))
    reg["vit_mnist5k"] = dataclasses.replace(
        reg["vit_mnist5k"], make_config=lambda p: ViTSubstrateConfig(
            d_model=16, n_layers=1, n_heads=2, d_hidden=32, train=tiny_train(3)))
    return reg
