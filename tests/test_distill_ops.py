"""Distillation divergences against numpy definitions, and the teacher routing modes:
ALL equals the dense-mixture oracle, KA's expert sets follow the stated distribution, top-k
is the trained routing, and rerouting never changes the trained teacher."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.distill.routing_modes import RoutingMode, route_with_mode, with_routing
from moejax.nn.ffn import DenseFFN, DenseFFNConfig
from moejax.nn.moe import MoE, MoEConfig
from moejax.ops.distill_losses import (
    check_same_vocab,
    distill_divergence,
    forward_kl,
    generalized_jsd,
    reverse_kl,
)
from moejax.ops.losses import accuracy, cross_entropy, token_cross_entropy


def _np_logsoftmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_kl(la, lb):
    return (np.exp(la) * (la - lb)).sum(-1)


def test_divergences_match_numpy_and_mask_prompt_and_padding():
    rng = np.random.default_rng(0)
    t, s = rng.normal(size=(3, 5, 7)), rng.normal(size=(3, 5, 7))
    mask = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], np.float32)
    lp, lq = _np_logsoftmax(t), _np_logsoftmax(s)
    fkl, rkl = _np_kl(lp, lq), _np_kl(lq, lp)
    beta = 0.3
    lm = np.log(beta * np.exp(lp) + (1 - beta) * np.exp(lq))
    jsd = beta * _np_kl(lp, lm) + (1 - beta) * _np_kl(lq, lm)
    for _name, fn, ref in (("fkl", forward_kl, fkl), ("rkl", reverse_kl, rkl),
                          ("jsd", lambda a, b, m, r: generalized_jsd(a, b, m, beta, r), jsd)):
        tok = float(fn(t, s, mask, "token"))
        np.testing.assert_allclose(tok, (ref * mask).sum() / mask.sum(), rtol=1e-5)
        seq = float(fn(t, s, mask, "sequence"))
        rows = [(ref[b] * mask[b]).sum() / mask[b].sum() for b in range(2)]  # row 2 is empty
        np.testing.assert_allclose(seq, np.mean(rows), rtol=1e-5)
        assert tok != pytest.approx(seq)  # rows of different lengths weigh differently
    # changing masked-out logits changes nothing
    t2 = t.copy()
    t2[:, :2] += 5.0
    np.testing.assert_allclose(float(forward_kl(t2, s, mask)), float(forward_kl(t, s, mask)),
                               rtol=1e-6)
    assert float(reverse_kl(t, t, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_divergence("jsd", t, t, mask)) == pytest.approx(0.0, abs=1e-6)


def test_a_token_without_mass_adds_nothing_to_value_or_gradient():
    """A ``-inf`` logit (a masked or padded vocabulary entry) is a token of zero probability:
    it adds ``0 * log 0 = 0`` to a divergence where it weighs, so forward KL and the
    (bounded) JSD stay finite and equal the divergence over the other tokens, with finite
    student gradients; reverse KL is infinite only where the student gives it mass."""
    rng = np.random.default_rng(1)
    t, s = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 6))
    t[..., 2] = -np.inf                       # the teacher never emits token 2
    mask = np.ones((2, 3), np.float32)
    lp, lq = _np_logsoftmax(t), _np_logsoftmax(s)
    keep = np.arange(6) != 2
    fkl = (np.exp(lp[..., keep]) * (lp[..., keep] - lq[..., keep])).sum(-1).mean()
    beta = 0.4
    lm = np.log(beta * np.exp(lp) + (1 - beta) * np.exp(lq))
    jsd = (beta * (np.exp(lp[..., keep]) * (lp[..., keep] - lm[..., keep])).sum(-1)
           + (1 - beta) * _np_kl(lq, lm)).mean()
    t_j, s_j = jnp.asarray(t, jnp.float32), jnp.asarray(s, jnp.float32)
    for fn, ref in ((forward_kl, fkl),
                    (lambda a, b, m: generalized_jsd(a, b, m, beta), jsd)):
        np.testing.assert_allclose(float(fn(t_j, s_j, mask)), ref, rtol=1e-5)
        grad = jax.grad(lambda x, fn=fn: fn(t_j, x, mask))(s_j)
        assert bool(jnp.all(jnp.isfinite(grad)))
    assert float(forward_kl(t_j, t_j, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(reverse_kl(t_j, s_j, mask)) == np.inf   # the student gives token 2 mass
    s_masked = s_j.at[..., 2].set(-jnp.inf)          # and once it gives none, it is finite
    rkl = (np.exp(lq_m := _np_logsoftmax(np.where(keep, s, -np.inf)))[..., keep]
           * (lq_m[..., keep] - lp[..., keep])).sum(-1).mean()
    np.testing.assert_allclose(float(reverse_kl(t_j, s_masked, mask)), rkl, rtol=1e-5)


def test_vocab_mismatch_names_both_sizes():
    with pytest.raises(ValueError, match="vocabulary of 10 tokens and student of 12"):
        forward_kl(jnp.zeros((1, 2, 10)), jnp.zeros((1, 2, 12)), jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="SmolLM2.*49152.*byte LM.*256"):
        check_same_vocab(49152, 256, "SmolLM2", "byte LM")


def test_positions_that_do_not_pair_up_are_refused_not_broadcast():
    """A mask, targets or student logits of another shape than the positions they weigh (a
    ``[B, 1]`` mask, one target or student position per row) would broadcast: every position
    weighted and the mean taken over the wrong count. Each is refused, naming both shapes."""
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    targets, mask = jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5))
    for bad_mask in (jnp.ones((2, 1)), jnp.ones((5,)), jnp.ones((2, 4))):
        for fn in (cross_entropy, accuracy):
            with pytest.raises(ValueError, match=rf"{fn.__name__}: a mask of shape "
                               rf"\({bad_mask.shape[0]},"):
                fn(logits, targets, bad_mask)
        for div in (forward_kl, reverse_kl, generalized_jsd):
            with pytest.raises(ValueError, match="a mask of shape .* for positions of shape "
                               r"\(2, 5\)"):
                div(logits, logits, bad_mask)
    for bad_targets in (jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 6), jnp.int32)):
        with pytest.raises(ValueError, match=r"targets of shape .* for logits of shape "
                           r"\(2, 5, 7\)"):
            cross_entropy(logits, bad_targets, None)
        with pytest.raises(ValueError, match="token_cross_entropy: targets of shape"):
            token_cross_entropy(logits, bad_targets)
    with pytest.raises(ValueError, match="targets of dtype float32; give integer"):
        cross_entropy(logits, jnp.full((2, 5), 0.7), mask)  # soft labels, truncated to id 0
    with pytest.raises(ValueError, match=r"student logits of shape \(2, 1, 7\)"):
        forward_kl(logits, logits[:, :1], mask)
    # what pairs up still works, classifier shapes included
    assert np.isfinite(float(cross_entropy(logits, targets, mask)))
    assert np.isfinite(float(forward_kl(logits[:, 0], logits[:, 1], jnp.ones((2,)))))


def _moe(router="noisy", n=4, k=2):
    cfg = MoEConfig(n_experts=n, top_k=k, d_expert=8, router=router, dispatch="dense",
                    activation="swiglu", balance_loss="cv2")
    return MoE(cfg, 6, rngs=nnx.Rngs(0))


def test_all_mode_equals_dense_mixture_oracle():
    slot = _moe()
    x = jax.random.normal(jax.random.key(1), (2, 5, 6))
    routed = with_routing(slot, RoutingMode(mode="all"))
    y, _ = routed(x)
    w_up, w_down, w_gate = slot.experts.weights()
    x_ND = np.asarray(x.reshape(-1, 6), np.float64)
    logits = x_ND @ np.asarray(slot.router.w_g[...], np.float64)
    p = np.exp(_np_logsoftmax(logits))
    want = np.zeros_like(x_ND)
    for e in range(4):
        g = x_ND @ np.asarray(w_gate[e], np.float64)
        h = (g / (1 + np.exp(-g))) * (x_ND @ np.asarray(w_up[e], np.float64))
        want += p[:, e:e + 1] * (h @ np.asarray(w_down[e], np.float64))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 6), want, rtol=2e-4, atol=2e-5)
    # top-k mode reproduces the trained routing exactly; the teacher itself is unchanged
    y_top, _ = with_routing(slot, RoutingMode())(x)
    np.testing.assert_allclose(np.asarray(y_top), np.asarray(slot(x)[0]), rtol=1e-6)
    assert type(slot.router).__name__ == "NoisyTopKRouter" and slot.top_k == 2


def _pl_last_probs(p):
    """P(expert j is excluded) when N-1 of N are drawn from p without replacement."""
    n = len(p)
    out = np.zeros(n)
    for order in itertools.permutations(range(n)):
        pr, left = 1.0, 1.0
        for i in order[:-1]:
            pr *= p[i] / left
            left -= p[i]
        out[order[-1]] += pr
    return out


def test_ka_expert_sets_have_the_stated_distribution():
    """Per token: w.p. lambda N-1 experts drawn from softmax(H) without replacement, else the
    top N-1. The excluded expert's frequencies over 20000 tokens pass a chi-square test, and
    the weights are the softmax over the selected logits."""
    logits = jnp.array([1.0, 0.2, -0.5, 0.6])
    n_tok, lam = 20000, 0.3
    r = route_with_mode(jnp.tile(logits, (n_tok, 1)), RoutingMode(mode="ka", ka_lambda=lam),
                        trained_k=2, renormalize=True, key=jax.random.key(0))
    ids = np.asarray(r.ids_NK)
    assert ids.shape == (n_tok, 3) and all(len(set(row)) == 3 for row in ids[:200])
    excluded = 6 - ids.sum(-1)
    p = np.exp(_np_logsoftmax(np.asarray(logits, np.float64)))
    want = lam * _pl_last_probs(p)
    want[int(np.argmin(np.asarray(logits)))] += 1 - lam
    counts = np.bincount(excluded, minlength=4)
    chi2 = float(((counts - n_tok * want) ** 2 / (n_tok * want)).sum())
    assert chi2 < 16.3, (counts, n_tok * want)  # chi2(3 dof) 0.999 quantile = 16.27
    sel = np.asarray(logits)[ids[0]]
    np.testing.assert_allclose(np.asarray(r.weights_NK[0]), np.exp(sel) / np.exp(sel).sum(),
                               rtol=1e-6)
    # different keys give different augmentations; lambda = 0 is the deterministic top N-1
    r0 = route_with_mode(jnp.tile(logits, (50, 1)), RoutingMode(mode="ka", ka_lambda=0.0),
                         trained_k=2, renormalize=True, key=jax.random.key(5))
    assert (np.sort(np.asarray(r0.ids_NK), -1) == [0, 1, 3]).all()
    with pytest.raises(ValueError, match="needs a PRNG key"):
        route_with_mode(logits[None], RoutingMode(mode="ka"), trained_k=2, renormalize=True)
    with pytest.raises(ValueError, match="keeps N-1 experts and needs N >= 2"):
        route_with_mode(logits[None, :1], RoutingMode(mode="ka"), trained_k=1,
                        renormalize=True, key=jax.random.key(0))


def test_with_routing_needs_an_moe():
    dense = DenseFFN(DenseFFNConfig(d_hidden=8, activation="swiglu"), 6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no MoE slot"):
        with_routing(dense, RoutingMode(mode="all"))
