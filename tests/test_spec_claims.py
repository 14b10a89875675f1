"""The speculative-decoding benchmark's claims (experiments.blockffn.speculative): the serving
claim judged on per-prompt speedups against autoregressive token-sparse decoding, equal tokens
asked only where decoding is exact, chunk-sparse verification against dense verification of the
same draft, only the 100M models judged, and the ratios derived again from a table read back."""

import numpy as np
import pytest

from experiments.blockffn.speculative import claims
from experiments.blockffn.speculative_tables import derived_tables, ratio_columns
from moejax.bench.decode_timing import matching_prefix
from moejax.harness.tables import changed_cells


def test_matching_prefix_counts_new_tokens_before_the_first_difference():
    ref = np.array([[9, 9, 1, 2, 3, 4], [9, 9, 5, 6, 7, 8]])
    assert matching_prefix(ref, ref, 2) == 1.0
    got = ref.copy()
    got[0, 3] = 0  # prompt 0: 1 of 4 new tokens before the difference (later ones count not)
    got[1, 2] = 0  # prompt 1: none
    assert matching_prefix(got, ref, 2) == pytest.approx((1 / 4 + 0) / 2)
    got[0, 5] = 4
    assert matching_prefix(got, ref, 2) == pytest.approx(1 / 8)


def _ar_rows(row, sparse=1.0, dense=0.5):
    """``row``'s model's autoregressive decodings (tokens/s; token-sparse the faster unless
    told otherwise)."""
    return [{**row, "mode": m, "draft": "", "draft_len": "", "tokens_per_s": x}
            for m, x in (("AR dense", dense), ("AR token-sparse", sparse))]


def _prompt_times(row, speedups):
    """Per-prompt times: AR token-sparse 1 s each, ``row``'s decoding 1 / speedup."""
    base = {"model": row["model"], "draft": "", "draft_len": ""}
    return ([{**base, "mode": "AR token-sparse", "prompt": i, "seconds": 1.0}
             for i in range(len(speedups))]
            + [{**base, "mode": row["mode"], "draft": row["draft"], "draft_len": row["draft_len"],
                "prompt": i, "seconds": 1.0 / x} for i, x in enumerate(speedups)])


@pytest.mark.parametrize("dtype,verdict", [("float32", False), ("bfloat16", True)])
def test_the_serving_claim_needs_equal_tokens_only_where_decoding_is_exact(dtype, verdict):
    row = {"model": "grown", "params": 2e8, "mode": "spec chunk-sparse",
           "decode_dtype": dtype, "draft": "d", "speedup_vs_AR_token_sparse": 2.0,
           "draft_len": 4, "tokens_per_s": 100.0, "mean_accepted_length": 3.0,
           "same_tokens_as_AR": "False", "tokens_matching_AR": 0.875}
    prompts = _prompt_times(row, [1.9, 2.0, 2.1, 2.0])
    claim = claims({"decode": [row, *_ar_rows(row)], "decode_prompts": prompts})[0]
    assert claim.holds is verdict
    assert ("0.875" in claim.evidence) is (dtype == "bfloat16")
    assert "expert path: not recorded" in claim.evidence
    claim = claims({"decode": [{**row, "expert_path": "jnp loop"}, *_ar_rows(row)],
                    "decode_prompts": prompts})[0]
    assert "expert path: jnp loop" in claim.evidence


def test_the_serving_claim_is_judged_on_per_prompt_speedups():
    """Holds when the per-prompt speedups' interval lies above 1.5x, does not hold below,
    inconclusive when it straddles 1.5x or when only one timing was kept; against the faster
    autoregressive decoding, dense where it is the faster."""
    row = {"model": "grown", "params": 2e8, "mode": "spec chunk-sparse",
           "decode_dtype": "float32", "draft": "d", "speedup_vs_AR_token_sparse": 1.6,
           "draft_len": 4, "tokens_per_s": 100.0, "mean_accepted_length": 3.0,
           "same_tokens_as_AR": "True", "tokens_matching_AR": 1.0}

    ar = _ar_rows(row, sparse=100 / 1.6)

    def verdict(speedups):
        t = {"decode": [row, *ar]}
        if speedups:
            t["decode_prompts"] = _prompt_times(row, speedups)
        return claims(t)[0].verdict

    assert verdict([1.9, 2.0, 2.1, 2.0]) == "holds"
    # AR dense the faster (twice token-sparse): the speedups over it are half as large
    dense_first = _ar_rows(row, sparse=100 / 1.6, dense=200 / 1.6)
    prompts = _prompt_times(row, [3.9, 4.0, 4.1, 4.0])
    prompts += [{**p, "mode": "AR dense", "seconds": 0.5} for p in prompts
                if p["mode"] == "AR token-sparse"]
    c = claims({"decode": [row, *dense_first], "decode_prompts": prompts})[0]
    assert c.verdict == "holds" and "AR dense" in c.evidence and "2.00 (mean of 4)" in c.evidence
    assert "wins 4/4 prompts" in c.evidence and "seeds" not in c.evidence  # paired by prompt
    assert claims({"decode": [row]})[0].verdict == "not measured"  # no AR decoding timed
    assert verdict([1.1, 1.2, 1.15, 1.2]) == "does not hold"
    assert verdict([1.2, 1.9, 1.4, 1.7]) == "inconclusive"
    assert verdict([]) == "inconclusive"  # one timing: no interval
    one = claims({"decode": [row, *ar]})[0].evidence
    assert "tokens/s (no per-prompt times kept): 1.60 (mean of 1)" in one
    assert "wins 1/1 runs, one run: no interval" in one and "per prompt" not in one
    # the fastest of several settings: a Bonferroni interval (0.05 / 4), wider
    slower = [{**row, "draft_len": n, "speedup_vs_AR_token_sparse": 1.0, "tokens_per_s": 62.5}
              for n in (2, 6, 8)]
    speedups = [1.62, 1.58, 1.66, 1.55, 1.64]  # 95%: [1.554, 1.666]; 98.75%: [1.518, 1.702]
    t = {"decode": [row, *ar], "decode_prompts": _prompt_times(row, speedups)}
    assert claims(t)[0].verdict == "holds"
    c = claims({**t, "decode": [row, *ar, *slower]})[0]
    assert c.verdict == "holds" and "98.75% CI" in c.evidence and "the best of 4" in c.evidence
    tight = [s - 0.045 for s in speedups]  # 95%: [1.509, 1.621] holds; 98.75%: does not
    t = {"decode": [row, *ar, *slower], "decode_prompts": _prompt_times(row, tight)}
    assert claims({**t, "decode": [row, *ar]})[0].verdict == "holds"
    assert claims(t)[0].verdict == "inconclusive"


def test_chunk_sparse_verification_is_judged_against_dense_verification_of_the_same_draft():
    """The second serving claim pairs each chunk-sparse speculative decoding with the dense
    verification of the same draft and length, per prompt; holds above 1x, does not hold
    below, widened for the fastest of the pairs; a draft with no dense twin is not a pair."""
    base = {"model": "grown", "params": 2e8, "decode_dtype": "float32", "draft": "d",
            "draft_len": 4, "mean_accepted_length": 3.0, "same_tokens_as_AR": "True",
            "tokens_matching_AR": 1.0, "speedup_vs_AR_token_sparse": 1.0}
    sparse = {**base, "mode": "spec chunk-sparse", "tokens_per_s": 200.0}
    dense = {**base, "mode": "spec dense", "tokens_per_s": 100.0}
    other = {**sparse, "draft": "e", "tokens_per_s": 900.0}  # fastest, but no dense twin

    def judged(ratios, rows=(sparse, dense, other)):
        key = {"model": "grown", "draft": "d", "draft_len": 4}
        prompts = [{**key, "mode": m, "prompt": i, "seconds": s}
                   for i, x in enumerate(ratios)
                   for m, s in (("spec dense", 1.0), ("spec chunk-sparse", 1.0 / x))]
        return claims({"decode": list(rows), "decode_prompts": prompts})[1]

    c = judged([1.9, 2.0, 2.1, 2.0])
    assert c.verdict == "holds" and "2.00x at n = 4, d draft (200.0 vs 100.0" in c.evidence
    assert "95% CI" in c.evidence  # one pair: draft e has no dense twin
    assert "wins 4/4 prompts" in c.evidence and "seeds" not in c.evidence
    assert judged([0.8, 0.9, 0.85, 0.9]).verdict == "does not hold"
    assert judged([0.9, 1.2, 1.0, 1.1]).verdict == "inconclusive"
    two = judged([1.9, 2.0, 2.1, 2.0], rows=(sparse, dense, {**dense, "draft_len": 2},
                                             {**sparse, "draft_len": 2, "tokens_per_s": 50.0}))
    assert two.verdict == "holds" and "97.5% CI" in two.evidence  # the best of 2 pairs
    wrong = judged([1.9, 2.0, 2.1, 2.0], rows=(sparse, {**dense, "same_tokens_as_AR": "False"}))
    assert wrong.verdict == "does not hold"  # float32 decoding that differs from AR: a bug
    assert claims({"decode": [sparse]})[1].verdict == "not measured"


def test_serving_claims_judge_only_the_100m_models_and_each_settings_own_prompt_times():
    """Both serving claims read models of >= 100M parameters only (a faster small model does
    not count), and each per-prompt speedup pairs the judged setting's own prompt times, not
    another draft length's of the same model."""
    base = {"model": "grown", "params": 2e8, "decode_dtype": "float32", "draft": "d",
            "mean_accepted_length": 3.0, "same_tokens_as_AR": "True",
            "tokens_matching_AR": 1.0, "speedup_vs_AR_token_sparse": 1.0}
    fast = {**base, "mode": "spec chunk-sparse", "draft_len": 4, "tokens_per_s": 200.0}
    slow = {**fast, "draft_len": 2, "tokens_per_s": 150.0}
    dense = {**fast, "mode": "spec dense", "tokens_per_s": 100.0}
    ar = _ar_rows(fast, sparse=50.0, dense=40.0)
    small = {**fast, "model": "small", "params": 5e7}
    tiny = [small, {**small, "mode": "spec dense", "tokens_per_s": 1000.0},
            *_ar_rows(small, sparse=1000.0, dense=1000.0)]
    prompts = (_prompt_times(fast, [4.0, 4.1, 3.9, 4.0])
               + [p for p in _prompt_times(slow, [0.9, 1.0, 1.1, 1.0])
                  if p["mode"] == "spec chunk-sparse"]
               + [{"model": "grown", "mode": "spec dense", "draft": "d", "draft_len": n,
                   "prompt": i, "seconds": 2.0} for n in (2, 4) for i in range(4)])
    over_ar, over_dense = claims({"decode": [fast, slow, dense, *ar, *tiny],
                                  "decode_prompts": prompts})
    assert over_ar.verdict == "holds" and "4.00 (mean of 4)" in over_ar.evidence, over_ar
    assert "the best of 2" in over_ar.evidence  # the two draft lengths, not the small model
    assert over_dense.verdict == "holds" and "2.00x at n = 4" in over_dense.evidence, over_dense
    assert "97.5% CI" not in over_dense.evidence  # one pair: the small model's is not counted


def test_the_ratios_are_derived_again_from_a_table_read_back():
    """ratio_columns on the decode table as a results document reads it back (floats and
    blank cells): a chunk-sparse row's sparse_gain is over the dense decoding of its own draft
    only, a stale ratio over another draft's is blanked, and the rule gives a run's own rows
    what it gave them (the results document recomputes nothing that stands)."""
    def row(mode, draft, n, tps, bound, **stale):
        return {"model": "grown", "mode": mode, "draft": draft, "draft_len": n,
                "tokens_per_s": tps, "ffn_fraction_bound": bound, **stale}

    read_back = [row("AR dense", "", "", 100.0, 1.0, speedup_vs_AR_token_sparse=0.8),
                 row("AR token-sparse", "", "", 125.0, 0.2, sparse_gain=1.25),
                 row("spec dense", "independent", 4.0, 150.0, 1.0),
                 row("spec chunk-sparse", "independent", 4.0, 300.0, 0.25, sparse_gain=2.0),
                 row("spec chunk-sparse", "distilled", 4.0, 450.0, 0.25, sparse_gain=3.0)]
    out = ratio_columns(read_back)
    assert [r.get("sparse_gain", "") for r in out] == ["", 1.25, "", 2.0, ""]
    assert [r.get("gain_bound", "") for r in out] == ["", 5.0, "", 4.0, 4.0]
    assert [r["speedup_vs_AR_token_sparse"] for r in out] == [0.8, 1.0, 1.2, 2.4, 3.6]
    assert read_back[4]["sparse_gain"] == 3.0  # the rows given are not changed
    cols = ["sparse_gain", "gain_bound", "speedup_vs_AR_token_sparse"]
    assert changed_cells(read_back, out, cols) == {
        (1, "gain_bound"): 5.0, (1, "speedup_vs_AR_token_sparse"): 1.0,
        (2, "speedup_vs_AR_token_sparse"): 1.2, (3, "gain_bound"): 4.0,
        (3, "speedup_vs_AR_token_sparse"): 2.4, (4, "sparse_gain"): "",
        (4, "gain_bound"): 4.0, (4, "speedup_vs_AR_token_sparse"): 3.6}
    assert changed_cells(out, ratio_columns(out), cols) == {}
    assert derived_tables({"decode": read_back}) == {"decode": out}
    assert derived_tables({"decode_prompts": []}) == {}
