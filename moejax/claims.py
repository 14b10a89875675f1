"""A paper's claims judged from a run's tables: :class:`Claim` (the claim, whether the run
supports it, the numbers compared) and the helpers a study's ``claims(tables)`` uses to find
rows and compare values."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Claim", "claims_markdown", "lookup", "compare", "top_column", "paired", "paired_claim"]


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


class Claim(NamedTuple):
    """One claim of a paper and whether a run supports it: ``holds`` is True, False, or None
    when the run did not measure it; ``evidence`` gives the compared numbers."""

    claim: str
    holds: bool | None
    evidence: str

    @property
    def verdict(self) -> str:
        return {True: "holds", False: "does not hold", None: "not measured"}[self.holds]


def claims_markdown(claims: Sequence[Claim]) -> str:
    """One line per claim: verdict in bold, the claim, the evidence."""
    return "".join(f"- **{c.verdict}**: {c.claim} ({c.evidence})\n" for c in claims)


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


def compare(claim: str, a: tuple[str, Any], b: tuple[str, Any], *, better: str = "higher",
            fmt: str = ".4g") -> Claim:
    """``claim`` holds when ``a``'s value is better than ``b``'s (``better``: "higher" or
    "lower"); not measured when either is missing or NaN."""
    (la, va), (lb, vb) = a, b
    if va is None or vb is None or _isnan(float(va)) or _isnan(float(vb)):
        return Claim(claim, None, f"{la} or {lb} missing")
    va, vb = float(va), float(vb)
    holds = va > vb if better == "higher" else va < vb
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


def paired(label: str, a: Sequence[float], b: Sequence[float]) -> dict:
    """The paired comparison of two methods measured on the same seeds (``a[i]`` and ``b[i]``
    share seed ``i``): mean and sample standard deviation (ddof 1; 0 for one seed) of
    ``a - b``, how many seeds ``a`` wins, and the seed count."""
    if len(a) != len(b) or not a:
        raise ValueError(f"{label}: paired values need equal, non-zero lengths "
                         f"({len(a)} vs {len(b)})")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1) if len(d) > 1 else 0.0
    return {"comparison": label, "mean_diff": mean, "std_diff": math.sqrt(var),
            "wins": sum(x > 0 for x in d), "n": len(d)}


def paired_claim(claim: str, row: Mapping[str, Any] | None, fmt: str = ".4f") -> Claim:
    """``claim`` (that the first of a :func:`paired` row's methods is better) holds when the
    mean difference is positive and the first wins on a majority of the seeds; not measured
    without a row."""
    if row is None:
        return Claim(claim, None, "not run")
    holds = float(row["mean_diff"]) > 0 and 2 * int(row["wins"]) > int(row["n"])
    return Claim(claim, holds, f"{row['comparison']}: {format(float(row['mean_diff']), fmt)} "
                 f"+/- {format(float(row['std_diff']), fmt)}, wins {int(row['wins'])}/"
                 f"{int(row['n'])} seeds")
