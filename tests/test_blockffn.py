"""BlockFFN slot: numpy oracle, dense vs chunk-union paths (outputs and gradients), router
gradient through ReLU, ReMoE variant, decoder integration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.remoe import ReMoEConfig
from moejax.ops import chunk_sparsity as cs
from tests.toy_models import jitted

B, T, D, E, F = 2, 7, 8, 6, 5


def _x(seed=0):
    return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


def _silu(v):
    return v / (1 + np.exp(-v))


def _np_blockffn(layer, x, rmsnorm=True):
    x = np.asarray(x, np.float64).reshape(-1, D)
    a0 = x @ np.asarray(layer.router.w[...], np.float64)
    a1 = np.maximum(a0, 0)
    if rmsnorm:
        scale = np.asarray(layer.router_norm.scale[...], np.float64)
        a = a1 / np.sqrt((a1 ** 2).mean(-1, keepdims=True) + layer.cfg.norm_eps) * scale
    else:
        a = a1
    w_up = np.asarray(layer.experts.w_up[...], np.float64)
    w_down = np.asarray(layer.experts.w_down[...], np.float64)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for e in range(E):
            y[n] += a[n, e] * (_silu(x[n] @ w_up[e]) @ w_down[e])
    return y.reshape(B, T, D), a0.reshape(B, T, E), a1.reshape(B, T, E)


def _layer(seed=0, **kw):
    cfg = BlockFFNConfig(n_experts=E, d_expert=F, **kw)
    layer = cfg.build(D, rngs=nnx.Rngs(seed))
    if cfg.rmsnorm:  # non-trivial learnable scale
        layer.router_norm.scale[...] = jnp.linspace(0.5, 1.5, E)
    return layer


@pytest.mark.parametrize("rmsnorm", [True])  # False: see test_remoe_*
def test_forward_matches_numpy(rmsnorm):
    layer = _layer(rmsnorm=rmsnorm, al_coef=0.1, cs_coef=0.2, chunk_len=3)
    x = _x()
    mask = jnp.ones((B, T), bool).at[1, 5:].set(False)
    y, aux = layer(x, mask_BT=mask)
    y_np, a0, a1 = _np_blockffn(layer, x, rmsnorm)
    np.testing.assert_allclose(np.asarray(y), y_np, rtol=1e-4, atol=1e-5)
    assert 0 < float(aux["tls"]) < 1  # some experts on, some off
    al = cs.activation_locality_loss(jnp.asarray(a0, jnp.float32), alpha=100.0, mask_BT=mask)
    csl = cs.chunk_sparsification_loss(jnp.asarray(a1, jnp.float32), chunk_len=3, mask_BT=mask)
    np.testing.assert_allclose(float(aux["al_loss"]), float(al), rtol=1e-4)
    np.testing.assert_allclose(float(aux["cs_loss"]), float(csl), rtol=1e-4)
    np.testing.assert_allclose(float(aux["aux_loss"]), 0.1 * float(al) + 0.2 * float(csl),
                               rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(aux["active_BTE"]), a1 > 0)
    real = np.asarray(mask)
    np.testing.assert_allclose(float(aux["tls"]), 1 - (a1 > 0).mean(-1)[real].mean(), rtol=1e-5)
    # Fig. 4's activation magnitude: mean L2 norm of the combine weights A (after RMSNorm)
    a = np.asarray(aux["a_BTE"], np.float64)
    scale = np.asarray(layer.router_norm.scale[...], np.float64)
    want_a = a1 / np.sqrt((a1 ** 2).mean(-1, keepdims=True) + layer.cfg.norm_eps) * scale
    np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(aux["act_magnitude"]),
                               np.linalg.norm(want_a, axis=-1)[real].mean(), rtol=1e-5)


def test_every_sparsifier_enters_the_aux_loss_with_its_weight():
    """L1 and entropy act on the ReLU pattern A1 (the paper keeps regularisation off the
    RMSNorm'd values), each weighted by its own coefficient."""
    layer = _layer(al_coef=0.1, cs_coef=0.2, l1_coef=0.3, entropy_coef=0.4, chunk_len=3)
    x = _x(1)
    mask = jnp.ones((B, T), bool).at[0, 4:].set(False)
    _, aux = layer(x, mask_BT=mask)
    _, a0, a1 = _np_blockffn(layer, x)
    real = np.asarray(mask)
    np.testing.assert_allclose(float(aux["l1_loss"]), a1.sum(-1)[real].mean(), rtol=1e-5)
    want = (0.1 * float(aux["al_loss"]) + 0.2 * float(aux["cs_loss"])
            + 0.3 * float(aux["l1_loss"]) + 0.4 * float(aux["entropy_loss"]))
    assert float(aux["entropy_loss"]) > 0
    np.testing.assert_allclose(float(aux["aux_loss"]), want, rtol=1e-5)


def test_the_router_starts_with_variance_one_over_d_model():
    w = np.asarray(BlockFFNConfig(n_experts=64, d_expert=4).build(
        256, rngs=nnx.Rngs(0)).router.w[...])
    assert w.std() == pytest.approx(256 ** -0.5, rel=0.02) and abs(w.mean()) < 3e-3


def _loss(layer, x):
    y, aux = layer(x)
    return jnp.sum(y * jnp.cos(jnp.arange(D))) + aux["aux_loss"]


@pytest.mark.parametrize("tile", [1, 3])
def test_chunk_union_path_equals_dense_with_gradients(tile):
    dense = _layer(al_coef=0.1, cs_coef=0.3, chunk_len=2)
    sparse = _layer(al_coef=0.1, cs_coef=0.3, chunk_len=2, path="chunk_union",
                    union_chunk=tile)
    x = _x(1)
    (yd, _), (ys, as_) = jitted(dense)(x), jitted(sparse)(x)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(yd), rtol=1e-5, atol=1e-6)
    assert float(as_["union_overflow"]) == 0.0
    gd = nnx.jit(nnx.grad(_loss, argnums=(0, 1)))(dense, x)
    gs = nnx.jit(nnx.grad(_loss, argnums=(0, 1)))(sparse, x)
    for a, b in zip(jax.tree.leaves(gd), jax.tree.leaves(gs)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_chunk_union_with_cap_is_exact_when_union_fits_and_flags_overflow():
    layer = _layer(path="chunk_union", union_chunk=1)
    x = _x(2)
    k_max = int(np.asarray(layer(x)[1]["active_BTE"]).sum(-1).max())
    exact = _layer(path="chunk_union", union_chunk=1, max_union=k_max)
    np.testing.assert_allclose(np.asarray(exact(x)[0]), np.asarray(layer(x)[0]), rtol=1e-5,
                               atol=1e-6)
    assert float(exact(x)[1]["union_overflow"]) == 0.0
    small = _layer(path="chunk_union", union_chunk=T, max_union=1)
    assert float(small(x)[1]["union_overflow"]) > 0.0


def test_router_gradient_flows_through_relu_only_for_active_experts():
    layer = _layer()
    x = _x(3)[:1, :1]  # one token
    # compiled whole, like a train step (op by op, each op compiles on its own)
    g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))(layer, x)
    gw = np.asarray(g.router.w[...])
    active = np.asarray(nnx.jit(lambda m, x: m(x)[1]["active_BTE"])(layer, x)).reshape(E)
    assert active.any() and not active.all()
    assert np.all(np.abs(gw[:, active]).sum(0) > 0)  # reaches the router through ReLU
    np.testing.assert_array_equal(gw[:, ~active], 0.0)  # ReLU blocks inactive experts
    gu = np.asarray(g.experts.w_up[...])
    np.testing.assert_array_equal(gu[~active], 0.0)


def test_cs_loss_gradient_sparsifies_router():
    layer = _layer(al_coef=0.0, cs_coef=1.0, chunk_len=4)
    x = _x(4)
    opt_w = layer.router.w[...]
    g = nnx.grad(lambda m: m(x)[1]["aux_loss"])(layer).router.w[...]
    before = float(layer(x)[1]["cs_loss"])
    layer.router.w[...] = opt_w - 0.5 * g
    assert float(layer(x)[1]["cs_loss"]) < before


def test_segment_ids_change_al_loss():
    layer = _layer()
    x = _x(5)
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1] * 7])
    l_plain = layer(x)[1]["al_loss"]
    l_seg = layer(x, segment_ids_BT=seg)[1]["al_loss"]
    a0 = layer.route(x.reshape(-1, D))[0].reshape(B, T, E)
    want = cs.activation_locality_loss(a0, segment_ids_BT=seg)
    np.testing.assert_allclose(float(l_seg), float(want), rtol=1e-6)
    assert abs(float(l_seg) - float(l_plain)) > 1e-6


def test_remoe_is_relu_router_without_rmsnorm():
    cfg = ReMoEConfig(n_experts=E, d_expert=F, l1_coef=0.5, l1_form="plain")
    layer = cfg.build(D, rngs=nnx.Rngs(0))
    assert not hasattr(layer, "router_norm")
    x = _x(6)
    y, aux = layer(x)
    y_np, _, a1 = _np_blockffn(layer, x, rmsnorm=False)
    np.testing.assert_allclose(np.asarray(y), y_np, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(aux["aux_loss"]), 0.5 * a1.sum(-1).mean(), rtol=1e-4)
    # the default: ReMoE's load-balanced L1, each expert's L1 weighted by its frequency
    lb = ReMoEConfig(n_experts=E, d_expert=F, l1_coef=0.5, l1_k=2.0).build(D, rngs=nnx.Rngs(0))
    _, aux_lb = lb(x)
    a1 = a1.reshape(-1, E)
    f = (a1 > 0).mean(0) / 2.0
    np.testing.assert_allclose(float(aux_lb["aux_loss"]), 0.5 * E * np.sum(a1.mean(0) * f),
                               rtol=1e-4)


@pytest.mark.parametrize("kw, field", [(dict(max_union=E + 1), "max_union"),
                                       (dict(union_chunk=0), "union_chunk"),
                                       (dict(cs_coef=-1.0), "cs_coef"),
                                       (dict(cs_eps=1.0), "cs_eps")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        BlockFFNConfig(n_experts=E, **kw)


@pytest.mark.parametrize("kw, words", [(dict(union_chunk=0), "union_chunk=0 must be >= 1"),
                                       (dict(l1_k=0.0), "l1_k=0.0 must be > 0")])
def test_remoe_config_refuses_what_its_blockffn_slot_would(kw, words):
    """A ReMoE slot's settings are refused when its config is made (naming ReMoEConfig),
    not when the slot it builds is."""
    with pytest.raises(ConfigError, match=f"ReMoEConfig: {words}"):
        ReMoEConfig(n_experts=E, d_expert=F, **kw)


def test_in_decoder_and_jit():
    slot = BlockFFNConfig(n_experts=4, d_expert=8, path="chunk_union", union_chunk=4,
                          cs_coef=0.1)
    cfg = DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, ffn_slots=(slot,) * 2)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(2 * 9).reshape(2, 9) % 32
    logits, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert logits.shape == (2, 9, 32) and len(aux["layers"]) == 2
    want = sum(0.002 * la["al_loss"] + 0.1 * la["cs_loss"] for la in aux["layers"])
    np.testing.assert_allclose(float(aux["aux_loss"]), float(want), rtol=1e-5)


def test_segment_ids_are_read_from_the_argument_only():
    """No attribute hand-over: a stray ``_segment_ids_BT`` attribute is ignored."""
    layer = _layer()
    x = _x(6)
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 3, 3, 3]])
    plain = {k: float(v) for k, v in layer(x)[1].items() if k.endswith("_loss")}
    object.__setattr__(layer, "_segment_ids_BT", seg)
    try:
        stray = {k: float(v) for k, v in layer(x)[1].items() if k.endswith("_loss")}
    finally:
        object.__delattr__(layer, "_segment_ids_BT")
    assert stray == plain
    a0 = layer.route(x.reshape(-1, D))[0].reshape(B, T, E)
    a1 = jax.nn.relu(a0)
    got = layer(x, segment_ids_BT=seg)[1]
    np.testing.assert_allclose(float(got["al_loss"]), float(cs.activation_locality_loss(
        a0, alpha=layer.cfg.alpha, segment_ids_BT=seg)), rtol=1e-6)
    np.testing.assert_allclose(float(got["cs_loss"]), float(cs.chunk_sparsification_loss(
        a1, chunk_len=layer.cfg.chunk_len, eps=layer.cfg.cs_eps, segment_ids_BT=seg)),
        rtol=1e-6)


def test_remoe_slot_accepts_segment_ids():
    layer = ReMoEConfig(n_experts=E, d_expert=F).build(D, rngs=nnx.Rngs(0))
    x = _x(7)
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1] * 7])
    y0, aux0 = layer(x)
    y1, aux1 = layer(x, segment_ids_BT=seg)
    np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))  # token-wise output
    np.testing.assert_allclose(float(aux1["l1_loss"]), float(aux0["l1_loss"]), rtol=1e-6)
    assert float(aux1["aux_loss"]) == pytest.approx(float(aux0["aux_loss"]))
