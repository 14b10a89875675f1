"""The statistics the paper claims are judged by (moejax.harness.claims): Student's t critical
values and tail probabilities against scipy, and the verdicts of paired and threshold claims
against the exact t interval, as properties over drawn samples (hypothesis)."""

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
