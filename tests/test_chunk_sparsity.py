"""BlockFFN losses (moejax.ops.chunk_sparsity) against direct numpy loops: on hand-built arrays
and on drawn batches (hypothesis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.nn.remoe import ReMoEConfig
from moejax.ops import chunk_sparsity as cs
from tests.token_runs import runs, token_batches

# 2 rows x 7 tokens x 3 experts; row 1: two documents (segments 1, 2) then padding.
A0 = np.array([
    [[0.3, -0.2, 0.1], [0.2, 0.4, -0.1], [-0.5, 0.1, 0.2], [0.1, 0.1, 0.1],
     [0.0, -0.3, 0.6], [0.2, 0.2, -0.2], [0.7, -0.1, -0.4]],
    [[-0.2, 0.5, 0.3], [0.4, -0.1, 0.2], [0.1, 0.3, -0.3], [-0.1, -0.2, 0.8],
     [0.5, 0.5, 0.0], [0.3, -0.4, 0.2], [0.2, 0.2, 0.2]],
], np.float32)
MASK = np.array([[1] * 7, [1, 1, 1, 1, 1, 0, 0]], bool)
SEG = np.array([[1] * 7, [1, 1, 1, 2, 2, 0, 0]], np.int32)


def _sig(v):
    return 1 / (1 + np.exp(-v))


def np_al(a0, alpha, mask, seg):
    tot, n = 0.0, 0
    for b, run in runs(mask, seg):
        for t in run[:-1]:
            for e in range(a0.shape[-1]):
                p, q = _sig(alpha * a0[b, t, e]), _sig(alpha * a0[b, t + 1, e])
                tot += -(q * np.log(p) + (1 - q) * np.log(1 - p))
                n += 1
    return tot / n


def np_cs(a1, L, mask, seg, eps=1e-6):
    tot, n = 0.0, 0
    for b, run in runs(mask, seg):
        for c in range(0, len(run), L):
            chunk = run[c:c + L]
            for e in range(a1.shape[-1]):
                s = 0.0
                for t in chunk:
                    den = a1[b, t].sum()
                    p = a1[b, t, e] / den if den > 0 else 0.0
                    s += np.log(1 - min(p, 1 - eps))
                tot += 1 - np.exp(s)
                n += 1
    return tot / n


@pytest.mark.parametrize("use_mask, use_seg", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("alpha", [1.0, 10.0])
def test_activation_locality_matches_numpy(use_mask, use_seg, alpha):
    mask = MASK if use_mask else np.ones_like(MASK)
    seg = SEG if use_seg else np.ones_like(SEG)
    got = cs.activation_locality_loss(jnp.asarray(A0), alpha=alpha,
                                      mask_BT=jnp.asarray(mask) if use_mask else None,
                                      segment_ids_BT=jnp.asarray(seg) if use_seg else None)
    np.testing.assert_allclose(float(got), np_al(A0.astype(np.float64), alpha, mask, seg),
                               rtol=1e-5)


def test_activation_locality_stable_at_large_alpha():
    a0 = jnp.asarray(A0) * 50.0
    v, g = jax.value_and_grad(lambda a: cs.activation_locality_loss(a, alpha=100.0))(a0)
    assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("L", [1, 2, 3, 64])
@pytest.mark.parametrize("use_mask, use_seg", [(False, False), (True, False), (True, True)])
def test_chunk_sparsification_matches_numpy(L, use_mask, use_seg):
    a1 = np.maximum(A0, 0)
    mask = MASK if use_mask else np.ones_like(MASK)
    seg = SEG if use_seg else np.ones_like(SEG)
    got = cs.chunk_sparsification_loss(jnp.asarray(a1), chunk_len=L,
                                       mask_BT=jnp.asarray(mask) if use_mask else None,
                                       segment_ids_BT=jnp.asarray(seg) if use_seg else None)
    np.testing.assert_allclose(float(got), np_cs(a1.astype(np.float64), L, mask, seg),
                               rtol=1e-5)


# The drawn batches' shapes differ: each compiles the loss once, whole (op by op, each of its
# ops would compile for each shape).
_cs_loss = jax.jit(cs.chunk_sparsification_loss, static_argnames=("chunk_len", "eps"))
_al_loss = jax.jit(cs.activation_locality_loss, static_argnames="alpha")


@settings(max_examples=30)
@given(token_batches(max_tokens=8), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_both_losses_equal_the_loops_on_any_batch(batch, L, seed):
    """L_cs and L_al equal the token-by-token loops on any activation pattern, padding and
    document split (with at least one real token and one neighbouring pair)."""
    act, mask, seg = batch
    rng = np.random.default_rng(seed)
    a1 = (act * rng.uniform(0.1, 2.0, act.shape)).astype(np.float32)
    a0 = rng.normal(size=act.shape).astype(np.float32)
    m, sg = jnp.asarray(mask), jnp.asarray(seg)
    if mask.any():
        got = _cs_loss(jnp.asarray(a1), chunk_len=L, mask_BT=m, segment_ids_BT=sg)
        np.testing.assert_allclose(float(got), np_cs(a1.astype(np.float64), L, mask, seg),
                                   rtol=1e-4, atol=1e-6)
    if any(len(run) > 1 for _, run in runs(mask, seg)):
        got = _al_loss(jnp.asarray(a0), alpha=3.0, mask_BT=m, segment_ids_BT=sg)
        np.testing.assert_allclose(float(got), np_al(a0.astype(np.float64), 3.0, mask, seg),
                                   rtol=1e-4, atol=1e-6)


@settings(max_examples=30)
@given(token_batches(max_tokens=8), st.integers(1, 5))
def test_one_hot_routing_makes_the_loss_the_chunks_active_fraction(batch, L):
    """With at most one active expert per token (p is 0 or 1) an expert is active in a chunk
    exactly when one of its tokens picks it: L_cs is the mean over chunks (a run's shorter
    last chunk included) of the fraction of experts the chunk's union holds, 1 - CLS_L of
    the sparsity metrics (moejax.ops.sparsity_metrics) counted over every chunk."""
    act, mask, seg = batch
    first = act & (np.cumsum(act, axis=-1) == 1)  # each token's first active expert, if any
    want = [np.any(first[b, run[c:c + L]], axis=0).mean()
            for b, run in runs(mask, seg) for c in range(0, len(run), L)]
    if not want:
        return
    got = _cs_loss(jnp.asarray(first, jnp.float32), chunk_len=L, mask_BT=jnp.asarray(mask),
                   segment_ids_BT=jnp.asarray(seg), eps=1e-7)
    np.testing.assert_allclose(float(got), np.mean(want), atol=1e-5)


def test_chunk_sparsification_single_active_expert_is_finite():
    # token 0: one active expert (p = 1 -> ln(0) without the clamp); token 1: none active
    a1 = jnp.array([[[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]])
    f = lambda a: cs.chunk_sparsification_loss(jax.nn.relu(a), chunk_len=2)  # noqa: E731
    v, g = jax.value_and_grad(f)(a1)
    assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g)))
    # chunk {0,1}: expert 1 surely active -> P = [0, 1, 0]; chunk {2}: P = [.5, .5, 0]
    np.testing.assert_allclose(float(v), (1.0 + 1.0) / 6, atol=1e-5)


def test_chunk_sparsification_known_value_and_gradient_direction():
    # one chunk of 2 tokens, 2 experts: p = [[.5,.5],[1,0]] -> P = [1-(.5*0), 1-(.5*1)]
    a1 = jnp.array([[[1.0, 1.0], [3.0, 0.0]]])
    v = cs.chunk_sparsification_loss(a1, chunk_len=2, eps=1e-9)
    np.testing.assert_allclose(float(v), (1.0 + 0.5) / 2, atol=1e-6)


def test_l1_and_entropy_match_numpy():
    a1 = np.maximum(A0, 0).astype(np.float64)
    a1[0, 3] = 0.0  # a real token with no active expert: no entropy to average
    m = MASK
    l1 = sum(a1[b, t].sum() for b in range(2) for t in range(7) if m[b, t]) / m.sum()
    ents = []
    for b in range(2):
        for t in range(7):
            if m[b, t] and a1[b, t].sum() > 0:
                p = a1[b, t] / a1[b, t].sum()
                ents.append(-sum(x * np.log(x) for x in p if x > 0))
    got_l1 = cs.l1_activation_loss(jnp.asarray(a1, jnp.float32), mask_BT=jnp.asarray(m))
    got_h = cs.router_entropy_loss(jnp.asarray(a1, jnp.float32), mask_BT=jnp.asarray(m))
    np.testing.assert_allclose(float(got_l1), l1, rtol=1e-5)
    np.testing.assert_allclose(float(got_h), np.mean(ents), rtol=1e-5)


def test_chunk_starts_respect_documents():
    st = cs.chunk_starts(jnp.asarray(MASK), jnp.asarray(SEG), MASK.shape, 2)
    want = np.array([[1, 0, 1, 0, 1, 0, 1], [1, 0, 1, 1, 0, 0, 0]], bool)
    np.testing.assert_array_equal(np.asarray(st), want)
    with pytest.raises(ValueError, match="chunk_len"):
        cs.chunk_starts(None, None, (1, 3), 0)


def test_load_balanced_l1_matches_numpy_and_weights_busy_experts():
    rng = np.random.default_rng(0)
    a = np.maximum(rng.normal(size=(2, 5, 4)) + np.array([1.0, 0.0, -0.5, -1.0]), 0)
    a = a.astype(np.float32)
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    real = a[mask]  # [T, E]
    T, E, k = real.shape[0], 4, 1.5
    f = (real > 0).sum(0) / (T * k)
    want = E * np.sum(real.mean(0) * f)
    got = cs.load_balanced_l1_loss(jnp.asarray(a), k=k, mask_BT=jnp.asarray(mask))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    # the frequency is a constant: d loss / d A[t, e] = E f_e / T on real tokens, 0 on padding
    g = jax.grad(lambda x: cs.load_balanced_l1_loss(x, k=k, mask_BT=jnp.asarray(mask)))(
        jnp.asarray(a))
    np.testing.assert_allclose(np.asarray(g)[mask], np.broadcast_to(E * f / T, real.shape),
                               rtol=1e-5)
    assert np.all(np.asarray(g)[~mask] == 0)
    assert np.argmax(f) == 0  # the busiest expert gets the largest push
    # every expert equally busy with k active per token: equals the plain L1
    even = np.zeros((1, 4, 4), np.float32)
    for t in range(4):
        even[0, t, [t, (t + 1) % 4]] = rng.uniform(0.5, 1.5, 2)
    np.testing.assert_allclose(float(cs.load_balanced_l1_loss(jnp.asarray(even), k=2.0)),
                               float(cs.l1_activation_loss(jnp.asarray(even))), rtol=1e-6)
    with pytest.raises(ValueError, match="k="):
        cs.load_balanced_l1_loss(jnp.asarray(a), k=0.0)


def test_remoe_slot_reports_the_load_balanced_l1():
    from flax import nnx

    layer = ReMoEConfig(n_experts=4, d_expert=8, l1_k=1.0).build(6, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 6))
    _, aux = layer(x)
    a1 = jnp.maximum(jnp.einsum("btd,de->bte", x, layer.router.w[...]), 0)
    np.testing.assert_allclose(float(aux["l1_loss"]),
                               float(cs.load_balanced_l1_loss(a1, k=1.0)), rtol=1e-5)


def test_activation_locality_pulls_on_both_tokens_of_a_pair():
    """Eq. 4's target sigma(alpha A0[t+1]) is not detached (as BCE-with-logits on a soft target
    in the official training code): the last token, which is only ever a target, gets a
    gradient, equal to a central difference of the loss."""
    a0 = jnp.asarray(A0[:1] * 0.05)
    f = lambda a: cs.activation_locality_loss(a, alpha=10.0)  # noqa: E731
    g = np.asarray(jax.grad(f)(a0))
    assert np.abs(g[0, -1]).max() > 1e-4
    e = np.zeros(A0[:1].shape, np.float32)
    e[0, -1, 0] = 1e-2
    fd = (float(f(a0 + e)) - float(f(a0 - e))) / 2e-2
    np.testing.assert_allclose(g[0, -1, 0], fd, rtol=2e-2)
