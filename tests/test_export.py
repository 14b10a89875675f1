"""Lowering for accelerators, proven on a CPU with ``jax.export``: the grouped-matmul kernels
(forward, dX, dW; f32 and bf16; the full presets' shapes and wide ones) and a whole MoE LM
train step with the default dispatch lower for ``cuda`` (Triton) and ``tpu`` (Mosaic), and
each lowered module holds that platform's kernel custom calls, not an interpret-mode loop and
not the host callback. The same jitted step lowered for the CPU holds the host callback."""

import re

import jax
import jax.export as je
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from moejax.kernels.gmm import gmm
from moejax.nn.decoder import DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.train.hparams import TrainConfig
from moejax.train.step import init_state, lm_loss_fn, make_train_step

TRITON = "__gpu$xla.gpu.triton"
KERNEL = {"cuda": TRITON, "tpu": "tpu_custom_call"}
CHECKS = [je.DisabledSafetyCheck.custom_call(TRITON)]


def _custom_calls(exported) -> dict[str, int]:
    text = exported if isinstance(exported, str) else exported.mlir_module()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    return {c: calls.count(c) for c in set(calls)}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("m,k,n,g,dtype", [
    (4096, 256, 704, 8, jnp.float32),     # bench_kernels' gmm shape
    (2048, 768, 1408, 8, jnp.bfloat16),   # K and N off powers of two
    (512, 2048, 1408, 16, jnp.float32),   # D 2048
    (512, 2048, 1408, 16, jnp.bfloat16),
])
def test_gmm_forward_and_backward_lower_to_the_platform_kernel(platform, m, k, n, g, dtype):
    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(gmm(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    exported = je.export(jax.jit(step), platforms=(platform,), disabled_checks=CHECKS)(*args)
    calls = _custom_calls(exported)
    assert calls.get(KERNEL[platform]) == 3, calls  # forward, dX and dW kernels
    assert not any("callback" in c for c in calls), calls


def _lm_step():
    cfg = MoELMConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                      moe=MoEConfig(n_experts=8, top_k=2, d_expert=128))  # dispatch="auto"
    model = DecoderLM(cfg.decoder_config(), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tcfg = TrainConfig(steps=10, batch_size=4)
    state = init_state(params, rest, optax.adamw(1e-3), 0)
    step = make_train_step(graphdef, lm_loss_fn, optax.adamw(1e-3), tcfg)
    tokens = jax.ShapeDtypeStruct((4, 32), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens,
             "mask": jax.ShapeDtypeStruct((4, 32), jnp.float32)}
    return step, state, batch


@pytest.mark.parametrize("platform", ["cuda", "tpu", "cpu"])
def test_moe_lm_train_step_lowers_with_the_platforms_moe_kernel(platform):
    step, state, batch = _lm_step()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    if platform == "cpu":  # host callbacks do not serialise: lower it here instead
        calls = _custom_calls(step.lower(abstract, batch).as_text())
        # the host expert kernel: one callback forward, one backward, per MoE layer
        assert sum(n for c, n in calls.items() if "callback" in c) >= 4, calls
        assert "tpu_custom_call" not in calls and TRITON not in calls, calls
        return
    exported = je.export(step, platforms=(platform,), disabled_checks=CHECKS)(abstract, batch)
    calls = _custom_calls(exported)
    assert calls.get(KERNEL[platform], 0) >= 2 * 2 * 3, calls  # 2 MoE layers x up/down x 3
    assert not any("callback" in c for c in calls), calls
