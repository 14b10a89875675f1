"""A paper's claims judged from a run's tables: :class:`Claim` (the claim, whether the run
supports it, the numbers compared) and the helpers a study's ``claims(tables)`` uses to find
rows and compare values.

A claim that two methods differ is judged from their paired per-seed differences (both arms
trained and evaluated on the same seeds, :func:`paired`): it holds when the 95% interval of
the mean difference (Student's t, ``n - 1`` degrees of freedom) lies above zero, does not
hold when it lies below or when the two are equal in every seed, and is inconclusive when it
contains zero otherwise or when one seed cannot give an interval (:func:`paired_claim`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Claim", "claims_markdown", "claims_scale", "lookup", "compare", "top_column",
           "paired", "paired_claim", "paired_compare", "per_seed", "t_critical", "t_two_sided_p",
           "threshold_claim", "measured", "beats_control", "unjudged", "SEED_TABLES"]

# the key under which a repeated study's claims also get each seed run's tables (a list of
# {table: rows}, seed order), beside the tables merged over the runs
SEED_TABLES = "_seed_tables"


def measured(value) -> float | None:
    """A table cell as a number, or None where it holds no measurement (missing, empty, or
    NaN: how a table records a quantity its run could not measure)."""
    if value is None or value == "":
        return None
    value = float(value)
    return None if math.isnan(value) else value


class Claim(NamedTuple):
    """One claim of a paper and whether a run supports it: ``holds`` is True, False, or None
    when the run did not measure it or cannot decide (``inconclusive``: measured, but the
    seeds do not separate the arms); ``evidence`` gives the compared numbers."""

    claim: str
    holds: bool | None
    evidence: str
    inconclusive: bool = False

    @property
    def verdict(self) -> str:
        if self.inconclusive:
            return "inconclusive"
        return {True: "holds", False: "does not hold", None: "not measured"}[self.holds]


def claims_scale(here: str, paper: str) -> str:
    """The scale a verdict was reached at beside the paper's: ``"here: <here>; paper:
    <paper>"`` (``""`` when neither is known)."""
    if not (here or paper):
        return ""
    return (f"here: {here or 'no model trained by the run'}; "
            f"paper: {paper or 'not stated'}")


def claims_markdown(claims: Sequence[Claim], scale: str = "") -> str:
    """One line per claim: verdict in bold, the claim, the evidence, and the scale
    (:func:`claims_scale`) when given."""
    tail = f" [scale {scale}]" if scale else ""
    return "".join(f"- **{c.verdict}**: {c.claim} ({c.evidence}){tail}\n" for c in claims)


def lookup(rows: Sequence[Mapping[str, Any]] | None, match: Mapping[str, Any],
           column: str | None = None):
    """The first row whose values equal ``match`` (numbers compared as floats), or its
    ``column``; None when there is none."""
    def same(a, b):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return a == b

    for r in rows or ():
        if all(k in r and same(r[k], v) for k, v in match.items()):
            return r if column is None else r.get(column)
    return None


def _sign(better: str) -> float:
    """+1 for ``better="higher"``, -1 for ``"lower"``; anything else is refused (a misspelt
    orientation would judge the claim the wrong way round)."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better={better!r}; use 'higher' or 'lower'")
    return 1.0 if better == "higher" else -1.0


def compare(claim: str, a: tuple[str, Any], b: tuple[str, Any], *, better: str = "higher",
            fmt: str = ".4g") -> Claim:
    """``claim`` holds when ``a``'s value is better than ``b``'s (``better``: "higher" or
    "lower"); not measured when either is missing or NaN."""
    (la, va), (lb, vb) = a, b
    sign = _sign(better)
    va, vb = measured(va), measured(vb)
    if va is None or vb is None:
        return Claim(claim, None, f"{la} or {lb} missing")
    holds = sign * va > sign * vb
    return Claim(claim, holds, f"{la} {format(va, fmt)} vs {lb} {format(vb, fmt)}")


def top_column(rows: Sequence[Mapping[str, Any]] | None, prefix: str = "p=") -> str | None:
    """The column ``<prefix><number>`` with the largest number (e.g. the highest drop rate
    of a wide table), or None."""
    best = None
    for c in dict.fromkeys(k for r in rows or () for k in r):
        if c.startswith(prefix):
            try:
                v = float(c[len(prefix):])
            except ValueError:
                continue
            if best is None or v > best[0]:
                best = (v, c)
    return None if best is None else best[1]


def paired(label: str, a: Sequence[float], b: Sequence[float], *,
           unit: str = "seed") -> dict:
    """The paired comparison of two methods measured on the same seeds (``a[i]`` and ``b[i]``
    share seed ``i``; ``unit``: what a pair is, as the evidence names it, where it is not a
    seed, e.g. ``"prompt"``, kept as the row's ``unit``; a seed's row has no ``unit``, so a
    table of seed rows keeps its columns): mean and sample standard deviation (ddof 1; 0 for
    one pair) of ``a - b``, how many pairs ``a`` wins, and the pair count."""
    if len(a) != len(b) or not a:
        raise ValueError(f"{label}: paired values need equal, non-zero lengths "
                         f"({len(a)} vs {len(b)})")
    if not unit:
        raise ValueError(f"{label}: unit={unit!r}; name what a pair is (e.g. 'seed')")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1) if len(d) > 1 else 0.0
    return {"comparison": label, "mean_diff": mean, "std_diff": math.sqrt(var),
            "wins": sum(x > 0 for x in d), "n": len(d),
            **({} if unit == "seed" else {"unit": unit})}


@functools.lru_cache(maxsize=256)
def t_critical(df: int, alpha: float = 0.05) -> float:
    """Two-sided ``1 - alpha`` critical value of Student's t with ``df`` >= 1 degrees of
    freedom, solved from the t distribution (:func:`t_two_sided_p`) by bisection: exact at
    every ``df``, so every interval has the level its evidence states."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} must lie in (0, 1)")
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > alpha:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > alpha else (lo, mid)
    return hi


def t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| > t)`` for Student's t with ``df`` degrees of freedom: the regularised
    incomplete beta ``I_x(df / 2, 1 / 2)`` at ``x = df / (df + t^2)`` (``1 - x`` passed as
    ``t^2 / (df + t^2)``, exact where ``x`` rounds to 1)."""
    return _betainc(0.5 * df, 0.5, df / (df + t * t), t * t / (df + t * t))


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``, ``y = 1 - x``, by its
    continued fraction (modified Lentz), on the side of ``x`` where it converges fast."""
    if x <= 0.0 or y <= 0.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, y, x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log(y)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


# the outcome of a paired row whose values are not all numbers (NaN or infinite: a quantity
# its run could not measure): the claim is not measured, not undecided
_UNMEASURED = "unmeasured"


def _one(row: Mapping[str, Any], fmt: str,
         alpha: float = 0.05) -> tuple[bool | None | str, str]:
    """True / False / None (inconclusive) / :data:`_UNMEASURED` for one paired row, and its
    evidence (a ``1 - alpha`` interval)."""
    n, mean, sd = int(row["n"]), float(row["mean_diff"]), float(row["std_diff"])
    unit = str(row.get("unit") or "seed")
    spread = format(sd, fmt.lstrip("+"))  # a spread has no sign to show
    text = (f"{row['comparison']}{' ' + str(row['metric']) if row.get('metric') else ''}: "
            f"{format(mean, fmt)} +/- {spread}, wins {int(row['wins'])}/{n} {unit}s")
    if not (math.isfinite(mean) and math.isfinite(sd)):
        return _UNMEASURED, text + ", a value is not a number: not measured"
    if n < 2:
        return None, text + f", one {unit}: no interval"
    if mean == 0 and sd == 0:  # every pair a tie: the first method is better in none
        return False, text + f", equal in every {unit}"
    half = t_critical(n - 1, alpha) * sd / math.sqrt(n)
    lo, hi = mean - half, mean + half
    text += f", {100 * (1 - alpha):.4g}% CI [{_bound(lo, fmt)}, {_bound(hi, fmt)}]"
    return (True if lo > 0 else False if hi < 0 else None), text


def _bound(x: float, fmt: str) -> str:
    """An interval's end in ``fmt``, or to two significant digits where ``fmt`` would print a
    nonzero end as zero: the side of zero the verdict reads must show ("[0.0025, 1.0]", not
    "[0.0, 1.0]" beside "holds")."""
    text = format(x, fmt)
    if x == 0 or float(text) != 0:
        return text
    return format(x, "+.2g" if fmt.startswith("+") else ".2g")


def paired_claim(claim: str, rows: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                 fmt: str = ".4f", alpha: float = 0.05) -> Claim:
    """``claim`` (that the first of a :func:`paired` comparison's methods is better) judged
    on one paired row or on several (one per metric the claim names, each oriented so that
    higher is better): holds when every metric's 95% interval lies above zero, does not hold
    when any lies below or is tied in every seed, inconclusive otherwise; not measured
    without rows, or where a metric's values are not all numbers (NaN or infinite) and none
    lies below. ``alpha``: one minus the intervals' level (0.05/K for the best of K
    candidates, Bonferroni)."""
    if rows is None or (not isinstance(rows, Mapping) and not rows):
        return Claim(claim, None, "not run")
    rows = [rows] if isinstance(rows, Mapping) else list(rows)
    parts = [Claim(claim, None if o == _UNMEASURED else o, text, inconclusive=o is None)
             for o, text in (_one(r, fmt, alpha) for r in rows)]
    return all_hold(claim, parts, "; ".join(c.evidence for c in parts))


def all_hold(claim: str, parts: Sequence[Claim], evidence: str) -> Claim:
    """``claim`` that every one of ``parts`` holds: does not hold where one does not, not
    measured where one is not (and none fails), holds where all hold, else inconclusive."""
    verdicts = [c.verdict for c in parts]
    if "does not hold" in verdicts:
        return Claim(claim, False, evidence)
    if "not measured" in verdicts:
        return Claim(claim, None, evidence)
    if all(v == "holds" for v in verdicts):
        return Claim(claim, True, evidence)
    return Claim(claim, None, evidence, inconclusive=True)


def unjudged(c: Claim, why: str) -> Claim:
    """``c`` made inconclusive, ``why`` added to its evidence: the run's setting cannot test
    the claim (a control the claim assumes failed, or was not recorded)."""
    return Claim(c.claim, None, f"{c.evidence}; {why}", inconclusive=True)


def beats_control(c: Claim, winner: Sequence[float | None],
                  control: Sequence[float | None], *, name: str, so: str,
                  better: str = "higher", fmt: str = ".4g", unit: str = "seed") -> Claim:
    """``c``, a claim that one method beats another, with the control it assumes: the winner
    also beats ``name``, the run that did without what the methods compete at (``winner[i]``
    and ``control[i]``: seed run ``i``'s metric, ``better`` oriented; None: not recorded),
    paired over the seeds (over ``unit``, :func:`paired`'s, where a pair is not a seed). A
    "holds" stands only where it does: a winner no better than the control wins by the
    other's harm, not by what it does itself (``so``: what that leaves unshown, for the
    evidence). A "does not hold" stands either way."""
    sign = _sign(better)
    if not c.holds:
        return c
    if not winner or None in winner or None in control or len(winner) != len(control):
        return unjudged(c, f"the metric of {name} was not recorded: the winner's gain over "
                           "it is unchecked")
    row = paired("winner - control" if sign > 0 else "control - winner",
                 [sign * v for v in winner], [sign * v for v in control], unit=unit)
    check = paired_claim(f"the winner beats {name}", row, fmt=fmt)
    if check.holds:
        return c._replace(evidence=f"{c.evidence}; it beats {name}: {check.evidence}")
    return unjudged(c, f"the winner is not shown better than {name}, so {so} "
                       f"({check.evidence})")


def per_seed(t: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Each seed run's tables of a repeated study (:data:`SEED_TABLES`), else the one run's."""
    return list(t.get(SEED_TABLES) or [t])


def paired_compare(claim: str, t: Mapping[str, Any], a: tuple[str, Any], b: tuple[str, Any],
                   *, better: str = "higher", fmt: str = ".4g", alpha: float = 0.05) -> Claim:
    """:func:`compare` judged from the seeds: ``a`` and ``b`` are ``(label, value_of)`` with
    ``value_of(tables)`` reading one run's value; each seed run gives a pair, and the claim
    is :func:`paired_claim` on the differences (oriented by ``better``; ``alpha`` as there),
    with both arms' means. One run: inconclusive. A value missing in any run: not
    measured."""
    (la, fa), (lb, fb) = a, b
    sign = _sign(better)
    runs = per_seed(t)
    va, vb = [measured(fa(r)) for r in runs], [measured(fb(r)) for r in runs]
    if any(v is None for v in va + vb):
        return Claim(claim, None, f"{la} or {lb} missing")
    row = paired(f"{la} - {lb}" if sign > 0 else f"{lb} - {la}",
                 [sign * v for v in va], [sign * v for v in vb])
    c = paired_claim(claim, row, fmt=fmt, alpha=alpha)
    means = (f"{la} {format(sum(va) / len(va), fmt)} vs {lb} {format(sum(vb) / len(vb), fmt)}"
             f" (mean of {len(va)} seed run{'s' * (len(va) > 1)})")
    return c._replace(evidence=f"{means}; {c.evidence}")


def threshold_claim(claim: str, values: Sequence[float], threshold: float, *,
                    better: str = "higher", fmt: str = ".4g", candidates: int = 1,
                    unit: str = "seed") -> Claim:
    """``claim`` that a quantity measured once per seed (per ``unit``: e.g. ``"prompt"``
    for one value per prompt) is at least (``better="higher"``) or at most ``threshold``:
    holds when its 95% interval lies past the threshold, does not hold when it lies short of
    it, inconclusive otherwise (one value: no interval). For the best of ``candidates``
    settings, picked by their means, the interval is widened to ``1 - 0.05 / candidates``
    (Bonferroni): the best of several noisy means is biased upwards."""
    if candidates < 1:
        raise ValueError(f"candidates={candidates} must be >= 1")
    sign = _sign(better)
    if not values:
        return Claim(claim, None, "not run")
    row = paired(f"value - {threshold:g}" if sign > 0 else f"{threshold:g} - value",
                 [sign * float(v) for v in values], [sign * threshold] * len(values),
                 unit=unit)
    c = paired_claim(claim, row, fmt=fmt, alpha=0.05 / candidates)
    mean = sum(float(v) for v in values) / len(values)
    best = f" (the best of {candidates}: Bonferroni)" if candidates > 1 else ""
    return c._replace(evidence=f"{format(mean, fmt)} (mean of {len(values)}) vs {threshold:g}"
                      f"{best}; {c.evidence}")
