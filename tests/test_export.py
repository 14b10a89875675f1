"""Lowering for accelerators, proven on a CPU with ``jax.export``: the grouped-matmul kernels
(forward, dX, dW) and the chunk-union kernels (forward and backward, plain and gated; f32 and
bf16; the full presets' shapes and wide ones: D 2048, F 1408, K 768, a 5-token tile), a whole
MoE LM train step with the default dispatch, a BlockFFN LM train step on the ``"auto"`` path
and the speculative decode loop with chunk-sparse verification lower for ``cuda`` (Triton) and
``tpu`` (Mosaic), and each lowered module holds that platform's kernel custom calls, not an
interpret-mode loop and not the host callback. The same jitted steps lowered for the CPU hold
the host callback (MoE) or no kernel at all (BlockFFN: the jnp chunk-union loop)."""

import dataclasses
import re

import jax
import jax.export as je
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from moejax.kernels.chunk_union.pallas import chunk_union_pallas
from moejax.kernels.grouped.pallas_gmm import gmm
from moejax.kernels.targets import lowering_target
from moejax.kernels.tiling import on_target
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.nn.speculative import chunk_sparse_target, speculative_generate
from moejax.train.hparams import TrainConfig
from moejax.train.step import init_state, lm_loss_fn, make_train_step

TRITON = "__gpu$xla.gpu.triton"
KERNEL = {"cuda": TRITON, "tpu": "tpu_custom_call"}
CHECKS = [je.DisabledSafetyCheck.custom_call(TRITON)]


def _export(fn, platform: str, *args):
    """``fn`` exported for ``platform``, lowered for its named target device (an H100, a
    TPU v5p): no accelerator is attached here."""
    export = je.export(fn, platforms=(platform,), disabled_checks=CHECKS)
    if platform == "cpu":
        return export(*args)
    with lowering_target(platform):
        return export(*args)


def _loops(exported) -> int:
    """``while`` loops of the module outside ``chlo.scan`` decompositions (a cumsum's
    fallback, which XLA's GPU compiler replaces with one CUB kernel)."""
    text = exported if isinstance(exported, str) else exported.mlir_module()
    funcs = re.split(r"\n\s*func\.func ", text)
    return sum(f.count("stablehlo.while") for f in funcs
               if not re.match(r"private @chlo\.scan\.impl", f))


FLASH = re.compile(r"pallas_flash_attention|splash_m")  # tokamax's attention kernels


def _custom_calls(exported, *, attention: bool = False) -> dict[str, int]:
    """Custom calls by target; the flash attention's (moejax.kernels.flash_attention) only with
    ``attention``: these tests count the FFN's kernels."""
    text = exported if isinstance(exported, str) else exported.mlir_module()
    calls = [m.group(1) for line in text.splitlines()
             for m in re.finditer(r"custom_call @([\w$.]+)", line)
             if attention or not FLASH.search(line)]
    return {c: calls.count(c) for c in set(calls)}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("m,k,n,g,dtype", [
    (4096, 256, 704, 8, jnp.float32),     # bench_kernels' gmm shape
    (2000, 768, 1408, 8, jnp.bfloat16),   # M, K and N off powers of two
    (512, 2048, 1408, 16, jnp.float32),   # D 2048
    (512, 2048, 1408, 16, jnp.bfloat16),
])
def test_gmm_forward_and_backward_lower_to_the_platform_kernel(platform, m, k, n, g, dtype):
    def step(x, w, gs):
        loss = lambda x, w: jnp.sum(gmm(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(x, w)

    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    exported = _export(jax.jit(step), platform, *args)
    calls = _custom_calls(exported)
    assert calls.get(KERNEL[platform]) == 3, calls  # forward, dX and dW kernels
    assert not any("callback" in c for c in calls), calls


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("n,d,e,f,tile,dtype,activation", [
    (4096, 256, 40, 64, 32, jnp.float32, "swish"),     # BlockFFN studies' full preset
    (256, 2048, 8, 1408, 5, jnp.bfloat16, "swiglu"),   # D 2048, F 1408, 5-token tiles
    (256, 768, 8, 1408, 5, jnp.float32, "gelu"),       # K 768
])
def test_chunk_union_forward_and_backward_lower_to_the_platform_kernel(platform, n, d, e, f,
                                                                      tile, dtype, activation):
    gated = activation == "swiglu"

    def step(x, a, wu, wd, wg):
        def loss(x, a, wu, wd, wg):
            y, _ = chunk_union_pallas(x, a, a > 0, wu, wd, wg, activation=activation,
                                      tile=tile, max_union=e)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, (0, 1, 2, 3, 4) if gated else (0, 1, 2, 3))(
            x, a, wu, wd, wg)

    S = jax.ShapeDtypeStruct
    args = (S((n, d), dtype), S((n, e), jnp.float32), S((e, d, f), dtype), S((e, f, d), dtype),
            S((e, d, f), dtype) if gated else None)
    exported = _export(jax.jit(step), platform, *args)
    calls = _custom_calls(exported)
    # forward: up (+ gate) and down; backward: dh, dx (x2 gated), dW_up, dW_down (+ dW_gate);
    # bf16 on the H100: the Mosaic GPU pair kernels, Triton's only for float32
    kernel = KERNEL[platform]
    if platform == "cuda" and dtype == jnp.bfloat16:
        kernel = "mosaic_gpu_v2"
        assert TRITON not in calls, calls
    assert calls.get(kernel) == (9 if gated else 6), calls
    assert not any("callback" in c for c in calls), calls


def _train_step(cfg: DecoderConfig):
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tcfg = TrainConfig(steps=10, batch_size=4)
    state = init_state(params, rest, optax.adamw(1e-3), 0)
    step = make_train_step(graphdef, lm_loss_fn, optax.adamw(1e-3), tcfg)
    tokens = jax.ShapeDtypeStruct((4, 32), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens,
             "mask": jax.ShapeDtypeStruct((4, 32), jnp.float32)}
    return step, state, batch


def _lm_step():
    cfg = MoELMConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                      moe=MoEConfig(n_experts=8, top_k=2, d_expert=128))  # dispatch="auto"
    return _train_step(cfg.decoder_config())


def _blockffn_decoder(path: str = "auto", layers: int = 2, d_model: int = 64,
                      d_expert: int = 32) -> DecoderConfig:
    slot = BlockFFNConfig(n_experts=8, d_expert=d_expert, path=path, union_chunk=8)
    return DecoderConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4,
                         ffn_slots=(slot,) * layers, max_seq_len=64)


@pytest.mark.parametrize("platform", ["cuda", "tpu", "cpu"])
def test_blockffn_lm_train_step_lowers_with_the_chunk_union_kernels(platform):
    step, state, batch = _train_step(_blockffn_decoder())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    exported = _export(step, platform, abstract, batch)
    calls = _custom_calls(exported)
    if platform == "cpu":  # the jnp chunk-union loop: no kernel, no callback
        assert TRITON not in calls and "tpu_custom_call" not in calls, calls
        return
    assert calls.get(KERNEL[platform], 0) == 2 * 6, calls  # 2 layers x (2 forward + 4 backward)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_speculative_decode_loop_lowers_with_chunk_sparse_verification(platform):
    target = DecoderLM(_blockffn_decoder(path="dense"), rngs=nnx.Rngs(0))
    draft = DecoderLM(DecoderConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2,
                                    ffn_slots=(DenseFFNConfig(d_hidden=64, activation="swiglu"),),
                                    max_seq_len=64),
                      rngs=nnx.Rngs(1))
    sparse = chunk_sparse_target(target, 4)  # verification tiles of n + 1 = 5 tokens

    def decode(prompt_BT):
        return speculative_generate(sparse, draft, prompt_BT, 16, draft_len=4).tokens_BS

    prompt = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    calls = _custom_calls(_export(jax.jit(decode), platform, prompt))
    # each target layer's forward (up and down) in the verification pass and the prefill
    assert calls.get(KERNEL[platform], 0) >= 2 * 2, calls
    assert not any("callback" in c for c in calls), calls


@pytest.mark.parametrize("platform,dtype", [("tpu", "float32"), ("cuda", "float32"),
                                            ("cuda", "bfloat16")])
def test_batch_one_verification_takes_the_decode_kernels(platform, dtype):
    """At batch 1 each verified block is one exact chunk: on TPU it runs the two decode
    launches (the union, then the experts over union slots); on a Hopper GPU a bf16 target
    runs the Mosaic GPU decode kernel, once per layer; a float32 one verifies by the dense
    product, and only its prefill (8 tokens, past the 5-token tile) runs the pair kernels. The
    rounds are the program's one loop (a round's draft passes are unrolled)."""
    target_cfg = dataclasses.replace(_blockffn_decoder(path="dense", d_model=128, d_expert=64),
                                     dtype=dtype)
    target = DecoderLM(target_cfg, rngs=nnx.Rngs(0))
    draft = DecoderLM(DecoderConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2,
                                    ffn_slots=(DenseFFNConfig(d_hidden=64, activation="swiglu"),),
                                    max_seq_len=64),
                      rngs=nnx.Rngs(1))
    sparse = chunk_sparse_target(target, 4)

    def decode(prompt_BT):
        return speculative_generate(sparse, draft, prompt_BT, 16, draft_len=4).tokens_BS

    exported = _export(jax.jit(decode), platform, jax.ShapeDtypeStruct((1, 8), jnp.int32))
    kernels = set(re.findall(r'kernel_name = "([^"]+)"', exported.mlir_module()))
    calls = _custom_calls(exported)
    assert _loops(exported) == 1  # the rounds; each round's draft passes are unrolled
    if platform == "tpu":
        assert {"_union_kernel", "_experts_kernel"} <= kernels, kernels
    elif dtype == "bfloat16":
        assert calls.get("mosaic_gpu_v2", 0) >= target_cfg.n_layers, calls
    else:
        assert not kernels & {"_union_kernel", "_experts_kernel"}, kernels
        # the prefill's up and down pair products (the layers share one loop body)
        assert "mosaic_gpu_v2" not in calls and calls.get(TRITON, 0) == 2, calls


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
    exported = _export(step, platform, abstract, batch)
    calls = _custom_calls(exported)
    assert calls.get(KERNEL[platform], 0) >= 2 * 2 * 3, calls  # 2 MoE layers x up/down x 3
    assert not any("callback" in c for c in calls), calls
    # the grouped products' metadata is array ops: no loop of small sequential kernels
    assert _loops(exported) == 0


def test_a_program_traces_the_kernel_of_its_target_platform_alone():
    """``on_target`` traces one branch: the CPU's here, the named accelerator's under
    ``lowering_target``, the default where a platform has none. A program built for the CPU
    refuses to lower for ``cuda`` instead of running another platform's kernel there."""
    traced = []

    def branch(name):
        def run(x):
            traced.append(name)
            return x + len(name)
        return run

    def fn(x):
        return on_target(x, cpu=branch("cpu"), cuda=branch("cuda"), default=branch("other"))

    jitted = jax.jit(fn)
    assert float(jitted(1.0)) == 4.0 and traced == ["cpu"]
    with pytest.raises(NotImplementedError, match=r"platform_index.*cuda"):
        je.export(jitted, platforms=("cuda",))(1.0)
    for platform, name in (("cuda", "cuda"), ("tpu", "other")):
        traced.clear()
        with lowering_target(platform):
            je.export(jax.jit(fn), platforms=(platform,))(1.0)
        assert traced == [name], (platform, traced)
    with pytest.raises(ValueError, match="no kernel for platform 'cpu'; there are kernels "
                                         "for cuda, tpu"):
        on_target(1.0, cuda=branch("cuda"), tpu=branch("tpu"))


@pytest.mark.parametrize("model", ["blockffn", "moe"])
def test_a_step_built_for_the_cpu_traces_no_accelerator_kernel(model):
    """The BlockFFN step traces neither the Triton nor the Mosaic pair kernels on the CPU
    (only the jnp chunk-union loop), and the MoE step not the accelerators' grouped
    matmul (only the host kernel): tracing them was a large share of a CPU run's time."""
    step, state, batch = _train_step(_blockffn_decoder()) if model == "blockffn" else _lm_step()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    text = str(jax.make_jaxpr(step)(abstract, batch))
    assert "pallas_call" not in text and "ragged_dot" not in text
    with lowering_target("cuda"):  # the same step built for a GPU does trace its kernels
        text = str(jax.make_jaxpr(step)(abstract, batch))
    assert "pallas_call" in text or "ragged_dot" in text
