"""Speculative decoding (moejax.nn.speculative) against its oracles: greedy output equals
greedy autoregressive decoding token for token (several prompts and draft lengths, with and
without chunk-sparse verification); sampled output has the target's distribution (a
chi-square test on a tiny vocabulary); rollback equals a cache built from the kept tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.speculative import (
    accept_sampled,
    chunk_sparse_target,
    rollback,
    speculative_decoder,
    speculative_generate,
)

V = 12


@nnx.jit
def _decode(model, tokens, cache):
    """``model.decode`` compiled whole (run op by op it compiles each op for each shape)."""
    return model.decode(tokens, cache)


def _model(slot, seed, vocab=V, layers=2, init_std=1.0):
    cfg = DecoderConfig(vocab_size=vocab, d_model=16, n_layers=layers, n_heads=2,
                        ffn_slots=(slot,) * layers, max_seq_len=64, init_std=init_std)
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def models():
    target = _model(BlockFFNConfig(n_experts=8, d_expert=8), 0)
    near = nnx.merge(*nnx.split(target), copy=True)  # a draft that agrees often
    for _, m in nnx.iter_modules(near):
        if hasattr(m, "w") and isinstance(m.w, nnx.Param):
            m.w = nnx.Param(m.w[...] + 0.3 * jax.random.normal(jax.random.key(5), m.w.shape))
    far = _model(DenseFFNConfig(d_hidden=16, activation="swiglu"), 7, layers=1)
    return target, near, far


@pytest.mark.parametrize("draft_len", [1, 3, 5])
@pytest.mark.parametrize("draft_name", ["near", "far"])
def test_greedy_speculative_equals_greedy_autoregressive(models, draft_len, draft_name):
    target, near, far = models
    draft = near if draft_name == "near" else far
    prompts = jax.random.randint(jax.random.key(draft_len), (3, 5), 0, V)
    want = generate(target, prompts, 17)
    got = speculative_generate(target, draft, prompts, 17, draft_len=draft_len)
    np.testing.assert_array_equal(np.asarray(got.tokens_BS), np.asarray(want))
    sparse = speculative_generate(chunk_sparse_target(target, draft_len), draft, prompts, 17,
                                  draft_len=draft_len)
    np.testing.assert_array_equal(np.asarray(sparse.tokens_BS), np.asarray(want))
    rounds, acc = np.asarray(got.rounds_B), np.asarray(got.accepted_B)
    assert np.all(rounds >= 1) and np.all(acc + rounds >= 17)  # every round commits a + 1
    assert np.all(acc <= rounds * draft_len)
    assert int(np.sum(got.accept_hist_N)) == int(np.sum(rounds))
    if draft_name == "near":
        assert float(got.mean_accepted_length) > 1.0  # drafts do get accepted


@pytest.mark.parametrize("prompt_len", [1, 2])
def test_short_prompts_decode_as_autoregressive(models, prompt_len):
    """One token: the first new token comes from a target step before the loop; two: the
    draft's cache starts empty (the loop's first draft pass takes both)."""
    target, near, _ = models
    prompts = jax.random.randint(jax.random.key(9), (3, prompt_len), 0, V)
    want = np.asarray(generate(target, prompts, 11))
    for n in (1, 4):
        got = speculative_generate(target, near, prompts, 11, draft_len=n)
        np.testing.assert_array_equal(np.asarray(got.tokens_BS), want)
        first = int(prompt_len == 1)  # not a round: committed before the loop
        assert np.all(np.asarray(got.accepted_B + got.rounds_B) >= 11 - first)
    one = speculative_generate(target, near, prompts, 1, draft_len=2)
    np.testing.assert_array_equal(np.asarray(one.tokens_BS), want[:, :prompt_len + 1])


def test_a_draft_equal_to_the_target_is_always_accepted(models):
    target = models[0]
    prompts = jax.random.randint(jax.random.key(1), (2, 4), 0, V)
    out = speculative_generate(target, target, prompts, 12, draft_len=3)
    np.testing.assert_array_equal(np.asarray(out.tokens_BS),
                                  np.asarray(generate(target, prompts, 12)))
    assert np.all(np.asarray(out.accept_hist_N)[:-1] == 0)  # a = n in every round
    assert float(out.mean_accepted_length) == 4.0


class _CountingLM(DecoderLM):
    """A decoder that counts its decode passes at run time (one per call, whatever T)."""

    passes: list = []

    def decode(self, tokens_BT, cache, positions_BT=None):
        jax.debug.callback(lambda: _CountingLM.passes.append(tokens_BT.shape[1]))
        return super().decode(tokens_BT, cache, positions_BT)


def test_a_draft_of_n_tokens_costs_n_draft_passes(models):
    """Every round's draft work is n passes (the first over two tokens), plus one prefill."""
    target = models[0]
    counting = _CountingLM(target.cfg, rngs=nnx.Rngs(0))
    nnx.update(counting, nnx.state(target))  # the target itself: every draft is accepted
    prompt = jax.random.randint(jax.random.key(3), (1, 5), 0, V)
    for n in (1, 3):
        _CountingLM.passes.clear()
        out = speculative_generate(target, counting, prompt, 12, draft_len=n)
        jax.effects_barrier()
        rounds = int(out.rounds_B[0])
        assert rounds == -(-12 // (n + 1))
        assert _CountingLM.passes == [3] + [2, *[1] * (n - 1)] * rounds


def test_sampled_speculative_decoding_has_the_targets_distribution(models):
    target, _, far = models
    B, temp = 6000, 1.5
    prompt = jnp.tile(jnp.asarray([[3, 1, 4]], jnp.int32), (B, 1))
    out = speculative_generate(target, far, prompt, 2, draft_len=2, key=jax.random.key(11),
                               temperature=temp)
    toks = np.asarray(out.tokens_BS)[:, 3:5]
    # exact joint of the first two tokens under the target
    logits, cache = _decode(target, prompt[:1], target.init_cache(1, 8))
    p1 = np.asarray(jax.nn.softmax(logits[0, -1] / temp))
    joint = np.zeros((V, V))
    for t in range(V):
        l2, _ = _decode(target, jnp.asarray([[t]]), cache)
        joint[t] = p1[t] * np.asarray(jax.nn.softmax(l2[0, 0] / temp))
    counts = np.zeros((V, V))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    expected = joint * B
    cells = expected > 5  # chi-square over the well-populated cells, the rest pooled
    obs = np.append(counts[cells], counts[~cells].sum())
    exp = np.append(expected[cells], expected[~cells].sum())
    chi2 = float(np.sum((obs - exp) ** 2 / exp))
    dof = len(obs) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # ~ 3.5 sigma
    assert 0 < int(np.asarray(out.accept_hist_N)[0]) < B  # rejections and acceptances both


def test_the_rejection_rule_draws_each_outcome_from_its_distribution():
    """``accept_sampled`` on fixed logits: a draft equal to the target is always accepted and
    the bonus token is drawn from ``p_n``; a draft whose first token the target never emits
    is rejected at once and the token is drawn from ``norm(max(0, p_0 - q_0))``."""
    rng = np.random.default_rng(0)
    B, n, temp = 20000, 2, 1.0
    tgt = jnp.asarray(rng.normal(size=(1, n + 1, 5)) * 1.5, jnp.float32)
    tgt_B = jnp.tile(tgt, (B, 1, 1))
    drafts = jnp.asarray(rng.integers(0, 5, (B, n)), jnp.int32)

    def freq(x):
        return np.bincount(np.asarray(x), minlength=5) / B

    a, x = accept_sampled(jax.random.key(1), drafts, tgt_B[:, :n], tgt_B, temp)
    assert np.all(np.asarray(a) == n)
    p = np.asarray(jax.nn.softmax(tgt[0] / temp), np.float64)
    np.testing.assert_allclose(freq(x), p[n], atol=4 * np.sqrt(0.25 / B))
    never = tgt_B.at[:, 0, 0].set(-1e9)  # the target never emits token 0 first
    draft_logits = tgt_B[:, :n].at[:, 0, 0].set(3.0)
    a, x = accept_sampled(jax.random.key(2), drafts.at[:, 0].set(0), draft_logits, never, temp)
    assert np.all(np.asarray(a) == 0)
    q0 = np.asarray(jax.nn.softmax(draft_logits[0, 0] / temp), np.float64)
    p0 = np.asarray(jax.nn.softmax(never[0, 0] / temp), np.float64)
    resid = np.maximum(p0 - q0, 0.0)
    np.testing.assert_allclose(freq(x), resid / resid.sum(), atol=4 * np.sqrt(0.25 / B))


def test_rollback_equals_the_cache_of_the_kept_tokens(models):
    target = models[0]
    toks = jax.random.randint(jax.random.key(2), (2, 9), 0, V)
    _, longer = _decode(target, toks, target.init_cache(2, 16))
    kept = jnp.asarray([4, 7], jnp.int32)
    rolled = rollback(longer, kept)
    for row, k in enumerate(np.asarray(kept)):
        _, ref = _decode(target, toks[row:row + 1, :k], target.init_cache(1, 16))
        for c_roll, c_ref in zip(rolled, ref):
            assert int(c_roll.lengths_B[row]) == k
            np.testing.assert_allclose(np.asarray(c_roll.k_BSGJ[row, :k]),
                                       np.asarray(c_ref.k_BSGJ[0, :k]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(c_roll.v_BSGJ[row, :k]),
                                       np.asarray(c_ref.v_BSGJ[0, :k]), rtol=1e-5, atol=1e-6)
        # the next step sees only the kept tokens
        nxt = jnp.asarray([[5]])
        got, _ = _decode(target, nxt, tuple(c._replace(k_BSGJ=c.k_BSGJ[row:row + 1],
                                                     v_BSGJ=c.v_BSGJ[row:row + 1],
                                                     lengths_B=c.lengths_B[row:row + 1])
                                          for c in rolled))
        want, _ = _decode(target, nxt, ref)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_fix(models):
    target, _, _ = models
    other = _model(DenseFFNConfig(d_hidden=8, activation="relu"), 1, vocab=V + 1, layers=1)
    p = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="one tokenizer"):
        speculative_generate(target, other, p, 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        speculative_generate(target, target, p, 60)
    with pytest.raises(ValueError, match="key="):
        speculative_generate(target, target, p, 4, temperature=1.0)


def test_a_decoder_splits_the_models_once_and_decodes_like_generate(models, monkeypatch):
    """speculative_decoder: every call equals speculative_generate's, for prompts of other
    lengths and for sampling with a key; the models are split when it is made, not per
    call."""
    target, near, _ = models
    decode = speculative_decoder(target, near, 9, draft_len=3)
    splits = []
    real = nnx.split
    monkeypatch.setattr(nnx, "split", lambda *a, **k: splits.append(1) or real(*a, **k))
    for T in (1, 4, 6):
        prompts = jax.random.randint(jax.random.key(T), (2, T), 0, V)
        got = decode(prompts)
        want = speculative_generate(target, near, prompts, 9, draft_len=3)
        np.testing.assert_array_equal(np.asarray(got.tokens_BS), np.asarray(want.tokens_BS))
        np.testing.assert_array_equal(np.asarray(got.rounds_B), np.asarray(want.rounds_B))
    assert len(splits) == 2 * 3  # speculative_generate's own splits, none of the decoder's
    key = jax.random.key(3)
    sampled = speculative_decoder(target, near, 9, draft_len=3, temperature=1.0)
    np.testing.assert_array_equal(
        np.asarray(sampled(prompts, key).tokens_BS),
        np.asarray(speculative_generate(target, near, prompts, 9, draft_len=3, key=key,
                                        temperature=1.0).tokens_BS))
    with pytest.raises(ValueError, match="key="):
        sampled(prompts)
    with pytest.raises(ValueError, match="max_seq_len"):
        decode(jnp.zeros((1, 50), jnp.int32))
    with pytest.raises(ValueError, match="draft_len"):
        speculative_decoder(target, near, 9, draft_len=0)
    # float counts were truncated (draft_len 2.5 ran drafts of 2, 9.9 new tokens ran 9)
    with pytest.raises(ValueError, match="draft_len=2.5 must be an integer >= 1"):
        speculative_decoder(target, near, 9, draft_len=2.5)
    with pytest.raises(ValueError, match="max_new_tokens=9.9 must be an integer >= 1"):
        speculative_decoder(target, near, 9.9)


def test_each_round_draws_with_its_own_key():
    """A target and draft of uniform logits accept every draft, so each round's tokens are
    its fresh draws: no two rounds of a row may repeat (a round key reused would repeat
    them; by chance: V^-4 per pair of rounds)."""
    model = _model(DenseFFNConfig(d_hidden=16, activation="swiglu"), 3, layers=1)
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    prompt = jnp.zeros((4, 3), jnp.int32)
    n, rounds = 3, 4
    out = speculative_generate(model, model, prompt, rounds * (n + 1), draft_len=n,
                               key=jax.random.key(2), temperature=1.0)
    assert np.all(np.asarray(out.rounds_B) == rounds)
    per_round = np.asarray(out.tokens_BS)[:, 3:].reshape(4, rounds, n + 1)
    for row in per_round:
        assert len({tuple(r) for r in row}) == rounds, row
