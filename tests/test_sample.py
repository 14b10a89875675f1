"""Batched jitted sampling (moejax.nn.sample) against the per-row Python-loop oracle
(moejax.nn.generate), nucleus filtering against its definition, and the sampled distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.moe import MoEConfig
from moejax.nn.sample import sample, sampler, top_p_filter


def _lm(moe: bool = False, vocab: int = 32):
    slot = (MoEConfig(n_experts=4, top_k=2, d_expert=16, dispatch="dense") if moe
            else DenseFFNConfig(d_hidden=32, activation="swiglu"))
    cfg = DecoderConfig(vocab_size=vocab, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                        max_seq_len=32, ffn_slots=(slot, slot))
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_batched_equals_each_row_alone(moe):
    model = _lm(moe)
    rng = np.random.default_rng(0)
    lens = np.array([3, 7, 1, 5])
    prompts = rng.integers(1, 32, (4, 7)).astype(np.int32)
    out = sample(model, prompts, lens, 6, key=jax.random.key(0), temperature=0.0)
    toks, resp = np.asarray(out.tokens_BS), np.asarray(out.response_mask_BS)
    for b, n in enumerate(lens):
        want = np.asarray(generate(model, prompts[b:b + 1, :n], 6))[0]
        np.testing.assert_array_equal(toks[b, :n + 6], want)
        assert resp[b].sum() == 6 and resp[b, n:n + 6].all() and not resp[b, :n].any()
        assert (toks[b, n + 6:] == 0).all()
    np.testing.assert_array_equal(np.asarray(out.lengths_B), lens + 6)


def test_padding_and_finished_rows_take_no_moe_capacity():
    """Under a top-k MoE that drops what overflows an expert's capacity, what one row's
    padding holds and the filler a finished row feeds change no other row's tokens (both are
    masked out of the FFN slots); generate's finished rows likewise (its filler is eos_id:
    sample's tokens with pad_id = eos_id)."""
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, dispatch="capacity", capacity_factor=1.0)
    cfg = DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                        max_seq_len=32, ffn_slots=(moe, moe))
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)  # drops that the padding and the filler changed, unmasked
    prompts = rng.integers(1, 32, (2, 8)).astype(np.int32)
    other = prompts.copy()
    other[0, 2:] = rng.integers(1, 32, 6)  # row 0's padding, past its 2 prompt tokens

    def rows(prompts, lens, **kw):
        return np.asarray(sample(model, prompts, np.array(lens), 8, key=jax.random.key(0),
                                 temperature=0.0, **kw).tokens_BS)

    np.testing.assert_array_equal(rows(prompts, [2, 8])[1], rows(other, [2, 8])[1])
    eos = int(rows(prompts, [8, 8])[0, 8])  # row 0 ends at its first new token
    finished = rows(prompts, [8, 8], eos_id=eos, pad_id=eos)
    assert (finished[0, 8:] == eos).all() and eos not in finished[1, 8:]
    np.testing.assert_array_equal(rows(prompts, [8, 8], eos_id=eos, pad_id=0)[1], finished[1])
    np.testing.assert_array_equal(np.asarray(generate(model, prompts, 8, eos_id=eos)), finished)


def test_eos_stops_rows_and_masks_after_eos():
    model = _lm()
    prompts = np.array([[5, 6, 7], [8, 9, 0]], np.int32)
    lens = np.array([3, 2])
    free = sample(model, prompts, lens, 8, key=jax.random.key(1), temperature=0.0)
    eos = int(np.asarray(free.tokens_BS)[0, 3 + 2])  # row 0's third new token becomes EOS
    out = sample(model, prompts, lens, 8, key=jax.random.key(1), temperature=0.0, eos_id=eos,
                 pad_id=0)
    toks, resp = np.asarray(out.tokens_BS), np.asarray(out.response_mask_BS)
    for b, n in enumerate(lens):
        gen = toks[b, n:][resp[b, n:]]
        hit = np.flatnonzero(gen == eos)
        if hit.size:  # the response ends at its first EOS; nothing after it is generated
            assert len(gen) == hit[0] + 1
            assert not resp[b, n + hit[0] + 1:].any() and (toks[b, n + hit[0] + 1:] == 0).all()
    assert resp[0].sum() <= 3
    np.testing.assert_array_equal(np.asarray(out.lengths_B), lens + resp.sum(1))
    # a prompt block padded with real token ids: after an early EOS only pad follows
    padded = np.array([[5, 6, 7, 7, 7, 7]], np.int32)
    first = int(np.asarray(sample(model, padded, np.array([2]), 4, key=jax.random.key(1),
                                  temperature=0.0).tokens_BS)[0, 2])
    out = sample(model, padded, np.array([2]), 4, key=jax.random.key(1), temperature=0.0,
                 eos_id=first)
    np.testing.assert_array_equal(np.asarray(out.tokens_BS)[0], [5, 6, first] + [0] * 7)
    assert int(out.lengths_B[0]) == 3


def test_top_p_filter_keeps_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.2, 0.1], [0.05, 0.9, 0.03, 0.02]]))
    kept = np.isfinite(np.asarray(top_p_filter(logits, 0.6)))
    # row 0: 0.5 (mass before 0) and one 0.2 (mass before 0.5 < 0.6); the tie goes to index 1
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0], [0, 1, 0, 0]])
    assert np.isfinite(np.asarray(top_p_filter(logits, 1.0))).all()
    # the set stops once its mass reaches top_p exactly (0.5 + 0.25: float-exact here)
    exact = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.125]]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(top_p_filter(exact, 0.75))),
                                  [[1, 1, 0, 0]])
    # top_p just below 1 still drops a token whose mass lies past it
    tail = jnp.log(jnp.array([[0.997, 0.003]]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(top_p_filter(tail, 0.995))), [[1, 0]])


def test_temperature_scales_the_logits_before_sampling():
    """Temperature 0.5: the first sampled token follows ``softmax(logits / 0.5)`` (chi-square
    at the 1e-3 level), not the model's own softmax."""
    model = _lm(vocab=8)
    prompt = np.array([[1, 2, 3]], np.int32)
    n = 4000
    out = sample(model, np.repeat(prompt, n, 0), np.full(n, 3), 1, key=jax.random.key(5),
                 temperature=0.5)
    logits = model(jnp.asarray(prompt))[0][0, -1]
    counts = np.bincount(np.asarray(out.tokens_BS)[:, 3], minlength=8)

    def chi2(probs):
        return float(((counts - n * probs) ** 2 / (n * probs)).sum())

    assert chi2(np.asarray(jax.nn.softmax(logits / 0.5))) < 24.3  # chi2(7 dof) 0.999 quantile
    assert chi2(np.asarray(jax.nn.softmax(logits))) > 24.3


def test_sampled_first_token_follows_the_model_distribution():
    """Temperature 1, top_p 1: the first sampled token's frequencies over 4000 rows match the
    model's next-token softmax (chi-square at the 1e-3 level, tiny vocabulary)."""
    model = _lm(vocab=8)
    prompt = np.array([[1, 2, 3]], np.int32)
    n = 4000
    out = sample(model, np.repeat(prompt, n, 0), np.full(n, 3), 1, key=jax.random.key(3))
    first = np.asarray(out.tokens_BS)[:, 3]
    probs = np.asarray(jax.nn.softmax(model(jnp.asarray(prompt))[0][0, -1]))
    counts = np.bincount(first, minlength=8)
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 24.3, (chi2, counts, n * probs)  # chi2(7 dof) 0.999 quantile = 24.32
    # top_p: tokens outside the nucleus never appear
    out = sample(model, np.repeat(prompt, n, 0), np.full(n, 3), 1, key=jax.random.key(4),
                 top_p=0.5)
    kept = np.isfinite(np.asarray(top_p_filter(jnp.log(jnp.asarray(probs))[None], 0.5)))[0]
    assert kept[np.asarray(out.tokens_BS)[:, 3]].all()


def test_bad_arguments_raise():
    model = _lm()
    p = np.ones((2, 4), np.int32)
    with pytest.raises(ValueError, match="prompt lengths"):
        sample(model, p, np.array([0, 4]), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="top_p"):
        sample(model, p, np.array([4, 4]), 2, key=jax.random.key(0), top_p=0.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        sample(model, p, np.array([4, 4]), 40, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"prompt block \(4\) \+ max_new_tokens \(29\) exceeds "
                                         "max_seq_len=32"):
        sample(model, p, np.array([4, 4]), 29, key=jax.random.key(0))
    with pytest.raises(ValueError, match="prompt_lens_B of shape"):
        sample(model, p, np.array([4]), 2, key=jax.random.key(0))
    # float lengths and ids: a cast would truncate them (2.6 -> 2, id 1.7 -> 1), silently
    with pytest.raises(ValueError, match=r"prompt_lens_B of shape \(2,\) and dtype float"):
        sample(model, p, np.array([2.6, 4.0]), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="prompt_BT of dtype float"):
        sample(model, p + 0.7, np.array([4, 4]), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"eos_id=2\.5 must be an integer token id"):
        sample(model, p, np.array([4, 4]), 2, key=jax.random.key(0), eos_id=2.5)
    with pytest.raises(ValueError, match=r"pad_id=1\.5 must be an integer token id"):
        sample(model, p, np.array([4, 4]), 2, key=jax.random.key(0), pad_id=1.5)
    with pytest.raises(ValueError, match=r"max_new_tokens=2\.7 must be an integer >= 1"):
        sample(model, p, np.array([4, 4]), 2.7, key=jax.random.key(0))  # ran 2, silently
    key = jax.random.key(0)
    for t in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match=f"temperature={t} must be a finite number"):
            sample(model, p, np.array([4, 4]), 2, key=key, temperature=t)
    with pytest.raises(ValueError, match=r"eos_id=32 lies outside the vocabulary \[0, 32\)"):
        sample(model, p, np.array([4, 4]), 2, key=key, eos_id=32)
    with pytest.raises(ValueError, match=r"pad_id=-1 lies outside the vocabulary"):
        sample(model, p, np.array([4, 4]), 2, key=key, pad_id=-1)
    with pytest.raises(ValueError, match=r"prompts_BT of shape \(4,\)"):
        sample(model, np.ones(4, np.int32), np.array([4]), 2, key=key)
    bad = np.array([[1, 2, 40, 0], [1, 2, 3, 4]], np.int32)  # 40: no token of 32
    for prompts in (bad, jnp.asarray(bad)):
        with pytest.raises(ValueError, match=r"token ids in \[1, 40\], outside the "
                                             r"vocabulary \[0, 32\)"):
            sample(model, prompts, np.array([3, 4]), 2, key=key)
    padded = np.array([[1, 2, -1, -1], [1, 2, 3, 4]], np.int32)  # -1 only past the prompt
    out = sample(model, padded, np.array([2, 4]), 2, key=key, temperature=0.0)
    assert out.tokens_BS.shape == (2, 6)


def test_a_sampler_splits_the_model_once_and_samples_its_variables_values():
    """sampler: each call equals sample's, for batches of other shapes; a variable's value
    set in place after it was made is seen, a variable replaced by a new object is not (a
    new sampler sees it)."""
    model = _lm(moe=True)
    draw = sampler(model, 5, temperature=0.7, top_p=0.9)
    key = jax.random.key(4)
    rng = np.random.default_rng(1)
    for B, T in ((1, 3), (3, 6)):
        prompts = rng.integers(1, 32, (B, T)).astype(np.int32)
        lens = rng.integers(1, T + 1, (B,))
        got = draw(prompts, lens, key=key)
        want = sample(model, prompts, lens, 5, key=key, temperature=0.7, top_p=0.9)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    before = np.asarray(draw(prompts, lens, key=key).tokens_BS)
    rolled = jnp.roll(model.embed[...], 1, axis=0)
    model.embed[...] = rolled
    moved = np.asarray(draw(prompts, lens, key=key).tokens_BS)
    assert not np.array_equal(moved, before)
    np.testing.assert_array_equal(moved, np.asarray(sample(
        model, prompts, lens, 5, key=key, temperature=0.7, top_p=0.9).tokens_BS))
    model.embed = nnx.Param(jnp.roll(rolled, 1, axis=0))  # a new object: not in draw's state
    np.testing.assert_array_equal(np.asarray(draw(prompts, lens, key=key).tokens_BS), moved)
    after = sampler(model, 5, temperature=0.7, top_p=0.9)(prompts, lens, key=key)
    assert not np.array_equal(np.asarray(after.tokens_BS), moved)
    with pytest.raises(ValueError, match="top_p"):
        sampler(model, 5, top_p=1.5)
