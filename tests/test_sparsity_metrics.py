"""Sparsity metrics (moejax.ops.sparsity_metrics) against direct loops: on hand-built arrays and
on drawn batches (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moejax.evaluate import SparsityEvaluator, router_active_sets
from moejax.ops import chunk_sparsity as cs
from moejax.ops import sparsity_metrics as sm
from tests.token_runs import runs, token_batches

# 2 rows x 6 tokens x 4 experts
ACT = np.array([
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 1, 1, 0]],
    [[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 1, 0, 0]],
], bool)
MASK = np.array([[1] * 6, [1, 1, 1, 1, 1, 0]], bool)
SEG = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 0]], np.int32)


def cls_values(act, L, mask, seg):
    """The all-inactive fraction of each full chunk of each run, chunk by chunk."""
    vals = []
    for b, run in runs(mask, seg):
        for c in range(0, len(run) - L + 1, L):
            union = np.zeros(act.shape[-1], bool)
            for t in run[c:c + L]:
                union |= act[b, t]
            vals.append(1 - union.mean())
    return vals


def reuse_values(act, mask, seg):
    """``|S_t & S_t+1| / |S_t|`` of each neighbouring pair of a run with ``S_t`` not empty."""
    vals = []
    for b, run in runs(mask, seg):
        for t in run[:-1]:
            s, s2 = set(np.flatnonzero(act[b, t])), set(np.flatnonzero(act[b, t + 1]))
            if s:
                vals.append(len(s & s2) / len(s))
    return vals


def np_cls(act, L, mask, seg):
    return np.mean(cls_values(act, L, mask, seg))


def np_reuse(act, mask, seg):
    return np.mean(reuse_values(act, mask, seg))


def test_tls_hand_computed():
    num, den = sm.tls_counts(ACT, MASK)
    # active counts of real tokens: row0 1,2,1,1,1,2 ; row1 1,1,0,4,1
    want = sum(1 - c / 4 for c in [1, 2, 1, 1, 1, 2, 1, 1, 0, 4, 1]) / 11
    assert den == 11 and num / den == pytest.approx(want)


@pytest.mark.parametrize("L", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("use_seg", [False, True])
def test_cls_matches_loops(L, use_seg):
    seg = SEG if use_seg else np.where(MASK, 1, 0)
    num, den = sm.cls_counts(ACT, L, MASK, seg if use_seg else None)
    if den == 0:  # no run holds a full chunk
        assert all(len(run) < L for _, run in runs(MASK, seg)) and num == 0
        return
    assert num / den == pytest.approx(np_cls(ACT, L, MASK, seg))


@given(token_batches(), st.integers(1, 6))
def test_counts_equal_the_loops_on_any_batch(batch, L):
    """TLS, CLS_L and reuse counts equal the token-by-token loops on any pattern, padding and
    document split, including rows with no real token and runs shorter than a chunk."""
    act, mask, seg = batch
    real = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    num, den = sm.tls_counts(act, mask)
    assert den == len(real)
    assert num == pytest.approx(sum(1 - act[b, t].mean() for b, t in real))
    want = cls_values(act, L, mask, seg)
    num, den = sm.cls_counts(act, L, mask, seg)
    assert den == len(want) and num == pytest.approx(sum(want))
    want = reuse_values(act, mask, seg)
    num, den = sm.reuse_counts(act, mask, seg)
    assert den == len(want) and num == pytest.approx(sum(want))


def test_cls_hand_value_and_cls1_equals_tls():
    # no mask/segments, L = 2: chunks row0 {0,1}:{0,1} {2,3}:{0,2} {4,5}:{1,2};
    # row1 {0,1}:{3} {2,3}:all {4,5}:{1}
    num, den = sm.cls_counts(ACT, 2)
    assert den == 6 and num / den == pytest.approx((0.5 + 0.5 + 0.5 + 0.75 + 0 + 0.75) / 6)
    n1, d1 = sm.cls_counts(ACT, 1, MASK)
    t, dt = sm.tls_counts(ACT, MASK)
    assert n1 / d1 == pytest.approx(t / dt)


@pytest.mark.parametrize("use_seg", [False, True])
def test_reuse_matches_loops(use_seg):
    seg = SEG if use_seg else np.where(MASK, 1, 0)
    num, den = sm.reuse_counts(ACT, MASK, seg if use_seg else None)
    assert num / den == pytest.approx(np_reuse(ACT, MASK, seg))


def test_reuse_hand_value():
    act = np.array([[[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 1, 1]]], bool)
    # pairs: {0,1}->{0}: 1/2 ; {0}->{}: 0 ; {}->...: skipped
    num, den = sm.reuse_counts(act)
    assert den == 2 and num / den == pytest.approx(0.25)


def test_magnitude_and_streaming_accumulator():
    rng = np.random.default_rng(0)
    a = rng.normal(size=ACT.shape) * ACT
    tokens = np.array([[5, 6, 5, 7, 7, 7], [5, 5, 6, 8, 9, 0]])
    acc = sm.SparsityAccumulator(chunk_lens=(1, 2))
    # stream the two rows as two batches into layer 0, and the whole batch into layer 1
    for b in range(2):
        acc.update(0, ACT[b:b + 1], mask_BT=MASK[b:b + 1], segment_ids_BT=SEG[b:b + 1],
                   a_BTE=a[b:b + 1], tokens_BT=tokens[b:b + 1])
    acc.update(1, ACT, mask_BT=MASK, segment_ids_BT=SEG, a_BTE=a)
    res = acc.result()
    for layer in (0, 1):
        r = res["layers"][layer]
        assert r["tls"] == pytest.approx(np.mean([1 - ACT[b, t].mean() for b in range(2)
                                                   for t in range(6) if MASK[b, t]]))
        assert r["cls_2"] == pytest.approx(np_cls(ACT, 2, MASK, SEG))
        assert r["reuse"] == pytest.approx(np_reuse(ACT, MASK, SEG))
        mags = [np.linalg.norm(a[b, t]) for b in range(2) for t in range(6) if MASK[b, t]]
        assert r["magnitude"] == pytest.approx(np.mean(mags))
    assert res["mean"]["tls"] == pytest.approx(res["layers"][0]["tls"])
    ids, counts, frac = acc.allocation()
    assert ids.tolist() == [5, 6, 7, 8, 9]
    assert counts.tolist() == [4, 2, 3, 1, 1]
    # token 5: (0,0),(0,2),(1,0),(1,1): active fractions .25,.25,.25,.25
    assert frac[0] == pytest.approx(0.25)
    assert frac[3] == pytest.approx(1.0)  # token 8 at (1,3): all active


def test_a_metric_no_layer_measured_averages_to_nan_without_a_warning():
    """Every token masked out: each layer's ratios are NaN, and so is their mean, quietly
    (numpy's nanmean would warn "Mean of empty slice"); a measured layer is averaged alone."""
    import warnings

    acc = sm.SparsityAccumulator(chunk_lens=(1,))
    acc.update(0, ACT, mask_BT=np.zeros_like(MASK))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = acc.result()
    assert np.isnan(res["layers"][0]["tls"]) and np.isnan(res["mean"]["tls"])
    acc.update(1, ACT, mask_BT=MASK)
    res = acc.result()
    assert res["mean"]["tls"] == pytest.approx(res["layers"][1]["tls"])


def test_allocation_skips_padding_wherever_it_lies():
    mask = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)  # padding inside the batch
    tokens = np.array([[5, 6, 0, 0, 0, 0], [7, 7, 7, 8, 8, 5]])
    acc = sm.SparsityAccumulator(chunk_lens=(1,))
    acc.update(0, ACT, mask_BT=mask, tokens_BT=tokens)
    ids, counts, frac = acc.allocation()
    assert ids.tolist() == [5, 6, 7, 8] and counts.tolist() == [2, 1, 3, 2]
    # token 5: (0, 0) .25 and (1, 5) .25; 6: (0, 1) .5; 7: 0.25, 0.25, 0; 8: 1, .25
    np.testing.assert_allclose(frac, [0.25, 0.5, 0.5 / 3, 0.625])


def test_a_mask_that_is_not_one_per_token_is_refused_not_broadcast():
    """A ``[B, 1]`` real-token mask broadcast over the tokens counted every token of a row
    that had one real token, silently; the metrics and BlockFFN's objectives refuse it."""
    import jax.numpy as jnp

    row_mask = np.ones((2, 1), bool)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1\) for positions of shape "
                       r"\(2, 6\)"):
        sm.tls_counts(ACT, row_mask)
    with pytest.raises(ValueError, match=r"mask of shape \(6,\)"):
        sm.cls_counts(ACT, 2, MASK[0])
    a = jnp.asarray(ACT, jnp.float32)
    for loss in (lambda m: cs.activation_locality_loss(a, mask_BT=m),
                 lambda m: cs.chunk_sparsification_loss(a, chunk_len=2, mask_BT=m),
                 lambda m: cs.l1_activation_loss(a, mask_BT=m)):
        with pytest.raises(ValueError, match=r"mask of shape \(2, 1\)"):
            loss(jnp.asarray(row_mask))
        assert np.isfinite(float(loss(jnp.asarray(MASK))))
    # one document id a row, broadcast over its tokens, is refused the same way
    with pytest.raises(ValueError, match=r"segment ids of shape \(2, 1\) for positions of "
                       r"shape \(2, 6\)"):
        sm.cls_counts(ACT, 2, MASK, SEG[:, :1])
    for loss in (lambda s: cs.activation_locality_loss(a, mask_BT=MASK, segment_ids_BT=s),
                 lambda s: cs.chunk_sparsification_loss(a, chunk_len=2, mask_BT=MASK,
                                                        segment_ids_BT=s)):
        with pytest.raises(ValueError, match=r"segment ids of shape \(2, 1\)"):
            loss(jnp.asarray(SEG[:, :1]))
        assert np.isfinite(float(loss(jnp.asarray(SEG))))


def test_the_accumulator_refuses_values_and_tokens_of_other_shapes():
    """Activation values transposed (``[B, E, T]``) or of another expert count gave another
    norm, and float token ids were truncated to other tokens, silently."""
    rng = np.random.default_rng(0)
    acc = sm.SparsityAccumulator(chunk_lens=(1,))
    B, T, E = ACT.shape
    for bad in (rng.random((B, E, T)), rng.random((B, T, E - 1))):
        with pytest.raises(ValueError, match="activation values"):
            acc.update(0, ACT, a_BTE=bad)
    with pytest.raises(ValueError, match="token ids of shape"):
        acc.update(0, ACT, tokens_BT=np.zeros((B, T + 1), int))
    with pytest.raises(ValueError, match="integer token ids"):
        acc.update(0, ACT, tokens_BT=np.full((B, T), 2.7))
    for bad in (ACT[..., 0], ACT[..., :0]):
        with pytest.raises(ValueError, match="batch, tokens, experts"):
            acc.update(0, bad)
    assert acc.result() == {"layers": {}, "mean": {}}  # nothing was counted
    acc.update(0, ACT, a_BTE=rng.random(ACT.shape), tokens_BT=np.zeros((B, T), int))
    assert np.isfinite(acc.result()["mean"]["magnitude"])
    for lens in ((0,), (-1,), (2.5,), (8, True)):  # cls_0 was a NaN made of 0/0 chunks
        with pytest.raises(ValueError, match="chunk_lens"):
            sm.SparsityAccumulator(chunk_lens=lens)

    with pytest.raises(ValueError, match="chunk_lens"):  # before any evaluation
        SparsityEvaluator([{"inputs": np.zeros((1, 4), np.int32)}], chunk_lens=(0,))
    sm.SparsityAccumulator(chunk_lens=(1, 1))  # a length twice is counted alike (a speculative
    # bench's draft length of one asks for CLS_1 twice)


def test_top_k_active_sets_need_the_expert_count():
    """Without ``n_experts`` a top-k layer's ids became an empty active set, which failed
    later in the accumulator with numpy's "cannot reshape array of size 0"."""
    ids_BTK = np.array([[[0, 1], [2, 3]]])
    with pytest.raises(ValueError, match="n_experts=0.*functools.partial"):
        router_active_sets({"expert_ids": ids_BTK})
    act, _ = router_active_sets({"expert_ids": ids_BTK}, n_experts=4, n_always_on=1)
    assert np.asarray(act).astype(int).tolist() == [[[1, 1, 1, 0, 0], [1, 0, 0, 1, 1]]]

