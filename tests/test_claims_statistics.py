"""The statistics the paper claims are judged by (moejax.harness.claims): Student's t critical
values and tail probabilities against scipy, and the verdicts of paired and threshold claims
against the exact t interval, as properties over drawn samples (hypothesis); the helpers that
find and compare a table's values, and paired differences and threshold claims by hand."""

import math

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from scipy import stats

from moejax.harness.claims import (
    Claim,
    beats_control,
    compare,
    lookup,
    paired,
    paired_claim,
    paired_compare,
    t_critical,
    t_two_sided_p,
    threshold_claim,
    top_column,
)

DIFFS = st.lists(st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=2,
                 max_size=12)


def test_t_critical_is_student_t_at_every_df():
    """The 95% critical value is Student's t's at every df, between the classic table's
    entries (t(11) = 2.201, not t(10)'s 2.228) and past it (t(500) = 1.9647, not 1.96's
    narrower interval), reaching 1.96 only in the limit."""
    assert t_critical(1) == pytest.approx(12.7062, abs=1e-4)
    assert t_critical(4) == pytest.approx(2.7764, abs=1e-4)
    assert t_critical(11) == pytest.approx(2.2010, abs=1e-4)
    assert t_critical(121) == pytest.approx(1.9798, abs=1e-4)
    assert t_critical(500) == pytest.approx(1.9647, abs=1e-4)
    assert t_critical(10**7) == pytest.approx(1.95996, abs=1e-5)
    assert all(t_critical(df) > t_critical(df + 1) for df in range(1, 130))
    with pytest.raises(ValueError, match="df"):
        t_critical(0)
    with pytest.raises(ValueError, match="alpha"):
        t_critical(3, 1.0)


@given(st.integers(1, 10**6), st.floats(1e-6, 0.5))
@example(11, 0.05)
@example(121, 0.05)
@example(5000, 0.05 / 6)
def test_t_critical_is_scipys_quantile(df, alpha):
    """At every df and level the critical value is scipy's quantile, the two-sided tail
    probability there is ``alpha``, and a stricter level widens the interval."""
    t = t_critical(df, alpha)
    assert t == pytest.approx(stats.t.ppf(1 - alpha / 2, df), rel=1e-8)
    assert t_two_sided_p(t, df) == pytest.approx(alpha, rel=1e-8)
    assert t_critical(df, alpha / 2) > t


@given(st.integers(1, 10**6), st.floats(0, 1e4, allow_subnormal=False))
@example(8192, 1e-6)
def test_t_tail_probability_is_scipys(df, t):
    """``P(|T| > t)`` equals scipy's at every df, also near 1 (tiny t, where ``1 - x`` of the
    incomplete beta rounds away) and far in the tail."""
    want = 2 * stats.t.sf(t, df)
    assert t_two_sided_p(t, df) == pytest.approx(want, rel=1e-8, abs=1e-300)


@given(DIFFS)
def test_a_paired_verdict_is_the_exact_t_interval(diffs):
    """A paired claim holds exactly when the 95% t interval of the mean difference lies above
    zero, does not hold when it lies below (or every seed ties), and is inconclusive when it
    holds zero; the wins count the seeds the first arm is ahead in."""
    d = np.asarray(diffs, np.float64)
    row = paired("A - B", list(d), [0.0] * len(d))
    c = paired_claim("A beats B", row)
    assert row["wins"] == int(np.sum(d > 0)) and row["n"] == len(d)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if mean == 0 and sd == 0:
        assert c.verdict == "does not hold" and "equal in every seed" in c.evidence
        return
    half = stats.t.ppf(0.975, len(d) - 1) * sd / math.sqrt(len(d))
    lo, hi = mean - half, mean + half
    assume(min(abs(lo), abs(hi)) > 1e-9 * (abs(mean) + sd + 1))  # not a rounding tie
    assert c.verdict == ("holds" if lo > 0 else "does not hold" if hi < 0 else "inconclusive")


@given(DIFFS, st.floats(-1e3, 1e3, allow_subnormal=False), st.integers(1, 20))
def test_a_lower_is_better_threshold_is_the_mirror_of_a_higher_one(values, threshold, k):
    """``value <= threshold`` judged on the values is ``-value >= -threshold`` judged on their
    negatives, at every Bonferroni level; the level names its candidates."""
    low = threshold_claim("c", values, threshold, better="lower", candidates=k)
    high = threshold_claim("c", [-v for v in values], -threshold, candidates=k)
    assert low.verdict == high.verdict
    assert (f"{100 * (1 - 0.05 / k):.4g}% CI" in low.evidence) == (len(set(values)) > 1 or
                                                                  values[0] != threshold)


def test_a_control_can_only_take_a_holds_away():
    """beats_control: "holds" stands where the winner also beats the control over the seeds,
    and is made inconclusive where it does not or where the control was not recorded; every
    other verdict stands as it is, evidence included."""
    kw = dict(name="the control", so="its gain is unshown")
    win, ctl_low, ctl_high = [0.9, 0.92, 0.91], [0.5, 0.52, 0.49], [0.95, 0.9, 0.97]
    held = Claim("A beats B", True, "A 0.9 vs B 0.8")
    assert beats_control(held, win, ctl_low, **kw).verdict == "holds"
    assert beats_control(held, win, ctl_high, **kw).verdict == "inconclusive"
    assert beats_control(held, win, [0.5, None, 0.5], **kw).verdict == "inconclusive"
    assert beats_control(held, win, ctl_low[:2], **kw).verdict == "inconclusive"  # unpaired
    # lower is better: the winner's 0.1 loss beats a control's 0.5
    lower = beats_control(held, [0.1, 0.12, 0.11], ctl_low, better="lower", **kw)
    assert lower.verdict == "holds"
    for other in (Claim("A beats B", False, "e"), Claim("A beats B", None, "e"),
                  Claim("A beats B", None, "e", inconclusive=True)):
        for ctl in (ctl_low, ctl_high, [None] * 3):
            assert beats_control(other, win, ctl, **kw) == other


def test_edges_of_a_verdict_ties_and_an_interval_touching_zero_are_no_win():
    """A tie of single values is no win; an interval whose lower end is exactly zero does
    not lie above zero; a column a row lacks is not measured (None), not an error."""
    assert compare("A beats B", ("A", 1.0), ("B", 1.0)).verdict == "does not hold"
    assert compare("A beats B", ("A", 1.0), ("B", 1.0), better="lower").verdict == \
        "does not hold"
    n, sd = 2, 1.0
    half = t_critical(n - 1, 0.05) * sd / math.sqrt(n)
    row = {"comparison": "A - B", "mean_diff": half, "std_diff": sd, "wins": 2, "n": n}
    assert paired_claim("A beats B", row).verdict == "inconclusive"
    assert lookup([{"model": "A", "x": 1.0}], {"model": "A"}, "y") is None


def test_an_orientation_other_than_higher_or_lower_is_refused():
    """``better`` orients every comparison; a misspelt one ("greater", "Higher") was taken
    as "lower" and judged the claim the wrong way round: compare("a > b", 2 vs 1,
    better="greater") held False."""
    assert compare("a > b", ("a", 2.0), ("b", 1.0)).holds
    assert not compare("a < b", ("a", 2.0), ("b", 1.0), better="lower").holds
    won = Claim("a beats b", True, "a 2 vs b 1")
    calls = [lambda b: compare("c", ("a", 2.0), ("b", 1.0), better=b),
             lambda b: threshold_claim("c", [1.0, 2.0], 0.5, better=b),
             lambda b: beats_control(won, [2.0, 2.1], [1.0, 1.1], name="n", so="s", better=b),
             lambda b: paired_compare("c", {"x": 1.0}, ("a", lambda t: 2.0),
                                      ("b", lambda t: 1.0), better=b)]
    for call in calls:
        call("lower")  # both orientations run
        for bad in ("greater", "Higher", ""):
            with pytest.raises(ValueError, match=f"better='{bad}'; use 'higher' or 'lower'"):
                call(bad)


def test_an_interval_end_that_decides_the_verdict_is_never_printed_as_zero():
    """A coarse format would print a small positive lower end (the verdict: holds) as 0.0; it
    is printed to two significant digits instead, on either side of zero, and an end the
    format shows as it is stays in that format."""
    held = threshold_claim("x", [98.5, 98.05, 99.0, 98.2, 98.8], 98.0, fmt=".1f")
    assert held.verdict == "holds" and "95% CI [0.016, 1.0]" in held.evidence
    failed = threshold_claim("x", [97.5, 97.95, 97.0, 97.8, 97.2], 98.0, fmt="+.1f")
    assert failed.verdict == "does not hold" and "95% CI [-1.0, -0.016]" in failed.evidence
    assert "value - 98: -0.5 +/- 0.4," in failed.evidence  # a signed format; a spread unsigned
    wide = threshold_claim("x", [98.6, 98.1, 99.0, 98.2, 98.8], 98.0, fmt=".1f")
    assert "95% CI [0.1, 1.0]" in wide.evidence


def test_lookup_compare_and_top_column():
    rows = [{"method": "DARE", "p": 0.9, "acc": 0.5}, {"method": "DARE", "p": "0.99", "acc": 0.2}]
    assert lookup(rows, {"method": "DARE", "p": 0.99}, "acc") == 0.2  # "0.99" == 0.99
    assert lookup(rows, {"method": "WANDA"}) is None
    assert top_column([{"p=0.5": 1, "p=0.99": 2, "p=0.9 std": 3, "method": "x"}]) == "p=0.99"
    c = compare("a beats b", ("a", 0.3), ("b", 0.4))
    assert (c.holds, c.verdict, c.evidence) == (False, "does not hold", "a 0.3 vs b 0.4")
    assert compare("lower wins", ("a", 0.3), ("b", 0.4), better="lower").holds is True
    assert compare("missing", ("a", None), ("b", 0.4)).holds is None
    assert compare("nan", ("a", float("nan")), ("b", 0.4)).verdict == "not measured"


def test_paired_differences_by_hand():
    # a - b per seed: 0.1, -0.2, 0.4 -> mean 0.1, sample std sqrt((0 + 0.09 + 0.09) / 2) = 0.3
    row = paired("A - B", [0.5, 0.3, 0.9], [0.4, 0.5, 0.5])
    assert row["mean_diff"] == pytest.approx(0.1) and row["std_diff"] == pytest.approx(0.3)
    assert (row["wins"], row["n"], row["comparison"]) == (2, 3, "A - B")
    c = paired_claim("A beats B", row)
    # 95% CI: 0.1 +/- t(2) 4.3027 * 0.3 / sqrt(3) = [-0.6452, 0.8452]: contains zero
    assert c.verdict == "inconclusive" and c.holds is None
    assert "0.1000 +/- 0.3000, wins 2/3 seeds, 95% CI [-0.6452, 0.8452]" in c.evidence
    assert paired_claim("x", None).verdict == "not measured"
    one = paired("one", [1.0], [0.5])
    assert one["std_diff"] == 0.0 and paired_claim("x", one).verdict == "inconclusive"
    with pytest.raises(ValueError, match="equal, non-zero lengths"):
        paired("bad", [1.0], [1.0, 2.0])


def test_the_evidence_counts_what_was_paired():
    """Values paired by something other than a seed (a prompt, a (task, seed) pair, a mean)
    are counted as such in the evidence, not as seeds; a seed's row keeps the columns a
    table of paired rows had (no ``unit``)."""
    c = threshold_claim("fast", [3.0, 2.5, 4.0, 3.5], 1.5, fmt=".2f", unit="prompt")
    assert "wins 4/4 prompts, 95% CI" in c.evidence and "seeds" not in c.evidence
    one = threshold_claim("fast", [3.0], 1.5, unit="run")
    assert one.verdict == "inconclusive" and "wins 1/1 runs, one run: no interval" in one.evidence
    tie = paired_claim("x", paired("A - B", [1.0, 2.0], [1.0, 2.0], unit="(task, seed) pair"))
    assert tie.evidence.endswith("wins 0/2 (task, seed) pairs, equal in every (task, seed) pair")
    assert "unit" not in paired("A - B", [1.0], [0.5]) and "seeds" in threshold_claim(
        "x", [2.0, 3.0], 1.0).evidence
    with pytest.raises(ValueError, match="name what a pair is"):
        paired("A - B", [1.0], [0.5], unit="")


def test_a_paired_value_that_is_not_a_number_is_not_measured():
    """A NaN or infinite value (a run that could not measure it, e.g. a diverged loss) leaves
    the claim not measured, not inconclusive; a metric that lies below still decides it."""
    nan, inf = float("nan"), float("inf")
    for a in ([0.5, nan, 0.9], [0.5, inf, 0.9]):
        c = paired_claim("A beats B", paired("A - B", a, [0.4, 0.5, 0.5]))
        assert c.verdict == "not measured" and "not a number" in c.evidence
    up = paired("up", [1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    down = paired("down", [0.0, 1.0, 2.0], [1.0, 2.1, 3.0])
    bad = paired("bad", [nan, 1.0, 2.0], [0.0, 0.0, 0.0])
    assert paired_claim("both", [up, bad]).verdict == "not measured"
    assert paired_claim("both", [down, bad]).verdict == "does not hold"


@pytest.mark.parametrize("seed", range(20))
def test_paired_verdicts_follow_the_interval(seed):
    """Properties over random seeds: a clear shift holds (its mirror does not), arms equal in
    every seed do not hold (the first is better in none), noise-dominated shifts follow the
    interval, the interval holds the mean, and several metrics hold only together."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    b = rng.normal(size=n)
    noise = rng.normal(scale=0.01, size=n)
    up = paired("A - B", list(b + 1.0 + noise), list(b))
    assert paired_claim("A beats B", up).holds is True
    assert paired_claim("B beats A", paired("B - A", list(b), list(b + 1.0 + noise))).holds \
        is False
    same = paired_claim("same", paired("same", list(b), list(b)))
    assert same.verdict == "does not hold" and "equal in every seed" in same.evidence
    tiny = paired("tiny", list(b + 1e-3 + rng.normal(scale=1.0, size=n)), list(b))
    c = paired_claim("tiny", tiny)
    lo, hi = (float(v) for v in c.evidence.split("CI [")[1].rstrip("]").split(", "))
    assert lo <= tiny["mean_diff"] <= hi
    assert c.verdict == ("holds" if lo > 0 else "does not hold" if hi < 0 else "inconclusive")
    assert paired_claim("both", [up, up]).holds is True
    assert paired_claim("both", [up, paired("same", list(b), list(b))]).verdict == \
        "does not hold"
    assert paired_claim("both", [up, tiny]).verdict == ("holds" if lo > 0 else
                                                        "does not hold" if hi < 0 else
                                                        "inconclusive")
    down = paired("B - A", list(b), list(b + 1.0 + noise))
    assert paired_claim("both", [up, down]).holds is False


def test_the_best_of_several_settings_is_judged_at_a_bonferroni_level():
    """A threshold claim on the best of K settings widens its interval to 1 - 0.05/K: the
    same values that clear the threshold at 95% can be inconclusive as the best of many."""
    values = [1.62, 1.58, 1.66, 1.55, 1.64]  # mean 1.61, 95% CI [1.554, 1.666]
    assert threshold_claim("c", values, 1.5).verdict == "holds"
    c = threshold_claim("c", values, 1.5, candidates=2)  # 97.5%: [1.540, 1.680]
    assert c.verdict == "holds" and "97.5% CI [0.04009, 0.1799]" in c.evidence
    assert threshold_claim("c", values, 1.6).verdict == "inconclusive"
    c = threshold_claim("c", [v + 0.05 for v in values], 1.6)  # 95%: [1.604, 1.716]
    assert c.verdict == "holds" and "95% CI" in c.evidence
    c = threshold_claim("c", [v + 0.05 for v in values], 1.6, candidates=20)
    assert c.verdict == "inconclusive" and "99.75% CI" in c.evidence
    assert "the best of 20: Bonferroni" in c.evidence
    with pytest.raises(ValueError, match="candidates"):
        threshold_claim("c", values, 1.5, candidates=0)


def test_threshold_claims_need_the_interval_past_the_threshold():
    assert threshold_claim("x", [0.95, 0.96, 0.94, 0.955, 0.945], 0.9).holds is True
    assert threshold_claim("x", [0.85, 0.86, 0.84, 0.855, 0.845], 0.9).holds is False
    assert threshold_claim("x", [0.95, 0.80, 0.99], 0.9).verdict == "inconclusive"
    assert threshold_claim("x", [0.95], 0.9).verdict == "inconclusive"   # one seed
    assert threshold_claim("x", [0.05, 0.04, 0.06], 0.1, better="lower").holds is True
    assert threshold_claim("x", [], 0.9).verdict == "not measured"
