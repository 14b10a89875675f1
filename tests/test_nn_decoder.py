"""DecoderLM: cache vs full forward, tied/untied params, jit, slot aux flow, generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, config, from_json, to_json
from moejax.nn import generate as gen_mod
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import (
    DecoderLM,
    dense_decoder_config,
    join_lengths,
    smollm2_135m_config,
    split_lengths,
)
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.lean_decode import lean_decoder
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.nn.remoe import ReMoEConfig
from moejax.nn.sample import sampler
from moejax.nn.slots import FFNSlotConfig, layer_pattern
from moejax.nn.speculative import speculative_decoder
from tests.toy_models import jitted, logits_of


def tiny_cfg(**kw):
    base = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_hidden=24,
                max_seq_len=32, init_std=1.0)
    base.update(kw)
    return dense_decoder_config(**base)


def n_params(model):
    return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, size=(2, 9)), jnp.int32)


def _prefill_then_steps(model, decode=None):
    """``(logits [2, 9, V], cache)``: TOKENS' first 5 tokens prefilled into an empty cache,
    then the other 4 decoded one at a time."""
    decode = decode or (lambda m, t, c: m.decode(t, c))
    logits, cache = decode(model, TOKENS[:, :5], model.init_cache(2, 12))
    steps = [logits]
    for t in range(5, 9):
        logits, cache = decode(model, TOKENS[:, t:t + 1], cache)
        steps.append(logits)
    return jnp.concatenate(steps, 1), cache


# ---------------------------------------------------------------- test-only FFN slot


@config
class ConstAuxSlotConfig(FFNSlotConfig):
    """Test slot: y = 0, aux_loss = ``loss``, and it reports the key it received."""

    loss: float = 0.25

    def build(self, d_model, *, rngs, dtype=None, param_dtype=None):
        return ConstAuxSlot(self.loss)


class ConstAuxSlot(nnx.Module):
    def __init__(self, loss):
        self.loss = loss

    def __call__(self, x_BTD, *, train=False, key=None, mask_BT=None, segment_ids_BT=None):
        key_bits = (jnp.zeros((2,), jnp.uint32) if key is None
                    else jax.random.key_data(key).reshape(-1)[:2])
        n_real = jnp.sum(mask_BT) if mask_BT is not None else jnp.float32(x_BTD.shape[0]
                                                                           * x_BTD.shape[1])
        aux = {"aux_loss": jnp.float32(self.loss), "key_bits": key_bits,
               "train": jnp.float32(train), "n_real": n_real.astype(jnp.float32),
               "seg_sum": (jnp.float32(-1) if segment_ids_BT is None
                           else jnp.sum(segment_ids_BT).astype(jnp.float32))}
        return jnp.zeros_like(x_BTD), aux


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("rope_style", ["half", "interleaved"])
def test_prefill_plus_cached_decode_matches_full_forward(rope_style):
    model = DecoderLM(tiny_cfg(rope_style=rope_style), rngs=nnx.Rngs(0))
    full, _ = model(TOKENS)
    cached, cache = _prefill_then_steps(model, nnx.jit(lambda m, t, c: m.decode(t, c)))
    np.testing.assert_allclose(cached, full, rtol=1e-4, atol=1e-4)
    assert full.shape == (2, 9, 32) and full.dtype == jnp.float32
    assert all(int(c.lengths_B[0]) == 9 for c in cache) and len(cache) == 2


@pytest.mark.parametrize("layers", [dict(qk_norm="head"), dict(qk_norm="full"),
                                    dict(qkv_bias=True)])
def test_qk_norms_and_qkv_biases_decode_as_the_full_forward(layers):
    """Per-head and whole-projection q/k RMSNorms (Qwen3, OLMoE) and q/k/v biases (Qwen2)
    apply before RoPE on the cached path as on the full one; they add their parameters."""
    model = DecoderLM(tiny_cfg(**layers), rngs=nnx.Rngs(0))
    for _, p in nnx.iter_graph(model):  # norms and biases away from 1 / 0
        if isinstance(p, nnx.Param):
            p[...] = p[...] + 0.1 * jax.random.normal(jax.random.key(p[...].size),
                                                      p[...].shape)
    full, _ = nnx.jit(lambda m, t: m(t))(model, TOKENS)  # per shape one program
    steps = _prefill_then_steps(model, nnx.jit(lambda m, t, c: m.decode(t, c)))[0]
    np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-4)
    attn = model.blocks[0].attn  # head_dim 4, 4 query heads, 2 kv heads
    if layers.get("qk_norm"):
        shapes = (attn.q_norm.scale[...].shape, attn.k_norm.scale[...].shape)
        assert shapes == {"head": ((4,), (4,)), "full": ((16,), (8,))}[layers["qk_norm"]]
    else:
        assert attn.b_q[...].shape == (16,) and not hasattr(attn, "b_o")


def test_decoding_past_the_cache_is_refused_with_both_lengths():
    """A prefill or step that would write past the cache's end (XLA would clamp it onto the
    last slots) is refused before tracing, naming the lengths; generate, the sampler and the
    speculative decoder refuse a prompt plus new tokens beyond max_seq_len the same way."""
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 6)
    with pytest.raises(ValueError, match="9 new tokens after 0 cached ones need 9 cache "
                                         "slots, but the cache holds 6"):
        model.decode(TOKENS, cache)
    _, cache = model.decode(TOKENS[:, :5], cache)
    with pytest.raises(ValueError, match="2 new tokens after 5 cached ones need 7"):
        model.decode(TOKENS[:, 5:7], cache)
    with pytest.raises(ValueError, match=r"prompt \(9\) \+ max_new_tokens \(30\) = 39 "
                                         "exceeds max_seq_len=32"):
        generate(model, TOKENS, 30)
    with pytest.raises(ValueError, match=r"prompt block \(9\) \+ max_new_tokens \(30\)"):
        sampler(model, 30, temperature=0.0)(TOKENS, np.full((2,), 9), key=jax.random.key(0))
    with pytest.raises(ValueError, match="prompt 9 \\+ 20 new tokens \\+ 2 x .* exceeds"):
        speculative_decoder(model, model, 20, draft_len=2)(TOKENS[:1])


def test_tokens_that_are_not_integer_ids_in_rows_or_not_the_caches_rows_are_refused():
    """A single sequence, float ids, a prefill of more rows than the cache was made for, or a
    mask, segment ids or positions of another shape than the tokens are refused in one line
    naming the shapes (they failed deep in the gather, attention or the cache write, or a
    [B, 1] array was broadcast)."""
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tokens of shape \(9,\) and dtype int32; a "
                                         r"DecoderLM takes integer token ids \[batch, time\]"):
        model(TOKENS[0])
    with pytest.raises(ValueError, match="dtype float32"):
        model(TOKENS.astype(jnp.float32))
    with pytest.raises(ValueError, match="dtype float32"):
        model.decode(TOKENS.astype(jnp.float32), model.init_cache(2, 16))
    with pytest.raises(ValueError, match=r"decode: 2 rows of tokens for a cache of 1 rows; "
                                         r"make the cache with init_cache\(2, max_len\)"):
        model.decode(TOKENS, model.init_cache(1, 16))
    for name, arr in (("mask_BT", jnp.ones((2, 1))), ("segment_ids_BT", jnp.ones((2, 1), int)),
                      ("positions_BT", jnp.arange(8)[None])):
        with pytest.raises(ValueError, match=rf"{name} of shape \({arr.shape[0]}, "
                                             rf"{arr.shape[1]}\) for tokens of shape \(2, 9\)"):
            model(TOKENS, **{name: arr})
    with pytest.raises(ValueError, match=r"mask_BT of shape \(2, 1\) for tokens of shape "
                                         r"\(2, 9\)"):
        model.decode(TOKENS, model.init_cache(2, 16), mask_BT=jnp.ones((2, 1), bool))
    shared = model(TOKENS, positions_BT=jnp.arange(9)[None])[0]  # one row for every row
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(model(TOKENS)[0]))
    logits, _ = model(np.asarray(TOKENS, np.int64))  # numpy ids of any integer dtype pass
    assert logits.shape == (*TOKENS.shape, tiny_cfg().vocab_size)


def test_generate_refuses_a_negative_count_and_an_eos_outside_the_vocabulary():
    """generate returns the prompt for 0 new tokens, refuses a negative count, and an eos_id
    the model could never emit (the loop would run to the end, the padding never come)."""
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(generate(model, TOKENS, 0)), np.asarray(TOKENS))
    with pytest.raises(ValueError, match="max_new_tokens=-1 must be an integer >= 0"):
        generate(model, TOKENS, -1)
    with pytest.raises(ValueError, match="max_new_tokens=2.5 must be an integer"):
        generate(model, TOKENS, 2.5)
    with pytest.raises(ValueError, match=r"eos_id=32 lies outside the vocabulary \[0, 32\)"):
        generate(model, TOKENS, 3, eos_id=32)
    with pytest.raises(ValueError, match="eos_id=-2 lies outside"):
        generate(model, TOKENS, 3, eos_id=-2)


def test_tied_vs_untied_parameter_counts():
    tied = DecoderLM(tiny_cfg(tie_embeddings=True), rngs=nnx.Rngs(0))
    untied = DecoderLM(tiny_cfg(tie_embeddings=False), rngs=nnx.Rngs(0))
    assert n_params(untied) - n_params(tied) == 16 * 32
    # exact count: embed + per layer (2 norms + q,o [16,16] + k,v [16,8] + 3 FFN mats) + final
    per_layer = 2 * 16 + 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 24
    assert n_params(tied) == 32 * 16 + 2 * per_layer + 16
    assert untied.w_head[...].shape == (16, 32) and not hasattr(tied, "w_head")


def test_jit_matches_no_jit():
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(1))
    eager, _ = model(TOKENS)
    jitted, aux = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)
    assert float(aux["aux_loss"]) == 0.0 and aux["layers"] == ({}, {})


def test_bfloat16_compute_close_to_float32():
    m32 = DecoderLM(tiny_cfg(init_std=0.5), rngs=nnx.Rngs(2))
    m16 = DecoderLM(tiny_cfg(init_std=0.5, dtype="bfloat16"), rngs=nnx.Rngs(2))
    a, _ = m32(TOKENS)
    b, _ = m16(TOKENS)
    assert b.dtype == jnp.float32 and m16.embed[...].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - b))) < 0.15 * float(jnp.max(jnp.abs(a)))


def test_aux_flows_from_slots_every_other_layer_with_per_layer_keys():
    dense = DenseFFNConfig(d_hidden=24, activation="swiglu")
    slots = layer_pattern(4, dense, ConstAuxSlotConfig(loss=0.25), every=2)
    cfg = tiny_cfg(n_layers=4).replace(ffn_slots=slots)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    mask = jnp.ones(TOKENS.shape, bool).at[1, 6:].set(False)
    _, aux = model(TOKENS, train=True, key=jax.random.key(7), mask_BT=mask)
    assert float(aux["aux_loss"]) == pytest.approx(0.5)
    layers = aux["layers"]
    assert len(layers) == 4 and layers[0] == {} and layers[2] == {}
    k1, k3 = np.asarray(layers[1]["key_bits"]), np.asarray(layers[3]["key_bits"])
    expected = jax.random.key_data(jax.random.split(jax.random.key(7), 4))
    np.testing.assert_array_equal(k1, np.asarray(expected[1]).reshape(-1)[:2])
    np.testing.assert_array_equal(k3, np.asarray(expected[3]).reshape(-1)[:2])
    assert float(layers[1]["train"]) == 1.0 and float(layers[1]["n_real"]) == 15.0
    # grads flow through aux_loss-free dense layers while the slot adds a constant loss
    _, aux_nokey = model(TOKENS)
    assert not np.any(np.asarray(aux_nokey["layers"][1]["key_bits"]))


def test_a_layer_pattern_that_places_its_slot_nowhere_is_refused():
    """Every other layer from the second, of one layer, is none: MoELMConfig(n_layers=1,
    moe_layers="every_other") built a dense LM, silently."""
    dense, moe = DenseFFNConfig(d_hidden=24, activation="swiglu"), MoEConfig()
    assert layer_pattern(2, dense, moe, every=2) == (dense, moe)
    with pytest.raises(ValueError, match="places MoEConfig in none of the 1 layers"):
        layer_pattern(1, dense, moe, every=2)
    for bad in (dict(every=0), dict(offset=-1)):
        with pytest.raises(ValueError, match="every=.* must be >= 1 and offset"):
            layer_pattern(4, dense, moe, **bad)
    assert layer_pattern(2, dense, moe, layers=()) == (dense, dense)  # said: none
    with pytest.raises(ConfigError, match="MoELMConfig: layer_pattern: every=2 from offset=1"):
        MoELMConfig(n_layers=1, moe_layers="every_other")


def test_decoder_config_validation_and_json_roundtrip():
    cfg = tiny_cfg()
    with pytest.raises(ConfigError, match="ffn_slots has 1 entries but n_layers=2"):
        cfg.replace(ffn_slots=cfg.ffn_slots[:1])
    with pytest.raises(ConfigError, match="n_kv_heads=3 must divide n_heads=4"):
        cfg.replace(n_kv_heads=3)
    with pytest.raises(ConfigError, match="rope_style"):
        cfg.replace(rope_style="neox")
    for base in (0.0, -1.0, 1.0):  # inf or NaN angles, or one frequency for every pair
        with pytest.raises(ConfigError, match=rf"rope_base={base} must be a finite number > 1"):
            cfg.replace(rope_base=base)
    with pytest.raises(ConfigError, match="head_dim=0 must be even and >= 2"):  # no heads
        cfg.replace(head_dim=0)
    assert from_json(to_json(cfg)) == cfg


# ------------------------------------------------------------------------- generation


def test_greedy_generate_equals_repeated_full_forward_argmax():
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(3))
    prompt = TOKENS[:, :4]
    before = gen_mod._decode_one._cache_size()
    out = generate(model, prompt, 6)
    # Oracle: a full (uncached) forward over the whole sequence so far, once per new token.
    # The sequence is right-padded to a fixed length (the model is causal, so the padding
    # cannot affect earlier positions) so that one compiled forward serves every step.
    seq = np.zeros((2, 10), np.int32)
    seq[:, :4] = np.asarray(prompt)
    for t in range(4, 10):
        logits = logits_of(model, jnp.asarray(seq))
        seq[:, t] = np.argmax(np.asarray(logits[:, t - 1]), -1)
    np.testing.assert_array_equal(out, seq)
    compiled = gen_mod._decode_one._cache_size()
    assert compiled - before <= 1  # one decode step compiled for all 6 tokens
    generate(model, prompt, 6)  # same shapes: no new compilation at all
    assert gen_mod._decode_one._cache_size() == compiled


def test_sampling_is_keyed_and_respects_top_k():
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(4))
    prompt = TOKENS[:, :3]
    a = generate(model, prompt, 5, key=jax.random.key(0), temperature=1.0)
    b = generate(model, prompt, 5, key=jax.random.key(0), temperature=1.0)
    np.testing.assert_array_equal(a, b)
    top1 = generate(model, prompt, 5, key=jax.random.key(1), temperature=2.0, top_k=1)
    np.testing.assert_array_equal(top1, generate(model, prompt, 5))
    with pytest.raises(ValueError, match="explicit key"):
        generate(model, prompt, 2, temperature=1.0)


def test_generate_pads_after_eos():
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(3))
    prompt = TOKENS[:, :4]
    greedy = np.asarray(generate(model, prompt, 6))
    eos = int(greedy[0, 5])  # row 0's second generated token
    out = np.asarray(generate(model, prompt, 6, eos_id=eos))
    assert out.shape == (2, 10)
    np.testing.assert_array_equal(out[0, :6], greedy[0, :6])
    assert np.all(out[0, 6:] == eos)
    for row in range(2):  # each row equals greedy up to its first eos, then eos
        gen = greedy[row, 4:]
        hits = np.flatnonzero(gen == eos)
        stop = hits[0] + 1 if hits.size else 6
        np.testing.assert_array_equal(out[row, 4:4 + stop], gen[:stop])
        assert np.all(out[row, 4 + stop:] == eos)


# ----------------------------------------------------------------------- MoE slots


def test_decoder_with_moe_every_other_layer_forward_and_grad():
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=8, balance_coef=0.01)
    dense = DenseFFNConfig(d_hidden=24, activation="swiglu")
    cfg = tiny_cfg(init_std=0.02).replace(ffn_slots=layer_pattern(2, dense, moe, every=2))
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))

    def loss_fn(m):
        logits, aux = m(TOKENS[:, :-1], train=True, key=jax.random.key(0))
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.mean(jnp.take_along_axis(logp, TOKENS[:, 1:, None], -1))
        return nll + aux["aux_loss"], aux

    step = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))
    (loss, aux), grads = step(model)
    assert np.isfinite(float(loss)) and float(aux["aux_loss"]) > 0
    assert aux["layers"][0] == {} and "aux_loss" in aux["layers"][1]
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    router_grad = [g for p, g in nnx.to_flat_state(grads) if "router" in map(str, p)]
    assert router_grad and any(float(jnp.abs(g[...]).sum()) > 0 for g in router_grad)


def test_smollm2_135m_layout_has_the_published_parameter_count():
    abstract = nnx.eval_shape(lambda: DecoderLM(smollm2_135m_config(), rngs=nnx.Rngs(0)))
    assert n_params(abstract) == 134_515_008
    assert abstract.blocks[0].attn.w_k.get_value().shape == (576, 192)


# -------------------------------------------------------------- packed rows (segment ids)


def _packed(lens, T, rng):
    """One packed row of documents with ``lens`` (+ padding to ``T``): tokens, segment ids,
    restarted positions, mask, and the documents."""
    docs = [rng.integers(0, 32, size=n).astype(np.int32) for n in lens]
    toks = np.zeros((1, T), np.int32)
    seg = np.zeros((1, T), np.int32)
    pos = np.zeros((1, T), np.int32)
    start = 0
    for i, d in enumerate(docs):
        toks[0, start:start + len(d)] = d
        seg[0, start:start + len(d)] = i + 1
        pos[0, start:start + len(d)] = np.arange(len(d))
        start += len(d)
    return toks, seg, pos, seg > 0, docs


def _slot_variants():
    dense = DenseFFNConfig(d_hidden=24, activation="swiglu")
    return {
        "dense": (dense, dense),
        "blockffn": (dense, BlockFFNConfig(n_experts=4, d_expert=8, chunk_len=2)),
        "remoe": (ReMoEConfig(n_experts=4, d_expert=8), dense),
    }


@pytest.mark.parametrize("variant", ["dense", "blockffn", "remoe"])
def test_packed_row_logits_equal_each_document_alone(variant):
    a, b = _slot_variants()[variant]
    model = DecoderLM(tiny_cfg(init_std=0.5).replace(ffn_slots=(a, b)), rngs=nnx.Rngs(3))
    toks, seg, pos, mask, docs = _packed([5, 7], 14, np.random.default_rng(1))
    model = jitted(model)
    logits, _ = model(jnp.asarray(toks), positions_BT=jnp.asarray(pos),
                      mask_BT=jnp.asarray(mask), segment_ids_BT=jnp.asarray(seg))
    logits = np.asarray(logits)
    start = 0
    for d in docs:
        alone = np.asarray(model(jnp.asarray(d[None]))[0])
        np.testing.assert_allclose(logits[:, start:start + len(d)], alone, rtol=1e-4,
                                   atol=1e-4)
        start += len(d)
    # without the segment ids (same restarted positions) the second document is contaminated
    leak = np.asarray(model(jnp.asarray(toks), positions_BT=jnp.asarray(pos),
                            mask_BT=jnp.asarray(mask))[0])
    assert not np.allclose(leak[:, 5:12], logits[:, 5:12], atol=1e-4)


def test_segment_ids_reach_every_slot_and_none_is_the_default():
    dense = DenseFFNConfig(d_hidden=24, activation="swiglu")
    slots = layer_pattern(4, dense, ConstAuxSlotConfig(loss=0.25), every=2)
    model = DecoderLM(tiny_cfg(n_layers=4).replace(ffn_slots=slots), rngs=nnx.Rngs(0))
    seg = jnp.asarray(np.array([[1] * 4 + [2] * 5, [1] * 9], np.int32))
    _, aux = model(TOKENS, segment_ids_BT=seg)
    for i in (1, 3):
        assert float(aux["layers"][i]["seg_sum"]) == float(np.sum(np.asarray(seg)))
    _, aux = model(TOKENS)
    assert float(aux["layers"][1]["seg_sum"]) == -1.0


def test_decoder_with_moe_accepts_segment_ids():
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=8)
    dense = DenseFFNConfig(d_hidden=24, activation="swiglu")
    model = DecoderLM(tiny_cfg().replace(ffn_slots=(dense, moe)), rngs=nnx.Rngs(0))
    ones = jnp.ones(TOKENS.shape, jnp.int32)
    # a single segment per row changes nothing
    np.testing.assert_allclose(model(TOKENS, segment_ids_BT=ones)[0], model(TOKENS)[0],
                               rtol=1e-5, atol=1e-5)


def test_remat_gives_the_same_loss_and_gradients_with_less_activation_memory():
    """Each block recomputed in the backward: equal values and gradients (a noisy MoE router
    included, so the recomputation must replay the same key), and a compiled gradient that
    holds fewer bytes of temporaries than the one keeping every block's activations."""
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=64, router="noisy")
    cfg = tiny_cfg(init_std=0.02, n_layers=3, d_hidden=64).replace(
        ffn_slots=layer_pattern(3, moe, moe, every=1))
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, size=(4, 32)), jnp.int32)

    def grad_fn(remat):
        def loss(p):
            logits, aux = nnx.merge(graphdef, p)(tokens[:, :-1], train=True,
                                                  key=jax.random.key(3), remat=remat)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)) \
                + aux["aux_loss"]
        return jax.jit(jax.value_and_grad(loss))

    (l0, g0), (l1, g1) = grad_fn(False)(params), grad_fn(True)(params)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
    temp = [grad_fn(r).lower(params).compile().memory_analysis().temp_size_in_bytes
            for r in (False, True)]
    assert temp[1] < 0.7 * temp[0], temp


def test_batch_one_decode_writes_its_cache_in_place_without_scatters():
    """Batch-1 decoding (a server's single stream) writes each KV cache with one
    dynamic_update_slice of the whole cache: the lowered one-token step holds no scatter and
    two dynamic_update_slice per block (k and v), and its logits equal the full forward's."""
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(0))
    full, _ = model(TOKENS[:1])
    graphdef, state = nnx.split(model)

    def decode(state, t, cache):
        return nnx.merge(graphdef, state).decode(t, cache)

    cache = model.init_cache(1, 12)
    step = jax.jit(decode)
    logits, cache = step(state, TOKENS[:1, :5], cache)
    steps = [logits]
    for t in range(5, 9):
        logits, cache = step(state, TOKENS[:1, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-4, atol=1e-4)
    hlo = step.lower(state, TOKENS[:1, 8:9], cache).as_text()
    assert hlo.count("stablehlo.scatter") == 0
    assert hlo.count("stablehlo.dynamic_update_slice") == 2 * model.cfg.n_layers
    batched = step.lower(state, TOKENS[:, 8:9], model.init_cache(2, 12)).as_text()
    assert batched.count("stablehlo.scatter") >= 2 * model.cfg.n_layers  # rows at own offsets


def test_generate_steps_take_the_cache_donated():
    """The prefill and each token's step write into the cache they are given (donated: its
    buffers are the new cache's, no copy per token): every cache array aliases an output of
    the step, and the arrays passed in are consumed."""
    cfg = dense_decoder_config(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_hidden=32,
                               max_seq_len=32)
    graphdef, state = nnx.split(lean_decoder(DecoderLM(cfg, rngs=nnx.Rngs(0))))
    cache = nnx.merge(graphdef, state).init_cache(1, 16)
    _, cache2 = gen_mod._prefill(graphdef, state, jnp.ones((1, 3), jnp.int32), cache)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache))
    tok, live = jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)
    text = gen_mod._decode_one.lower(graphdef, state, tok, cache2, live).as_text()
    assert text.count("tf.aliasing_output") == len(jax.tree.leaves(cache2)) == 6
    _, cache3 = gen_mod._decode_one(graphdef, state, tok, cache2, live)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache2))
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache3))


def test_a_cache_split_from_its_lengths_and_joined_back_decodes_the_same():
    """A decoding loop carries ``split_lengths(cache)``: each layer's k and v and one lengths
    array for all of them; joined back, the cache is the one the model returned."""
    model = DecoderLM(tiny_cfg(), rngs=nnx.Rngs(0))
    _, cache = model.decode(TOKENS[:, :5], model.init_cache(2, 12))
    kv, lengths = split_lengths(cache)
    assert len(kv) == 2 and lengths.tolist() == [5, 5]
    joined = join_lengths(kv, lengths)
    for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a, b)
    shorter = join_lengths(kv, jnp.array([3, 4]))  # every layer rolled back alike
    assert [c.lengths_B.tolist() for c in shorter] == [[3, 4], [3, 4]]
    want, _ = model.decode(TOKENS[:, 5:6], cache)
    got, _ = model.decode(TOKENS[:, 5:6], joined)
    np.testing.assert_array_equal(got, want)
