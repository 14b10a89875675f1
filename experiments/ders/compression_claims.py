"""ders_compression's claim rules (DeRS Sec. 4.1-4.3 and App., Figs. 4-6, S8): compressed
deltas keep most of what the deltas are worth, at the settings the paper reports for each
kind of upcycled model, judged over the seed runs.

The paper's settings differ by scenario. Its MoE-LLaVA models were upcycled from dense models
fine-tuned beforehand: drop rate 0.9 "hardly affects the model's performance", 2-bit deltas
show "the same or even better performance", and "even under extreme DeRS compression
settings, such as sparsification with a 0.99 drop rate or quantization with the 1-bit width,
there is no significant degradation" (Sec. 4.1). Its Coder-MoE was upcycled with no prior
fine-tuning: "removing 60% of their elements or quantizing them to 2 bits" is without
degradation (Sec. 4.3, Fig. 6), and with the universal FFN decomposed too, 40% or 4 bits
(App. A3, Fig. S8). "Without degradation" is judged here as keeping at least
:data:`KEPT` of the deltas' worth, the loss rise of dropping every delta."""

from __future__ import annotations

from moejax.harness.claims import Claim, lookup, measured, per_seed, threshold_claim

__all__ = ["KEPT", "PAPER_SETTINGS", "claims"]

# the share of the deltas' worth a compression keeps to count as "without degradation"
KEPT = 0.9

# how a seed run's evidence begins where it lacks a row the claim reads (then the claim is
# not measured there, not undecided)
_NO_ROW = "no row"

# (scenario, what was decomposed, ((method, setting), ...), the claim): every setting of a
# claim must keep KEPT of the worth (the worst one per seed run is judged)
PAPER_SETTINGS = (
    ("finetuned", "experts", (("sparse", 0.9),),
     "Fine-tuned before upcycling (MoE-LLaVA analog): sparse deltas at drop rate 0.9 keep >= "
     "90% of the deltas' worth (Sec. 4.1)"),
    ("finetuned", "experts", (("quant", 2),),
     "Fine-tuned before upcycling (MoE-LLaVA analog): 2-bit deltas keep >= 90% of the deltas' "
     "worth (Sec. 4.1)"),
    ("finetuned", "experts", (("sparse", 0.99),),
     "Fine-tuned before upcycling (MoE-LLaVA analog): even drop rate 0.99 keeps >= 90% of the "
     "deltas' worth (Sec. 4.1, 'no significant degradation')"),
    ("finetuned", "experts", (("quant", 1),),
     "Fine-tuned before upcycling (MoE-LLaVA analog): even 1-bit deltas keep >= 90% of the "
     "deltas' worth (Sec. 4.1, 'no significant degradation')"),
    ("not_finetuned", "experts", (("sparse", 0.6), ("quant", 2)),
     "Not fine-tuned before upcycling (Coder-MoE analog): drop rate 0.6 and 2-bit deltas keep "
     ">= 90% of the deltas' worth (Sec. 4.3, Fig. 6)"),
    ("not_finetuned", "experts+universal", (("sparse", 0.4), ("quant", 4)),
     "Not fine-tuned, universal FFN decomposed too (extended DeRS): drop rate 0.4 and 4-bit "
     "deltas keep >= 90% of the deltas' worth (App. A3, Fig. S8)"),
)


def _kept(rows: list[dict], scenario: str, decomposed: str, method: str,
          setting: float) -> float | str:
    """The share of the deltas' worth (the loss rise of dropping them all, the ``base_only``
    row) that ``method`` at ``setting`` keeps, ``1 - d_loss / worth``; or why it cannot be
    told (:data:`_NO_ROW` and the row the run lacks, or deltas worth nothing)."""
    at = {"scenario": scenario, "decomposed": decomposed}
    d = measured(lookup(rows, {**at, "method": method, "setting": setting}, "d_loss"))
    worth = measured(lookup(rows, {**at, "method": "base_only"}, "d_loss"))
    if not any(all(r.get(k) == v for k, v in at.items()) for r in rows):
        return f"{_NO_ROW} of the scenario (not run)"
    if d is None:
        return f"{_NO_ROW} {method} {setting:g} (not in the sweep)"
    if worth is None:
        return f"{_NO_ROW} base_only (every delta dropped)"
    if worth <= 0:
        return f"deltas worth nothing ({worth:+.4f})"
    return 1.0 - d / worth


def _claim(t: dict, scenario: str, decomposed: str, settings: tuple, claim: str) -> Claim:
    """``claim``: every one of ``settings`` keeps :data:`KEPT` of the deltas' worth in
    ``scenario``; judged on the worst setting of each seed run
    (:func:`moejax.harness.claims.threshold_claim`). A seed run that cannot tell (no row, or
    deltas worth nothing there) leaves the claim inconclusive at best, named in the
    evidence; where none can, not measured."""
    worst, untold = [], []
    for i, run in enumerate(per_seed(t)):
        kept = [_kept(run.get("sweep") or [], scenario, decomposed, m, s) for m, s in settings]
        why = [k for k in kept if isinstance(k, str)]
        if why:
            untold.append(f"seed run {i}: {why[0]}")
        else:
            worst.append(min(kept))
    if not worst:
        return Claim(claim, None, f"{scenario} ({decomposed}) not judged: "
                                  + ("; ".join(untold) or "no seed run"),
                     inconclusive=any(_NO_ROW not in u for u in untold))
    c = threshold_claim(claim, worst, KEPT, fmt=".3f")
    what = " and ".join(f"{m} {s:g}" for m, s in settings)
    c = c._replace(evidence=f"share kept{', worst of ' + what if len(settings) > 1 else ''}: "
                            f"{c.evidence}")
    if untold and c.holds is not False:
        return Claim(claim, None, f"{c.evidence}; not judged: {'; '.join(untold)}",
                     inconclusive=True)
    return c


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """DeRS compression's claims (:data:`PAPER_SETTINGS`), each on the ``sweep`` table of
    every seed run: the share of the deltas' worth kept at the paper's settings for each
    scenario, at least :data:`KEPT` with 95% confidence."""
    return [_claim(t, *spec) for spec in PAPER_SETTINGS]
