"""Router losses (moejax.ops.router_losses) against direct numpy on hand-built arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.ops import router_losses as rl

E = 4
# 5 tokens, k = 2; token 3 is padding (its routing must not count).
IDS = np.array([[0, 1], [0, 2], [1, 0], [3, 2], [2, 1]], np.int32)
MASK = np.array([True, True, True, False, True])
LOGITS = np.array([
    [2.0, 1.0, 0.0, -1.0],
    [1.5, -0.5, 1.0, 0.0],
    [0.5, 2.5, -1.0, 0.0],
    [9.0, -9.0, 3.0, 8.0],  # padding: extreme values would dominate if counted
    [0.0, 1.0, 2.0, -2.0],
], np.float64)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


PROBS = _softmax(LOGITS)


def _np_cv2(v, ddof):
    return np.var(v, ddof=ddof) / (np.mean(v) ** 2 + 1e-10)


def _np_gates(ids, probs):
    """Renormalised top-k gate matrix: selected probs / their sum, 0 elsewhere."""
    g = np.zeros_like(probs)
    for n in range(ids.shape[0]):
        sel = probs[n, ids[n]]
        g[n, ids[n]] = sel / sel.sum()
    return g


@pytest.mark.parametrize("use_mask", [False, True])
def test_expert_counts(use_mask):
    mask = MASK if use_mask else np.ones(5, bool)
    want = np.zeros(E)
    for n in range(5):
        for e in IDS[n]:
            want[e] += mask[n]
    got = rl.expert_counts(jnp.asarray(IDS), E, jnp.asarray(mask) if use_mask else None)
    np.testing.assert_allclose(np.asarray(got), want)


@pytest.mark.parametrize("ddof", [0, 1])
def test_cv_squared(ddof):
    v = np.array([3.0, 1.0, 0.0, 4.0])
    got = rl.cv_squared(jnp.asarray(v), ddof=ddof)
    np.testing.assert_allclose(float(got), _np_cv2(v, ddof), rtol=1e-6)
    assert float(rl.cv_squared(jnp.asarray([2.0, 2.0, 2.0]))) == 0.0
    assert float(rl.cv_squared(jnp.asarray([5.0]))) == 0.0  # single expert: 0 like the reference
    # the default is the reference code's unbiased variance (torch.var)
    np.testing.assert_allclose(float(rl.cv_squared(jnp.asarray(v))), _np_cv2(v, 1), rtol=1e-6)


@pytest.mark.parametrize("use_mask", [False, True])
def test_cv2_balance_loss(use_mask):
    mask = MASK if use_mask else np.ones(5, bool)
    gates = _np_gates(IDS, PROBS)
    m = np.zeros(E)
    for n in range(5):
        for e in IDS[n]:
            m[e] += mask[n]
    p = (gates * mask[:, None]).sum(0)
    want = _np_cv2(m, 1) + _np_cv2(p, 1)
    got = rl.cv2_balance_loss(jnp.asarray(IDS), jnp.asarray(gates, jnp.float32),
                              jnp.asarray(mask) if use_mask else None)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


@pytest.mark.parametrize("use_mask", [False, True])
def test_switch_balance_loss(use_mask):
    mask = MASK if use_mask else np.ones(5, bool)
    n_real = mask.sum()
    f = np.zeros(E)
    for n in range(5):
        for e in IDS[n]:
            f[e] += mask[n]
    f /= n_real * IDS.shape[1]
    p = (PROBS * mask[:, None]).sum(0) / n_real
    want = E * np.sum(f * p)
    got = rl.switch_balance_loss(jnp.asarray(IDS), jnp.asarray(PROBS, jnp.float32),
                                 jnp.asarray(mask) if use_mask else None)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_balance_losses_at_uniform_routing():
    # 4 tokens, k = 1, one per expert, uniform probabilities: switch = 1, cv2 = 0.
    ids = jnp.arange(E, dtype=jnp.int32)[:, None]
    probs = jnp.full((E, E), 1.0 / E)
    np.testing.assert_allclose(float(rl.switch_balance_loss(ids, probs)), 1.0, rtol=1e-6)
    gates = jax.nn.one_hot(ids[:, 0], E)
    np.testing.assert_allclose(float(rl.cv2_balance_loss(ids, gates)), 0.0, atol=1e-6)
    # All tokens on one expert with all the mass: switch = E.
    ids0 = jnp.zeros((E, 1), jnp.int32)
    got = rl.switch_balance_loss(ids0, jax.nn.one_hot(ids0[:, 0], E))
    np.testing.assert_allclose(float(got), E, rtol=1e-6)


@pytest.mark.parametrize("use_mask", [False, True])
def test_router_z_loss(use_mask):
    mask = MASK if use_mask else np.ones(5, bool)
    lse = np.log(np.exp(LOGITS).sum(-1))
    want = (lse**2 * mask).sum() / mask.sum()
    got = rl.router_z_loss(jnp.asarray(LOGITS, jnp.float32),
                           jnp.asarray(mask) if use_mask else None)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


@pytest.mark.parametrize("use_mask", [False, True])
def test_gate_mass_selected(use_mask):
    mask = MASK if use_mask else np.ones(5, bool)
    sel = np.array([PROBS[n, IDS[n]].sum() for n in range(5)])
    want = (sel * mask).sum() / mask.sum()
    got = rl.gate_mass_selected(jnp.asarray(IDS), jnp.asarray(PROBS, jnp.float32),
                                jnp.asarray(mask) if use_mask else None)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_padding_values_do_not_matter_and_all_masked_is_finite():
    mask = jnp.asarray(MASK)
    logits2 = LOGITS.copy()
    logits2[3] = [-50.0, 0.0, 50.0, 1.0]
    ids2 = IDS.copy()
    ids2[3] = [0, 1]
    probs2 = _softmax(logits2)
    for fn, a1, a2 in [
        (rl.switch_balance_loss, (IDS, PROBS), (ids2, probs2)),
        (rl.cv2_balance_loss, (IDS, _np_gates(IDS, PROBS)), (ids2, _np_gates(ids2, probs2))),
        (rl.gate_mass_selected, (IDS, PROBS), (ids2, probs2)),
    ]:
        v1 = fn(jnp.asarray(a1[0]), jnp.asarray(a1[1], jnp.float32), mask)
        v2 = fn(jnp.asarray(a2[0]), jnp.asarray(a2[1], jnp.float32), mask)
        np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
    z1 = rl.router_z_loss(jnp.asarray(LOGITS, jnp.float32), mask)
    z2 = rl.router_z_loss(jnp.asarray(logits2, jnp.float32), mask)
    np.testing.assert_allclose(float(z1), float(z2), rtol=1e-6)
    none = jnp.zeros(5, bool)
    for v in (rl.switch_balance_loss(jnp.asarray(IDS), jnp.asarray(PROBS, jnp.float32), none),
              rl.router_z_loss(jnp.asarray(LOGITS, jnp.float32), none),
              rl.cv2_balance_loss(jnp.asarray(IDS), jnp.asarray(PROBS, jnp.float32), none)):
        assert np.isfinite(float(v))


def test_losses_are_differentiable_through_probs_and_logits():
    logits = jnp.asarray(LOGITS, jnp.float32)
    ids = jnp.asarray(IDS)
    mask = jnp.asarray(MASK)
    g_sw = jax.grad(lambda z: rl.switch_balance_loss(ids, jax.nn.softmax(z), mask))(logits)
    g_z = jax.grad(lambda z: rl.router_z_loss(z, mask))(logits)
    for g in (g_sw, g_z):
        assert float(jnp.max(jnp.abs(g))) > 1e-4
        np.testing.assert_array_equal(np.asarray(g[3]), 0.0)  # padding row gets no gradient


def test_a_token_mask_of_another_size_is_refused_not_broadcast():
    """A one-entry mask broadcast over every token (the losses of a batch whose one flag
    said "real"), silently; one of the tokens' size in any shape is taken."""
    ids, probs, logits = jnp.asarray(IDS), jnp.asarray(PROBS), jnp.asarray(LOGITS)
    for bad in (jnp.ones((1,), bool), jnp.ones((4,), bool)):
        for fn in (lambda m: rl.expert_counts(ids, E, m),
                   lambda m: rl.switch_balance_loss(ids, probs, m),
                   lambda m: rl.cv2_balance_loss(ids, probs, m),
                   lambda m: rl.router_z_loss(logits, m),
                   lambda m: rl.gate_mass_selected(ids, probs, m)):
            with pytest.raises(ValueError, match=rf"token mask of shape \({bad.shape[0]},\) "
                               "for 5 routed tokens"):
                fn(bad)
    np.testing.assert_allclose(rl.switch_balance_loss(ids, probs, jnp.asarray(MASK)[None]),
                               rl.switch_balance_loss(ids, probs, jnp.asarray(MASK)))
