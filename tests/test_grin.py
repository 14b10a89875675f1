"""GRIN (SparseMixer-v2 top-2) slot: numpy oracle of the selection / combine, the documented
straight-through estimator on a hand-worked example, and a jitted DecoderLM train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.grin import GRIN_MOE, GRINConfig, SparseMixerNoise, sample_noise, sparsemixer_v2

B, T, D, E, F = 2, 5, 8, 6, 4


# ----------------------------------------------------------------------------- numpy oracle

def _np_stage(s, rem, eps, g, u):
    """One stage for one token: returns (id, forward weight, pi, c)."""
    m = rem.max()
    factor = np.maximum(np.abs(s), m)
    with np.errstate(invalid="ignore", divide="ignore"):
        drop = ((m - s) / factor > 2 * eps) | np.isneginf(rem)
    z = np.where(drop, -np.inf, rem)
    pi = np.exp(z - z.max())
    pi /= pi.sum()
    arg = int(np.argmax(rem))
    d = arg if g is None else int(np.argmax(z + g))
    c = 1.0 if (u is None or d == arg or u > 0.75) else 1.0 / 3.0
    return d, c * pi[d], pi, c


def _np_sparsemixer(logits, eps, noise=None, k=2):
    k = k if noise is None else noise.gumbel_KNE.shape[0]
    ids, w, pis, cs = [], [], [], []
    for n, s in enumerate(np.asarray(logits, np.float64)):
        rest, out = s.copy(), []
        for i in range(k):
            g = None if noise is None else noise.gumbel_KNE[i][n]
            u = None if noise is None else noise.uniform_KN[i][n]
            out.append(_np_stage(s, rest, eps, g, u))
            rest[out[-1][0]] = -np.inf
        ids.append([o[0] for o in out]), w.append([o[1] for o in out])
        pis.append([o[2] for o in out]), cs.append([o[3] for o in out])
    return np.array(ids), np.array(w), np.array(pis), np.array(cs)


def _silu(v):
    return v / (1 + np.exp(-v))


def _logits(seed, n=12, e=E, scale=0.3):
    # values near 1 with small spread so the 2*eps band keeps several candidates
    return 1.0 + scale * jax.random.normal(jax.random.key(seed), (n, e), jnp.float32)


# ----------------------------------------------------------------------------- config

def test_config_validation():
    with pytest.raises(ConfigError, match="top_k"):
        GRINConfig(moe=GRIN_MOE.replace(top_k=1))
    with pytest.raises(ConfigError, match="top_k"):
        GRINConfig(moe=GRIN_MOE.replace(top_k=17))
    GRINConfig(moe=GRIN_MOE.replace(top_k=3))  # more stages: our extension
    with pytest.raises(ConfigError, match="renormalize"):
        GRINConfig(moe=GRIN_MOE.replace(renormalize=True))
    with pytest.raises(ConfigError, match="jitter_eps"):
        GRINConfig(jitter_eps=-0.1)


# ----------------------------------------------------------------------------- routing forward

@pytest.mark.parametrize("eps", [0.0, 0.01, 0.1, 10.0])
def test_eval_routing_matches_numpy(eps):
    s = _logits(0)
    r = sparsemixer_v2(s, jitter_eps=eps)
    ids, w, _, _ = _np_sparsemixer(s, eps)
    np.testing.assert_array_equal(np.asarray(r.ids_NK), ids)
    np.testing.assert_allclose(np.asarray(r.weights_NK), w, rtol=1e-5, atol=1e-6)
    # eval ids are the plain top-2 of the logits
    np.testing.assert_array_equal(np.asarray(r.ids_NK), np.asarray(jax.lax.top_k(s, 2)[1]))
    if eps == 0.0:  # lone candidate in each stage -> weight 1
        np.testing.assert_allclose(np.asarray(r.weights_NK), 1.0)
    if eps == 10.0:  # no masking: stage 1 is the full softmax, stage 2 the softmax without D_1
        p = np.asarray(jax.nn.softmax(s))
        p1 = np.take_along_axis(p, ids[:, :1], 1)[:, 0]
        p2 = np.take_along_axis(p, ids[:, 1:], 1)[:, 0] / (1 - p1)
        np.testing.assert_allclose(np.asarray(r.weights_NK), np.stack([p1, p2], 1), rtol=1e-5)


@pytest.mark.parametrize("eps", [0.05, 0.2])
def test_train_routing_matches_numpy(eps):
    s = _logits(1, n=64)
    noise = sample_noise(jax.random.key(3), 64, E)
    r = sparsemixer_v2(s, jitter_eps=eps, noise=noise)
    ids, w, pis, cs = _np_sparsemixer(s, eps, noise)
    np.testing.assert_array_equal(np.asarray(r.ids_NK), ids)
    np.testing.assert_allclose(np.asarray(r.weights_NK), w, rtol=1e-5, atol=1e-6)
    assert (ids[:, 0] != ids[:, 1]).all()
    # sampled experts are candidates of their stage's masked softmax
    assert (np.take_along_axis(pis[:, 0], ids[:, :1], 1) > 0).all()
    # the sample differs from argmax somewhere, and the 1/3 Heun factor occurs
    assert (ids[:, 0] != np.argmax(np.asarray(s), 1)).any()
    assert (cs == 1 / 3).any() and (cs == 1).any()


@pytest.mark.parametrize("k", [3, 5])
def test_k_stage_routing_matches_numpy(k):
    """k > 2 stages: eval ids are the plain top-k, train ids distinct, and the estimator is
    the stage-wise formula summed over all k stages."""
    eps = 0.15
    s = _logits(6, n=32)
    r = sparsemixer_v2(s, jitter_eps=eps, k=k)
    ids, w, _, _ = _np_sparsemixer(s, eps, k=k)
    np.testing.assert_array_equal(np.asarray(r.ids_NK), np.asarray(jax.lax.top_k(s, k)[1]))
    np.testing.assert_allclose(np.asarray(r.weights_NK), w, rtol=1e-5, atol=1e-6)
    noise = sample_noise(jax.random.key(5), 32, E, k)
    coef = jax.random.normal(jax.random.key(7), (32, k))
    rt = sparsemixer_v2(s, jitter_eps=eps, noise=noise)
    ids, w, pis, _ = _np_sparsemixer(s, eps, noise)
    np.testing.assert_array_equal(np.asarray(rt.ids_NK), ids)
    np.testing.assert_allclose(np.asarray(rt.weights_NK), w, rtol=1e-5, atol=1e-6)
    assert all(len(set(row)) == k for row in ids.tolist())
    grad = np.asarray(jax.grad(lambda s: jnp.sum(
        coef * sparsemixer_v2(s, jitter_eps=eps, noise=noise).weights_NK))(s))
    want = np.zeros((32, E))
    for n in range(32):
        for i in range(k):
            pi, d = pis[n, i], ids[n, i]
            want[n] += float(coef[n, i]) * pi[d] * (np.eye(E)[d] - pi)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)


def test_module_forward_matches_numpy():
    cfg = GRINConfig(moe=GRIN_MOE.replace(n_experts=E, d_expert=F), jitter_eps=0.1)
    m = cfg.build(D, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
    mask = jnp.ones((B, T), bool).at[1, -2:].set(False)
    key = jax.random.key(7)
    for train in (False, True):
        y, aux = m(x, train=train, key=key, mask_BT=mask)
        xn = np.asarray(x, np.float64).reshape(-1, D)
        logits = xn @ np.asarray(m.router.w_g[...], np.float64)
        noise = sample_noise(key, B * T, E) if train else None
        ids, w, _, _ = _np_sparsemixer(logits, 0.1, noise)
        wu, wd = np.asarray(m.experts.w_up[...]), np.asarray(m.experts.w_down[...])
        want = np.zeros_like(xn)
        for n in range(xn.shape[0]):
            for k in range(2):
                e = ids[n, k]
                want[n] += w[n, k] * (_silu(xn[n] @ wu[e]) @ wd[e])
        np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(aux["expert_ids"]).reshape(-1, 2), ids)
        assert aux["expert_ids"].shape == (B, T, 2)
        load = np.asarray(aux["load"])
        real = np.asarray(mask).reshape(-1)
        want_load = np.bincount(ids[real].reshape(-1), minlength=E) / (2 * real.sum())
        np.testing.assert_allclose(load, want_load, rtol=1e-6)
        np.testing.assert_allclose(float(aux["aux_loss"]), 0.01 * float(aux["balance_loss"]),
                                   rtol=1e-6)
    with pytest.raises(ValueError, match="PRNG key"):
        m(x, train=True)


# ----------------------------------------------------------------------------- estimator

def test_estimator_hand_example():
    """E = 3, one token, logits (1.0, 0.96, 0.5), eps = 0.05 (band 10%): stage 1 candidates
    {0, 1}; forced sample D_1 = 1 (not the argmax) with u = 0 -> c_1 = 1/3. Stage 2 sees
    (1.0, -inf, 0.5): lone candidate 0 -> w_2 = 1, no gradient from w_2.

    Forward w_1 = pi_1 / 3 with pi = softmax(1.0, 0.96) on {0, 1}. Backward (SparseMixer-v2):
    dw_1/ds = pi_1 (e_1 - pi) = (-pi_0 pi_1, pi_0 pi_1, 0), i.e. 3x the autodiff gradient of
    the forward value pi_1 / 3, and zero for the masked expert 2."""
    s = jnp.array([[1.0, 0.96, 0.5]])
    big = 1e4
    g = jnp.array([[[0.0, big, 0.0]], [[0.0, 0.0, 0.0]]])  # force D_1 = 1
    noise = SparseMixerNoise(g, jnp.zeros((2, 1)))
    r = sparsemixer_v2(s, jitter_eps=0.05, noise=noise)
    p0 = 1 / (1 + np.exp(-0.04))  # softmax(1.0, 0.96)[0]
    p1 = 1 - p0
    np.testing.assert_array_equal(np.asarray(r.ids_NK), [[1, 0]])
    np.testing.assert_allclose(np.asarray(r.weights_NK), [[p1 / 3, 1.0]], rtol=1e-6)

    coef = jnp.array([[2.0, 5.0]])  # L = 2 w_1 + 5 w_2

    def loss(s):
        return jnp.sum(coef * sparsemixer_v2(s, jitter_eps=0.05, noise=noise).weights_NK)

    grad = np.asarray(jax.grad(loss)(s))[0]
    want = 2.0 * p1 * (np.array([0.0, 1.0, 0.0]) - np.array([p0, p1, 0.0]))
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)

    # plain autodiff of the forward weight pi_1 / 3 (no straight-through): a third of it
    def naive(s):
        z = jnp.where(jnp.arange(3) < 2, s[0], -jnp.inf)
        return 2.0 * jax.nn.softmax(z)[1] / 3.0
    np.testing.assert_allclose(grad, 3.0 * np.asarray(jax.grad(naive)(s))[0], rtol=1e-5,
                               atol=1e-7)
    # and it differs from the plain softmax top-k weight gradients (Switch, full softmax)
    def switch(s):
        return 2.0 * jax.nn.softmax(s[0])[1] + 5.0 * jax.nn.softmax(s[0])[0]
    assert np.abs(np.asarray(jax.grad(switch)(s))[0] - grad).max() > 1e-2


def test_estimator_formula_random():
    """dL/ds_j = sum_k g_k pi^(k)_{D_k} (1[j = D_k] - pi^(k)_j) on random tokens / draws."""
    eps = 0.15
    s = _logits(4, n=32)
    noise = sample_noise(jax.random.key(9), 32, E)
    coef = jax.random.normal(jax.random.key(2), (32, 2))
    grad = np.asarray(jax.grad(lambda s: jnp.sum(
        coef * sparsemixer_v2(s, jitter_eps=eps, noise=noise).weights_NK))(s))
    ids, _, pis, _ = _np_sparsemixer(s, eps, noise)
    want = np.zeros((32, E))
    for n in range(32):
        for k in range(2):
            pi = pis[n, k]
            d = ids[n, k]
            want[n] += float(coef[n, k]) * pi[d] * (np.eye(E)[d] - pi)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)
    # eval mode: no straight-through, gradient = autodiff of the (unscaled) masked softmax
    ge = np.asarray(jax.grad(lambda s: jnp.sum(
        coef * sparsemixer_v2(s, jitter_eps=eps).weights_NK))(s))
    assert np.isfinite(ge).all()


# ----------------------------------------------------------------------------- training

def test_decoder_train_step_jit():
    slot = GRINConfig(moe=GRIN_MOE.replace(n_experts=4, d_expert=8), jitter_eps=0.1)
    cfg = DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, ffn_slots=(slot,) * 2)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(2 * 9).reshape(2, 9) % 32

    @nnx.jit
    def step(model, tokens, key):
        def loss_fn(model):
            logits, aux = model(tokens, train=True, key=key)
            ce = -jnp.mean(jax.nn.log_softmax(logits[:, :-1]).__getitem__(
                (jnp.arange(2)[:, None], jnp.arange(8)[None], tokens[:, 1:])))
            return ce + aux["aux_loss"], aux
        return nnx.value_and_grad(loss_fn, has_aux=True)(model)

    (loss, aux), grads = step(model, tokens, jax.random.key(0))
    assert np.isfinite(float(loss))
    assert aux["layers"][0]["expert_ids"].shape == (2, 9, 2)
    flat = {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(grads)}
    routers = [k for k in flat if k.endswith("router/w_g")]
    assert len(routers) == 2
    for k, v in flat.items():
        assert np.isfinite(v).all(), k
    for k in routers:
        assert np.abs(flat[k]).max() > 0, k
    logits, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert np.isfinite(np.asarray(logits)).all()
