"""Norms, RoPE, attention (MHA/GQA, masks, KV cache) and dense FFN vs numpy oracles."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import erf

from moejax.config import ConfigError
from moejax.nn.attention import Attention
from moejax.nn.ffn import DenseFFN, DenseFFNConfig
from moejax.nn.norms import LayerNorm, RMSNorm
from moejax.nn.rope import apply_rope, half_to_interleaved_perm
from tests.toy_models import jitted

RNG = np.random.default_rng(0)


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# ----------------------------------------------------------------------------- norms


def test_rmsnorm_matches_numpy_and_keeps_dtype():
    x = randn(2, 3, 8) * 3
    norm = RMSNorm(8, eps=1e-6)
    norm.scale[...] = jnp.asarray(randn(8))
    ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * np.asarray(norm.scale[...])
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-5)
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_layernorm_matches_numpy():
    x = randn(2, 3, 8) * 2 + 5
    norm = LayerNorm(8, eps=1e-12)
    norm.scale[...] = jnp.asarray(randn(8))
    norm.bias[...] = jnp.asarray(randn(8))
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = (x - mu) / np.sqrt(var + 1e-12) * np.asarray(norm.scale[...]) + np.asarray(norm.bias[...])
    np.testing.assert_allclose(norm(jnp.asarray(x)), ref, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ RoPE


def rope_numpy(x_BTHJ, pos_BT, base, style):
    B, T, H, J = x_BTHJ.shape
    out = np.zeros_like(x_BTHJ, dtype=np.float64)
    for i in range(J // 2):
        theta = base ** (-2.0 * i / J)
        a, b = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + J // 2)
        ang = (pos_BT * theta)[:, :, None]
        out[..., a] = x_BTHJ[..., a] * np.cos(ang) - x_BTHJ[..., b] * np.sin(ang)
        out[..., b] = x_BTHJ[..., a] * np.sin(ang) + x_BTHJ[..., b] * np.cos(ang)
    return out


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_rope_matches_numpy(style):
    x = randn(2, 5, 3, 8)
    pos = RNG.integers(0, 50, size=(2, 5))
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos), base=10000.0, style=style)
    np.testing.assert_allclose(got, rope_numpy(x, pos, 10000.0, style), rtol=1e-4, atol=1e-4)


def test_rope_conventions_agree_under_permutation():
    x_inter = randn(1, 4, 2, 8)
    pos = jnp.arange(4)[None] * 7
    perm = half_to_interleaved_perm(8)
    a = apply_rope(jnp.asarray(x_inter[..., perm]), pos, base=500.0, style="half")
    b = apply_rope(jnp.asarray(x_inter), pos, base=500.0, style="interleaved")[..., perm]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_rope_dot_product_depends_only_on_offset(style):
    q, k = randn(1, 1, 1, 16), randn(1, 1, 1, 16)

    def dot(m, n):
        qr = apply_rope(jnp.asarray(q), jnp.array([[m]]), base=1e4, style=style)
        kr = apply_rope(jnp.asarray(k), jnp.array([[n]]), base=1e4, style=style)
        return float(jnp.sum(qr * kr))

    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4, abs=1e-5)
    assert dot(0, 0) == pytest.approx(float(np.sum(q * k)), rel=1e-5)
    assert abs(dot(5, 2) - dot(5, 3)) > 1e-3  # and it does depend on the offset


# ------------------------------------------------------------------------- attention


def attention_numpy(x, p, H, G, K, *, causal, mask_BT=None, rope=None, pos=None):
    """Obvious per-head loop reference. ``p``: dict of numpy params."""
    B, T, _ = x.shape
    q = (x @ p["w_q"] + p.get("b_q", 0)).reshape(B, T, H, K)
    k = (x @ p["w_k"] + p.get("b_k", 0)).reshape(B, T, G, K)
    v = (x @ p["w_v"] + p.get("b_v", 0)).reshape(B, T, G, K)
    if rope is not None:
        q, k = rope_numpy(q, pos, 10000.0, rope), rope_numpy(k, pos, 10000.0, rope)
    out = np.zeros((B, T, H, K))
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            s = q[b, :, h] @ k[b, :, g].T / np.sqrt(K)
            allowed = np.ones((T, T), bool)
            if causal:
                allowed &= np.tril(np.ones((T, T), bool))
            if mask_BT is not None:
                allowed &= mask_BT[b][None, :]
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[b, :, h] = w @ v[b, :, g]
    return out.reshape(B, T, H * K) @ p["w_o"] + p.get("b_o", 0)


def params_np(mod):
    names = ["w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"]
    return {n: np.asarray(getattr(mod, n)[...]) for n in names if hasattr(mod, n)}


def randomize_biases(mod):
    for n in ["b_q", "b_k", "b_v", "b_o"]:
        if hasattr(mod, n):
            getattr(mod, n)[...] = jnp.asarray(randn(*getattr(mod, n)[...].shape, scale=0.5))


@pytest.mark.parametrize("H,G,bias,causal,rope", [
    (4, 4, True, False, None),      # BERT-like MHA with biases, bidirectional
    (4, 2, False, True, "half"),    # Llama-like GQA + RoPE
    (6, 3, False, True, "interleaved"),
])
def test_attention_matches_numpy(H, G, bias, causal, rope):
    D, K, B, T = 12, 4, 2, 5
    attn = Attention(D, H, G, K, use_bias=bias, causal=causal, rope_style=rope,
                     rngs=nnx.Rngs(1))
    randomize_biases(attn)
    x = randn(B, T, D)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    got = attn(jnp.asarray(x), mask_BT=jnp.asarray(mask))
    pos = np.broadcast_to(np.arange(T), (B, T))
    ref = attention_numpy(x, params_np(attn), H, G, K, causal=causal, mask_BT=mask,
                          rope=rope, pos=pos)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_gqa_equals_mha_with_repeated_kv_heads():
    D, H, G, K = 8, 4, 2, 4
    gqa = Attention(D, H, G, K, causal=True, rope_style="half", rngs=nnx.Rngs(2))
    mha = Attention(D, H, H, K, causal=True, rope_style="half", rngs=nnx.Rngs(3))
    rep = lambda w: np.repeat(np.asarray(w).reshape(D, G, K), H // G, axis=1).reshape(D, H * K)
    mha.w_q[...], mha.w_o[...] = gqa.w_q[...], gqa.w_o[...]
    mha.w_k[...], mha.w_v[...] = jnp.asarray(rep(gqa.w_k[...])), jnp.asarray(rep(gqa.w_v[...]))
    x = jnp.asarray(randn(2, 6, D))
    np.testing.assert_allclose(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def test_causal_future_tokens_do_not_change_past_outputs():
    attn = Attention(8, 2, 1, 4, causal=True, rope_style="half", rngs=nnx.Rngs(4))
    x = randn(1, 6, 8)
    x2 = x.copy()
    x2[:, 4:] = randn(1, 2, 8)
    a, b = attn(jnp.asarray(x)), attn(jnp.asarray(x2))
    np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_kv_cache_prefill_then_steps_matches_full():
    attn = Attention(8, 4, 2, 4, causal=True, rope_style="interleaved", rngs=nnx.Rngs(5))
    x = jnp.asarray(randn(2, 7, 8))
    full = nnx.jit(lambda a, x: a(x))(attn, x)
    decode = nnx.jit(lambda a, x, c: a.decode(x, c))  # per shape one program, not one per op
    cache = attn.init_cache(2, 10)
    out, cache = decode(attn, x[:, :4], cache)
    outs = [out]
    for t in range(4, 7):
        out, cache = decode(attn, x[:, t:t + 1], cache)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths_B, [7, 7])
    assert cache.k_BSGJ.shape == (2, 10, 2, 4)


def test_kv_cache_rows_with_different_lengths():
    """Rows at different fill levels write/attend at their own offsets."""
    attn = Attention(8, 2, 2, 4, causal=True, rope_style="half", rngs=nnx.Rngs(6))
    x = jnp.asarray(randn(2, 5, 8))
    cache = attn.init_cache(2, 8)
    decode, full = nnx.jit(lambda a, x, c: a.decode(x, c)), nnx.jit(lambda a, x: a(x))
    _, c0 = decode(attn, x[:, :3], cache)  # both rows hold 3 tokens
    # Row 1 "forgets" its last token: lengths [3, 2]; row 1's next token goes to slot 2.
    c0 = c0._replace(lengths_B=jnp.array([3, 2], jnp.int32))
    out, c1 = decode(attn, x[:, 3:4], c0)
    ref0 = full(attn, x[:1, :4])[:, 3]
    ref1 = full(attn, jnp.concatenate([x[1:, :2], x[1:, 3:4]], 1))[:, 2]
    np.testing.assert_allclose(out[:, 0], jnp.concatenate([ref0, ref1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(c1.lengths_B, [4, 3])


def test_attention_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Attention(8, 4, 3, 2, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------------- FFN


def gelu_np(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def silu_np(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True), ("geglu", True)])
def test_dense_ffn_matches_numpy_and_param_names(activation, bias):
    cfg = DenseFFNConfig(d_hidden=6, activation=activation, use_bias=bias)
    ffn = cfg.build(4, rngs=nnx.Rngs(0))
    assert isinstance(ffn, DenseFFN)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(ffn, nnx.Param))}
    gated = activation != "gelu"
    expect = {"w_up", "w_down"} | ({"w_gate"} if gated else set())
    if bias:
        expect |= {"b_up", "b_down"} | ({"b_gate"} if gated else set())
    assert names == expect
    assert ffn.w_up[...].shape == (4, 6) and ffn.w_down[...].shape == (6, 4)
    if bias:
        for n in expect - {"w_up", "w_down", "w_gate"}:
            getattr(ffn, n)[...] = jnp.asarray(randn(*getattr(ffn, n)[...].shape))
    p = {n: np.asarray(getattr(ffn, n)[...]) for n in expect}
    x = randn(2, 3, 4)
    up = x @ p["w_up"] + p.get("b_up", 0)
    if activation == "swiglu":
        h = silu_np(x @ p["w_gate"]) * up
    elif activation == "geglu":
        h = gelu_np(x @ p["w_gate"] + p["b_gate"]) * up
    else:
        h = gelu_np(up)
    ref = h @ p["w_down"] + p.get("b_down", 0)
    y, aux = ffn(jnp.asarray(x), train=True, key=None, mask_BT=None)
    assert aux == {}
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_dense_ffn_config_validation():
    with pytest.raises(ConfigError, match="activation"):
        DenseFFNConfig(d_hidden=4, activation="tanh")
    with pytest.raises(ConfigError, match="d_hidden"):
        DenseFFNConfig(d_hidden=0, activation="gelu")


# ------------------------------------------------------------- packed rows (segment ids)


@pytest.mark.parametrize("causal,rope", [(True, "half"), (True, "interleaved"), (False, None)])
def test_attention_with_segment_ids_equals_each_document_alone(causal, rope):
    """Row 0: docs of lengths 3, 5, then 2 padding tokens (segment 0, masked); row 1: one doc
    of 6 + a doc of 4. With restarted positions each document's output equals running it
    alone (slicing oracle) and the numpy oracle on the block-diagonal mask."""
    D, H, G, K, T = 12, 4, 2, 4, 10
    layer = Attention(D, H, G, K, causal=causal, rope_style=rope, rngs=nnx.Rngs(11))
    attn = jitted(layer)
    x = randn(2, T, D)
    lens = [[3, 5], [6, 4]]
    seg = np.zeros((2, T), np.int32)
    pos = np.zeros((2, T), np.int32)
    for b, ls in enumerate(lens):
        start = 0
        for i, n in enumerate(ls):
            seg[b, start:start + n] = i + 1
            pos[b, start:start + n] = np.arange(n)
            start += n
    mask = seg > 0
    got = np.asarray(attn(jnp.asarray(x), positions_BT=jnp.asarray(pos),
                          mask_BT=jnp.asarray(mask), segment_ids_BT=jnp.asarray(seg)))
    for b, ls in enumerate(lens):
        start = 0
        for n in ls:
            alone = np.asarray(attn(jnp.asarray(x[b:b + 1, start:start + n])))
            np.testing.assert_allclose(got[b:b + 1, start:start + n], alone, rtol=1e-5,
                                       atol=1e-5)
            start += n
    # numpy oracle, one document at a time (block-diagonal attention)
    for b, ls in enumerate(lens):
        start = 0
        for n in ls:
            ref = attention_numpy(x[b:b + 1, start:start + n], params_np(layer), H, G, K,
                                  causal=causal, rope=rope, pos=np.arange(n)[None])
            np.testing.assert_allclose(got[b:b + 1, start:start + n], ref, rtol=1e-4,
                                       atol=1e-4)
            start += n
    # without segment ids the second document sees the first one
    leak = np.asarray(attn(jnp.asarray(x), positions_BT=jnp.asarray(pos),
                           mask_BT=jnp.asarray(mask)))
    assert not np.allclose(leak[0, 3:8], got[0, 3:8], atol=1e-4)


def test_attention_segment_ids_all_equal_is_a_no_op():
    attn = Attention(8, 2, 1, 4, causal=True, rope_style="half", rngs=nnx.Rngs(12))
    x = jnp.asarray(randn(2, 6, 8))
    seg = jnp.ones((2, 6), jnp.int32)
    np.testing.assert_allclose(attn(x, segment_ids_BT=seg), attn(x), rtol=1e-6, atol=1e-6)


def test_dense_ffn_accepts_and_ignores_segment_ids():
    ffn = DenseFFN(DenseFFNConfig(d_hidden=16, activation="swiglu"), 8, rngs=nnx.Rngs(0))
    x = jnp.asarray(randn(2, 5, 8))
    seg = jnp.asarray(np.array([[1, 1, 2, 2, 2], [1, 2, 3, 0, 0]], np.int32))
    y0, a0 = ffn(x)
    y1, a1 = ffn(x, segment_ids_BT=seg)
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))
    assert a0 == {} and a1 == {}
