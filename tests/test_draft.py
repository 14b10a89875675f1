"""moejax.chunk_sparse.draft: the target's continuations are its greedy decoding, the agreement is
the argmax match rate, and distillation teaches a draft the target's next-token choices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.chunk_sparse.draft as draft_mod
from moejax.chunk_sparse.draft import (
    DraftDistillConfig,
    argmax_agreement,
    distill_draft,
    target_continuations,
)
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.train.checkpoint import Checkpointer
from moejax.train.hparams import TrainConfig

V = 16


def _lm(seed, d=16, layers=1, std=0.02):
    cfg = DecoderConfig(vocab_size=V, d_model=d, n_layers=layers, n_heads=2,
                        ffn_slots=(DenseFFNConfig(d_hidden=2 * d, activation="swish"),) * layers,
                        max_seq_len=64, init_std=std)
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _greedy(model, prompt, n):
    """Oracle: greedy decoding by full forward passes over the growing sequence."""
    seq = list(np.asarray(prompt))
    for _ in range(n):
        logits, _ = _forward(model, jnp.asarray([seq], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return np.asarray(seq)


def test_target_continuations_are_greedy_decoding():
    target = _lm(0, std=1.0)
    prompts = np.asarray(jax.random.randint(jax.random.key(1), (3, 5), 0, V))
    rows = target_continuations(target, prompts, 6, key=jax.random.key(0), batch=2)
    assert rows["tokens"].shape == (3, 11) and rows["prompts"].shape == (3, 5)
    for i in range(3):
        np.testing.assert_array_equal(rows["tokens"][i], _greedy(target, prompts[i], 6))
    np.testing.assert_array_equal(rows["prompt_lens"], [5, 5, 5])
    np.testing.assert_array_equal(rows["response_mask"][0], [0] * 5 + [1] * 6)


def test_argmax_agreement_counts_matching_argmaxes():
    a, b = _lm(0, std=1.0), _lm(1, std=1.0)
    toks = np.asarray(jax.random.randint(jax.random.key(2), (2, 9), 0, V))
    assert argmax_agreement(a, a, toks) == 1.0
    la, _ = a(jnp.asarray(toks))
    lb, _ = b(jnp.asarray(toks))
    want = np.mean(np.argmax(np.asarray(la), -1) == np.argmax(np.asarray(lb), -1))
    assert argmax_agreement(b, a, toks) == pytest.approx(want)
    for bad, words in ((toks + 0.5, "integer token ids"), (toks + V, "outside the vocabulary")):
        with pytest.raises(ValueError, match=words):  # truncated; clamped by the gather
            argmax_agreement(b, a, bad)


@pytest.mark.parametrize("method", ["kd", "gkd"])
def test_distillation_teaches_the_draft_the_targets_choices(method):
    target, draft = _lm(0, d=32, std=1.0), _lm(5, d=16)
    prompts = np.asarray(jax.random.randint(jax.random.key(3), (64, 4), 0, V))
    held = target_continuations(target, np.asarray(
        jax.random.randint(jax.random.key(4), (16, 4), 0, V)), 12, key=jax.random.key(0))
    before = argmax_agreement(draft, target, held["tokens"])
    cfg = DraftDistillConfig(method=method, prompts=64, prompt_len=4, response_len=12,
                             train=TrainConfig(steps=150, batch_size=16, lr=1e-2,
                                               warmup_steps=5, weight_decay=0.0,
                                               log_every=50))
    out, hist = distill_draft(draft, target, prompts, cfg, seed=0)
    after = argmax_agreement(out, target, held["tokens"])
    assert before < 0.35 and after > before + 0.25, (before, after)
    assert hist[-1]["distill"] < hist[0]["distill"]
    # the draft passed in is unchanged
    assert argmax_agreement(draft, target, held["tokens"]) == before


def test_distill_draft_refuses_short_or_few_prompts_and_float_ids():
    cfg = DraftDistillConfig(prompt_len=8)
    with pytest.raises(ValueError, match="prompt_len"):
        distill_draft(_lm(0), _lm(1), np.zeros((4, 5), np.int32), cfg)
    # fewer prompts than asked: refused, not distilled on fewer
    with pytest.raises(ValueError, match=r"shape \(4, 8\).*P >= prompts=5"):
        distill_draft(_lm(0), _lm(1), np.zeros((4, 8), np.int32), cfg.replace(prompts=5))
    # float ids would be truncated to other tokens by a cast: refused, here and in the sampler
    with pytest.raises(ValueError, match="dtype float32; need integer token ids"):
        distill_draft(_lm(0), _lm(1), np.full((4, 8), 1.7, np.float32), cfg)
    with pytest.raises(ValueError, match="prompt_BT of dtype float"):
        target_continuations(_lm(0), np.full((2, 4), 1.7), 3, key=jax.random.key(0))


def test_a_distillation_resumes_though_the_targets_samples_differ(tmp_path, monkeypatch):
    """The responses are the target's samples, which a GPU need not reproduce bit for bit
    after a restart: the stream a resumed run must match is named by its prompts."""
    cfg = DraftDistillConfig(method="kd", prompts=8, prompt_len=4, response_len=6,
                             train=TrainConfig(steps=2, batch_size=4, lr=1e-2, warmup_steps=0,
                                               ckpt_every=2, log_every=1))
    prompts = np.asarray(jax.random.randint(jax.random.key(3), (8, 4), 0, V))
    first, _ = distill_draft(_lm(5), _lm(0), prompts, cfg, seed=0, run_dir=tmp_path)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    try:
        assert ckpt.read_meta(2)["data"].startswith("target continuations/")
    finally:
        ckpt.close()
    sampled = draft_mod.target_continuations

    def one_token_flipped(*args, **kw):
        rows = sampled(*args, **kw)
        tokens = rows["tokens"].copy()
        tokens[0, -2] = (tokens[0, -2] + 1) % V
        return {**rows, "tokens": tokens}

    monkeypatch.setattr(draft_mod, "target_continuations", one_token_flipped)
    again, hist = distill_draft(_lm(5), _lm(0), prompts, cfg, seed=0, run_dir=tmp_path)
    assert hist == []  # the finished run is restored, not refused nor trained again
    assert argmax_agreement(again, first, prompts) == 1.0
    other = prompts.copy()
    other[0, 0] = (other[0, 0] + 1) % V
    with pytest.raises(ValueError, match="data: checkpoint 'target continuations/"):
        distill_draft(_lm(5), _lm(0), other, cfg, seed=0, run_dir=tmp_path)
