"""The lean decode step (moejax.nn.lean_decode): equal to the modules' decode in float32, and
lean in what it launches: the one-token decode of a 14-block decoder exported for ``cuda``
counts at most 8.6 products, reductions, scatters and custom calls per block (dense SwiGLU;
the BlockFFN decoder, on the chunk-union decode kernel, at most 8.3). The train steps export
with the flash kernel."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.bench.decode_timing as bench_decode
from moejax.bench.decode_timing import decode_timing
from moejax.capture import capture_steps
from moejax.kernels.targets import lowering_target
from moejax.nn import lean_ffn
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.lean_decode import (
    LeanBlockFFN,
    LeanDecoder,
    LeanDenseFFN,
    lean_decoder,
)
from moejax.nn.lean_ops import matvec, pieces
from moejax.nn.moe import MoEConfig
from moejax.train.aot import TRITON
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.xla_flags import COMMAND_BUFFERS, known_options
from tests.toy_models import ToySource

COUNTED = ("dot_general", "reduce", "scatter", "custom_call")
# per block, in the one-token decode of 14 blocks (d 256, 4 heads, 2 kv heads, bf16) lowered
# for cuda: q/k/v, o, gate+up and down products, the two RMSNorms' reductions and the flash
# kernel (7.2 measured); the BlockFFN decoder (the GPU's path: the chunk-union decode kernel)
# q/k/v, o and its router's product, the router's RMSNorm and the two kernels (8.2 measured)
BUDGET = {"dense": 8.6, "blockffn": 8.3}
SLOTS = {"dense": DenseFFNConfig(d_hidden=1024, activation="swiglu"),
         "blockffn": BlockFFNConfig(n_experts=16, d_expert=64, path="auto")}
KERNELS = {"dense": 1, "blockffn": 2}  # the flash kernel; BlockFFN's chunk-union kernel
PRODUCTS = {"dense": 4, "blockffn": 3}


def _model(slot, *, layers=2, d=32, **kw):
    cfg = DecoderConfig(vocab_size=64, d_model=d, n_layers=layers, n_heads=4, n_kv_heads=2,
                        ffn_slots=(slot,) * layers, max_seq_len=64, **kw)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    for i, block in enumerate(model.blocks):  # scales away from 1, so folding them shows
        for j, norm in enumerate((block.attn_norm, block.ffn_norm)):
            norm.scale[...] = (jax.random.uniform(jax.random.key(10 * i + j), (d,)) + 0.5
                               ).astype(norm.scale.dtype)
    return model


CASES = [
    ("swiglu", DenseFFNConfig(d_hidden=48, activation="swiglu"), {}),
    ("gelu, biases", DenseFFNConfig(d_hidden=48, activation="gelu", use_bias=True),
     dict(qkv_bias=True)),
    ("qk norm per head", DenseFFNConfig(d_hidden=48, activation="swiglu"),
     dict(qk_norm="head")),
    ("qk norm full, untied", DenseFFNConfig(d_hidden=48, activation="swiglu"),
     dict(qk_norm="full", tie_embeddings=False)),
    ("moe", MoEConfig(n_experts=4, top_k=2, d_expert=16), {}),
    ("blockffn", BlockFFNConfig(n_experts=8, d_expert=8), {}),
    ("blockffn gated, chunk union", BlockFFNConfig(n_experts=8, d_expert=8, path="auto",
                                                   activation="swiglu"), {}),
    ("blockffn, no router norm", BlockFFNConfig(n_experts=8, d_expert=8, rmsnorm=False,
                                                path="chunk_union"), {}),
    ("blockffn dense", BlockFFNConfig(n_experts=8, d_expert=8, path="dense"), {}),
    ("blockffn dense gated, no router norm", BlockFFNConfig(
        n_experts=8, d_expert=8, path="dense", activation="swiglu", rmsnorm=False), {}),
]
# the transposed weights ("nk"): every product the lean block makes (q/k/v with biases, o with
# its bias, gate+up and down, the router, BlockFFN's every-expert pair)
NK = ("gelu, biases", "blockffn gated, chunk union", "blockffn dense gated, no router norm")


@pytest.mark.parametrize("name,slot,kw,layout", [
    *((*c, "kn") for c in CASES), *((*c, "nk") for c in CASES if c[0] in NK)])
def test_the_lean_decode_equals_the_modules_decode(name, slot, kw, layout):
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))  # per shape one program, not one per op
    model = _model(slot, **kw)
    lean = lean_decoder(model, layout)
    assert isinstance(lean, LeanDecoder) and lean_decoder(lean) is lean
    assert all(b.attn.w_qkv.shape[0] == 32 for b in lean.blocks) == (layout == "kn")  # D
    lean_slot = {DenseFFNConfig: LeanDenseFFN, BlockFFNConfig: LeanBlockFFN}.get(type(slot))
    assert lean_slot is None or all(isinstance(b.ffn, lean_slot) for b in lean.blocks)
    toks = jax.random.randint(jax.random.key(3), (2, 9), 0, 64)
    want_c, got_c = model.init_cache(2, 16), lean.init_cache(2, 16)
    for part in (toks[:, :6], toks[:, 6:7], toks[:, 7:9]):  # prefill, one token, two
        want, want_c = decode(model, part, want_c)
        got, got_c = decode(lean, part, got_c)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_c), jax.tree.leaves(want_c)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="decodes only"):
        lean(toks)


def test_the_routers_weights_are_three_bfloat16_pieces_whose_sum_is_exact():
    """float32 router weights over five decades as bfloat16 pieces: their float32 sum is the
    weights bit for bit, and a bfloat16 input's scores accumulated in float32 over the pieces
    are the float32 router's (one piece alone, bfloat16's rounding, is 1e3 times further)."""
    scale = jnp.logspace(-3, 2, 16, dtype=jnp.float32)
    w_DE = jax.random.normal(jax.random.key(0), (256, 16)) * scale
    parts = pieces(w_DE, jnp.bfloat16)
    assert [p.dtype for p in parts] == [jnp.bfloat16] * 3
    np.testing.assert_array_equal(np.asarray(sum(p.astype(jnp.float32) for p in parts)),
                                  np.asarray(w_DE))
    assert pieces(w_DE, jnp.float32) == (w_DE,)
    x_1D = jax.random.normal(jax.random.key(1), (1, 256)).astype(jnp.bfloat16)
    exact = np.asarray(x_1D, np.float64) @ np.asarray(w_DE, np.float64)

    def err(ps):
        got = sum(matvec(x_1D, p, "kn", jnp.float32) for p in ps)
        return np.max(np.abs(np.asarray(got, np.float64) - exact) / np.abs(exact))
    assert err(parts) < 1e-5 and err(parts[:1]) > 1e3 * err(parts)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_a_bfloat16_router_in_the_experts_product_routes_as_its_own_product(layout,
                                                                             monkeypatch):
    """The BlockFFN dense path in bfloat16: the router's pieces sliced from the experts' input
    product and summed give the output of the float32 router's own product."""
    cfg = BlockFFNConfig(n_experts=8, d_expert=16, path="dense", activation="swiglu")
    ffn = _model(cfg, d=64, dtype="bfloat16", param_dtype="bfloat16").blocks[0]
    x_BTD = jax.random.normal(jax.random.key(2), (2, 3, 64)).astype(jnp.bfloat16)
    joined = LeanBlockFFN(ffn.ffn, ffn.ffn_norm, layout)
    monkeypatch.setattr(lean_ffn, "pieces", lambda w, dtype: ())
    apart = LeanBlockFFN(ffn.ffn, ffn.ffn_norm, layout)
    assert (joined.n_pieces, apart.n_pieces) == (3, 0) and not hasattr(joined, "w_router")
    got, want = joined.with_residual(x_BTD)[0], apart.with_residual(x_BTD)[0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=0, rtol=1e-2)
    assert np.mean(np.asarray(got) == np.asarray(want)) > 0.95


FUSED_CASES = {c[0]: c for c in CASES if c[0] in (
    "swiglu", "gelu, biases", "qk norm per head", "blockffn dense gated, no router norm",
    "blockffn gated, chunk union", "blockffn, no router norm")}
FUSED_CASES.update({c[0]: c for c in (  # experts of 16: the FFN kernel's smallest block
    ("blockffn dense 16", BlockFFNConfig(n_experts=8, d_expert=16, path="dense"), {}),
    ("blockffn dense 16 gated, no router norm", BlockFFNConfig(
        n_experts=4, d_expert=32, path="dense", activation="swiglu", rmsnorm=False), {}))})


@pytest.mark.parametrize("name,layout", [("swiglu", "kn"), ("gelu, biases", "nk"),
                                         ("qk norm per head", "kn"),
                                         ("blockffn dense gated, no router norm", "nk"),
                                         ("blockffn dense 16", "kn"),
                                         ("blockffn dense 16 gated, no router norm", "nk"),
                                         ("blockffn gated, chunk union", "nk"),
                                         ("blockffn, no router norm", "kn")])
def test_the_fused_one_token_step_decodes_as_the_lean_step(name, layout):
    """Every one-token step's attention input is the Pallas kernel (moejax.kernels.decode_qkv:
    compiled on a GPU, ``fused=True``; elsewhere ``fused="interpret"``, in the interpreter),
    the prefill and a two-token step XLA's; logits and caches equal the lean XLA step's in
    float32 (q/k norms: XLA's step throughout, equal to it bit for bit)."""
    _, slot, kw = FUSED_CASES[name]
    model = _model(slot, **kw)
    how = True if jax.default_backend() == "gpu" else "interpret"
    plain, fused = lean_decoder(model, layout), lean_decoder(model, layout, fused=how)
    assert all(b.attn.fused == how for b in fused.blocks)
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))
    toks = jax.random.randint(jax.random.key(4), (2, 10), 0, 64)
    want_c, got_c = plain.init_cache(2, 16), fused.init_cache(2, 16)
    for part in (toks[:, :5], toks[:, 5:6], toks[:, 6:7], toks[:, 7:9], toks[:, 9:10]):
        want, want_c = decode(plain, part, want_c)
        got, got_c = decode(fused, part, got_c)
        if "qk norm" in name:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_c), jax.tree.leaves(want_c)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="XLA's step off a GPU")
def test_off_a_gpu_the_fused_decoder_is_the_lean_step_bit_for_bit():
    """``fused=True`` on the CPU takes XLA's step in each kernel's place: in bfloat16 its
    logits are the lean step's bit for bit, with its blocks' outputs handed on unsummed
    (a :class:`Residual` of the stream and the token-sparse expert part's float32 sum)."""
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))
    toks = jax.random.randint(jax.random.key(4), (2, 6), 0, 64)
    model = _model(BlockFFNConfig(n_experts=8, d_expert=16, path="auto", activation="swiglu"),
                   d=64, dtype="bfloat16", param_dtype="bfloat16")
    plain, fused = lean_decoder(model), lean_decoder(model, fused=True)
    want_c, got_c = plain.init_cache(2, 16), fused.init_cache(2, 16)
    for part in (toks[:, :5], toks[:, 5:6]):
        want, want_c = decode(plain, part, want_c)
        got, got_c = decode(fused, part, got_c)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_fused_value_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="fused='gpu'; give one of False, True, 'interpret'"):
        lean_decoder(_model(DenseFFNConfig(d_hidden=48, activation="gelu")), fused="gpu")


def test_a_layout_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="layout='mk'; a product's weight is laid out as one "
                                         "of 'kn', 'nk'"):
        lean_decoder(_model(DenseFFNConfig(d_hidden=48, activation="gelu")), "mk")


def _per_block(kind: str, platform: str, layers: int = 14) -> dict[str, float]:
    model = nnx.eval_shape(lambda: lean_decoder(_model(  # shapes only: no weights drawn
        SLOTS[kind], layers=layers, d=256, dtype="bfloat16", param_dtype="bfloat16")))
    graphdef, state = nnx.split(model)
    cache = model.init_cache(1, 256)

    def step(state, tok, cache):
        return nnx.merge(graphdef, state).decode(tok, cache)

    with lowering_target(platform):
        text = jax.export.export(
            jax.jit(step, donate_argnums=2), platforms=(platform,),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
                state, jnp.zeros((1, 1), jnp.int32), cache).mlir_module()
    ops = collections.Counter(re.findall(r"stablehlo\.([a-z_]+)", text))
    per = {k: ops[k] / layers for k in (*COUNTED, "dynamic_update_slice")}
    # the element types of each flash call's operands: q, k, v and the rows' cache lengths
    # (int32), or a dense mask (i1) where the lengths were not given
    per["flash operands"] = {tuple(re.findall(r"x([a-z]+\d+)>", c)) for c in re.findall(
        r"custom_call @__gpu\$xla\.gpu\.triton\([^)]*\).*?: \(([^)]*)\)", text)}
    # what makes the float32 output each chunk-union decode kernel sums into
    per["decode kernel output from"] = set()
    for call in re.finditer(r"custom_call @mosaic_gpu_v2\(([^)]*)\)", text):
        start = re.findall(rf"{call.group(1).split(', ')[-1]} = (stablehlo\.\w+ .*?)loc",
                           text[:call.start()])[-1]
        per["decode kernel output from"].add(re.sub(r"%\w+", "%", start).strip())
    return per


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "blockffn"])
def test_the_one_token_decode_launches_within_its_budget(kind):
    """Exported for cuda: the q/k/v and gate/up products fused, the flash kernel for the
    attention over the cache, each cache written by one in-place dynamic_update_slice."""
    per = _per_block(kind, "cuda")
    assert sum(per[k] for k in COUNTED) <= BUDGET[kind], per
    # the kernel's key loop ends at the cache's lengths: no dense mask to read
    assert per["flash operands"] == {("bf16", "bf16", "bf16", "i32")}, per
    assert per["scatter"] == 0 and per["dynamic_update_slice"] == 2, per
    assert per["custom_call"] == KERNELS[kind], per
    if kind == "blockffn":  # the block's residual (bf16), not a zeroed buffer
        assert per["decode kernel output from"] == {
            "stablehlo.convert % : (tensor<1x256xbf16>) -> tensor<1x256xf32>"}, per
    assert per["dot_general"] <= PRODUCTS[kind] + 1 / 14, per  # + the head's, once


@pytest.mark.parametrize("platform, seq_len", [("cuda", 128), ("tpu", 128), ("tpu", 127)])
@pytest.mark.parametrize("kind", ["moe", "blockffn"])
def test_the_train_steps_export_with_the_flash_kernel(kind, platform, seq_len):
    """The MoE and BlockFFN LM train steps lowered for cuda and tpu run attention on
    tokamax's flash kernel (forward and backward) in the exported module; on a TPU also at a
    length its 128-long blocks do not tile (padded to them)."""
    slot = (MoEConfig(n_experts=4, top_k=2, d_expert=32) if kind == "moe"
            else BlockFFNConfig(n_experts=8, d_expert=16))
    cfg = DecoderConfig(vocab_size=64, d_model=128, n_layers=1, n_heads=1, ffn_slots=(slot,),
                        max_seq_len=128)
    with capture_steps(steps=0) as captured:
        train(DecoderLM(cfg, rngs=nnx.Rngs(0)), ToySource(batch_size=2, seq_len=seq_len),
              TrainConfig(steps=2, batch_size=2))
    c = captured[0]
    with lowering_target(platform):
        text = jax.export.export(
            c.step.jitted(c.state) if hasattr(c.step, "jitted") else c.step,
            platforms=(platform,),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
                c.state, c.batch).mlir_module()
    name = {"cuda": "pallas_flash_attention", "tpu": "splash_m"}[platform]
    kernels = re.findall(r'name = "([^"]*)"', text) + re.findall(r'kernel_name = "([^"]*)"',
                                                                 text)
    flash = [k for k in kernels if name in k]
    assert len(flash) >= 2, sorted(set(kernels))  # forward and at least one backward kernel


def test_compile_options_are_checked_against_the_running_xla():
    """An option this XLA does not know is named and left out (never passed to a compile);
    the command-buffer options it knows are kept."""
    known, unknown = known_options({**COMMAND_BUFFERS, "xla_gpu_no_such_option": 1})
    assert known == COMMAND_BUFFERS and unknown == ("xla_gpu_no_such_option",)


def test_decoding_with_command_buffers_decodes_the_same_tokens(monkeypatch):
    """The decoding loops compiled with the command-buffer options (per function, once per
    prompt shape) give the tokens of the plain loops; an option unknown to this XLA is
    dropped and the timing says so."""
    target = _model(BlockFFNConfig(n_experts=8, d_expert=8))
    draft = _model(DenseFFNConfig(d_hidden=16, activation="swiglu"), layers=1)
    prompts = jax.random.randint(jax.random.key(0), (2, 5), 0, 64)
    runs = {}
    for on in (False, True):
        for d in (None, draft):
            r = decode_timing(target, prompts, 6, draft=d, draft_len=2, command_buffers=on)
            runs[on, d is None] = r
            assert r["command_buffers"] == ("on" if on else "off")
    for ar in (True, False):
        np.testing.assert_array_equal(runs[True, ar]["tokens"], runs[False, ar]["tokens"])
    monkeypatch.setattr(bench_decode, "COMMAND_BUFFERS", {"xla_gpu_no_such_option": 1})
    r = decode_timing(target, prompts, 6, command_buffers=True)
    assert r["command_buffers"] == "off: unknown to this XLA (xla_gpu_no_such_option)"
    np.testing.assert_array_equal(r["tokens"], runs[False, True]["tokens"])


@pytest.mark.slow
def test_a_lean_decoder_made_before_the_loops_decodes_the_same_tokens():
    """The decoding loops keep a LeanDecoder they are given (bench_speculative makes it once,
    in the configured layout, before timing): its tokens, autoregressive and speculative,
    are the plain model's in float32, in either layout, and with the steps' kernels
    (``fused``; in the interpreter here), on BlockFFN's dense path and, speculative, on its
    token-sparse path."""
    draft = _model(DenseFFNConfig(d_hidden=16, activation="swiglu"), layers=1)
    prompts = jax.random.randint(jax.random.key(1), (2, 5), 0, 64)
    for path, drafts in (("dense", (None, draft)), ("auto", (draft,))):
        target = _model(BlockFFNConfig(n_experts=8, d_expert=16, path=path))
        for d in drafts:
            want = decode_timing(target, prompts, 6, draft=d, draft_len=2)["tokens"]
            for fused in (False, "interpret"):
                got = decode_timing(lean_decoder(target, "nk", fused), prompts, 6,
                                    draft_len=2,
                                    draft=None if d is None else lean_decoder(d, "nk", fused))
                np.testing.assert_array_equal(got["tokens"], want)
