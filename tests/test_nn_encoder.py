"""BERT encoder (post-LN layer vs numpy), pooling, classifier head, ViT patchify and shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import erf

from moejax.config import ConfigError
from moejax.nn.encoder import (
    BertEncoder,
    SequenceClassifier,
    ViT,
    bert_encoder_config,
    minilm_l6_config,
    patchify,
    vit_config,
)

RNG = np.random.default_rng(0)


def n_params(model):
    return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


def randomize(model, scale=0.3):
    """Give every parameter (incl. zero-init biases / unit LN scales) random values."""
    state = nnx.state(model, nnx.Param)
    for _, p in nnx.to_flat_state(state):
        noise = RNG.standard_normal(p[...].shape).astype(np.float32) * scale
        p[...] = p[...] + jnp.asarray(noise)
    nnx.update(model, state)


def ln_np(x, g, b, eps):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def gelu_np(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def bert_numpy(model, tokens, types, mask):
    """Obvious BERT forward: embeddings + LN, then per layer post-LN attention/FFN, pooler."""
    P = lambda x: np.asarray(x[...], np.float64)
    cfg = model.cfg
    B, T = tokens.shape
    H, D = cfg.n_heads, cfg.d_model
    K = D // H
    eps = cfg.norm_eps
    h = P(model.tok_embed)[tokens] + P(model.pos_embed)[:T][None] + P(model.type_embed)[types]
    h = ln_np(h, P(model.embed_norm.scale), P(model.embed_norm.bias), eps)
    for blk in model.blocks:
        a = blk.attn
        q = (h @ P(a.w_q) + P(a.b_q)).reshape(B, T, H, K)
        k = (h @ P(a.w_k) + P(a.b_k)).reshape(B, T, H, K)
        v = (h @ P(a.w_v) + P(a.b_v)).reshape(B, T, H, K)
        ctx = np.zeros((B, T, H, K))
        for b in range(B):
            for hd in range(H):
                s = q[b, :, hd] @ k[b, :, hd].T / np.sqrt(K)
                s = s + np.where(mask[b], 0.0, -1e9)[None, :]  # HF-style additive mask
                w = np.exp(s - s.max(-1, keepdims=True))
                w /= w.sum(-1, keepdims=True)
                ctx[b, :, hd] = w @ v[b, :, hd]
        attn_out = ctx.reshape(B, T, D) @ P(a.w_o) + P(a.b_o)
        h = ln_np(h + attn_out, P(blk.attn_norm.scale), P(blk.attn_norm.bias), eps)
        f = blk.ffn
        inter = gelu_np(h @ P(f.w_up) + P(f.b_up))
        h = ln_np(h + inter @ P(f.w_down) + P(f.b_down), P(blk.ffn_norm.scale),
                  P(blk.ffn_norm.bias), eps)
    pooled = np.tanh(h[:, 0] @ P(model.w_pool) + P(model.b_pool))
    return h, pooled


def test_bert_layer_matches_numpy_reference():
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=1, n_heads=2, d_hidden=12,
                              max_position=10, type_vocab_size=2, pooling="pooler")
    model = BertEncoder(cfg, rngs=nnx.Rngs(0))
    randomize(model)
    assert float(jnp.abs(model.blocks[0].attn.b_q[...]).sum()) > 0  # biases are exercised
    tokens = RNG.integers(0, 20, size=(2, 6))
    types = RNG.integers(0, 2, size=(2, 6))
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    h, pooled, aux = model(jnp.asarray(tokens), token_types_BT=jnp.asarray(types),
                           mask_BT=jnp.asarray(mask))
    h_ref, pooled_ref = bert_numpy(model, tokens, types, mask)
    np.testing.assert_allclose(h, h_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pooled, pooled_ref, rtol=1e-4, atol=1e-4)
    assert float(aux["aux_loss"]) == 0.0 and aux["layers"] == ({},)


def test_mean_pooling_ignores_padding():
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=2, n_heads=2, d_hidden=12,
                              max_position=10, pooling="mean")
    model = BertEncoder(cfg, rngs=nnx.Rngs(1))
    randomize(model)
    mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    t1 = jnp.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5]])
    t2 = t1.at[0, 3:].set(jnp.array([17, 9]))  # change only padding tokens of row 0
    h1, p1, _ = model(t1, mask_BT=mask)
    h2, p2, _ = model(t2, mask_BT=mask)
    np.testing.assert_allclose(p1, p2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h1[0, :3], h2[0, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p1[0], np.asarray(h1[0, :3]).mean(0), rtol=1e-5, atol=1e-5)
    _, p_nomask, _ = model(t1)
    assert not np.allclose(p_nomask[0], p1[0])  # padding would matter without the mask


def test_cls_pooling_and_sequence_classifier():
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=1, n_heads=2, d_hidden=12,
                              max_position=10, pooling="cls")
    clf = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(2))
    randomize(clf)
    tokens = jnp.asarray(RNG.integers(0, 20, size=(2, 5)))
    logits, aux = clf(tokens)
    h, pooled, _ = clf.encoder(tokens)
    np.testing.assert_allclose(pooled, h[:, 0])
    ref = np.asarray(pooled) @ np.asarray(clf.w_cls[...]) + np.asarray(clf.b_cls[...])
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    assert logits.shape == (2, 3) and not hasattr(clf.encoder, "w_pool")
    with pytest.raises(ValueError, match="max_position"):
        clf(jnp.zeros((1, 11), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens of shape \(5,\) and dtype int32; a "
                                         "BertEncoder takes integer token ids"):
        clf(tokens[0].astype(jnp.int32))
    for name in ("mask_BT", "token_types_BT"):
        with pytest.raises(ValueError, match=rf"{name} of shape \(2, 4\) for tokens of "
                                             r"shape \(2, 5\); give one entry per token"):
            clf(tokens, **{name: jnp.ones((2, 4), jnp.int32)})


def test_minilm_layout_has_the_published_parameter_count():
    abstract = nnx.eval_shape(
        lambda: BertEncoder(minilm_l6_config(pooling="pooler"), rngs=nnx.Rngs(0)))
    assert n_params(abstract) == 22_713_216  # all-MiniLM-L6-v2 incl. the BERT pooler


def test_patchify_matches_numpy_oracle():
    imgs = RNG.standard_normal((2, 6, 4, 3)).astype(np.float32)
    got = np.asarray(patchify(jnp.asarray(imgs), 2))
    ref = np.zeros((2, 6, 12), np.float32)
    for b in range(2):
        for pr in range(3):
            for pc in range(2):
                for i in range(2):
                    for j in range(2):
                        for c in range(3):
                            ref[b, pr * 2 + pc, (i * 2 + j) * 3 + c] = imgs[b, pr * 2 + i,
                                                                          pc * 2 + j, c]
    np.testing.assert_array_equal(got, ref)


def test_vit_shapes_patch_embedding_and_grad():
    cfg = vit_config(image_size=8, patch_size=4, d_model=8, n_layers=2, n_heads=2,
                     d_hidden=16, n_classes=5)
    vit = ViT(cfg, rngs=nnx.Rngs(3))
    imgs = jnp.asarray(RNG.standard_normal((2, 8, 8, 3)).astype(np.float32))
    # each compiled whole (op by op, each op compiles on its own)
    (logits, aux), (feats, _) = nnx.jit(lambda m, x: (m(x), m.features(x)))(vit, imgs)
    assert logits.shape == (2, 5) and len(aux["layers"]) == 2
    assert vit.pos_embed[...].shape == (1 + 4, 8) and vit.w_patch[...].shape == (48, 8)
    assert feats.shape == (2, 5, 8)
    # patch embedding == a conv with stride p (explicit loop over patches)
    w = np.asarray(vit.w_patch[...]).reshape(4, 4, 3, 8)
    x = np.asarray(imgs)
    emb = np.asarray(patchify(imgs, 4) @ vit.w_patch[...])
    np.testing.assert_allclose(emb[1, 3], np.einsum("ijc,ijcd->d", x[1, 4:8, 4:8], w),
                               rtol=1e-5, atol=1e-5)
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))(vit, imgs)
    assert float(jnp.abs(grads.cls_token[...]).sum()) > 0
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        cfg.replace(image_size=10)
    with pytest.raises(ConfigError, match="image_size=0 must be a positive multiple"):
        cfg.replace(image_size=0)  # no patch: a model of the CLS token alone
    with pytest.raises(ValueError, match="image_size"):
        vit(jnp.zeros((1, 4, 4, 3)))
