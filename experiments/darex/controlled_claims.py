"""darex_controlled's claim rules (DAREx Sec. 4-5, Tables 1-6, Fig. 7, on the controlled MLP
study of App. B): the paper's comparisons, paired over the seed runs, each with its control
(the winner beats the pre-trained model; a pruned delta worth more than the drop allowed)."""

from __future__ import annotations

from experiments.darex.common import beats_pretrained, worth_checked
from moejax.harness.claims import (
    Claim,
    lookup,
    measured,
    paired_compare,
    per_seed,
    threshold_claim,
    top_column,
)

__all__ = ["MINOR_DROP", "claims"]


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """The DAREx paper's claims on this study's tables; the comparisons of two methods are
    judged on the paired per-seed differences (:func:`moejax.harness.claims.paired_compare`),
    each with its control: the winner beats the pre-trained model
    (:func:`experiments.darex.common.beats_pretrained`)."""
    p = top_column(t.get("accuracy"))

    def compare(claim, a, b):
        c = paired_compare(claim, t, a, b)
        return beats_pretrained(c, [measured(a[1](r)) for r in per_seed(t)],
                                [_pretrained(r) for r in per_seed(t)])

    def at(ft, m):
        return (f"{ft} {m} {p}",
                lambda r: lookup(r.get("accuracy"), {"fine-tuning": ft, "method": m}, p))

    out = [compare("DAREx-q (q_v) beats DARE at the highest drop rate (Sec. 4.1, Tables 1-2)",
                   at("no reg (Adam)", "DAREx-q (q_v)"), at("no reg (Adam)", "DARE")),
           compare("AdamR-L2 fine-tuning makes DARE better at the highest drop rate (Sec. 4.2, "
                   "Tables 1, 5)", at("AdamR-L2", "DARE"), at("no reg (Adam)", "DARE")),
           compare("DAREx-q (q_e) beats DARE at the highest drop rate (Sec. 4.1, Tables 1-2)",
                   at("no reg (Adam)", "DAREx-q (q_e)"), at("no reg (Adam)", "DARE"))]
    lora = t.get("lora")
    if lora:
        lp = max(float(r["p"]) for r in lora)

        def on_lora(label, method):
            return label, lambda r: lookup(r.get("lora"), {"p": lp, "method": method},
                                           "accuracy")

        out.append(compare(
            f"DAREx-q beats DARE on LoRA factors at p = {lp:g} (Table 4)",
            on_lora("DAREx-q (q_v)", "DAREx-q (q_v) on LoRA factors"),
            on_lora("DARE", "DARE on LoRA factors")))
    large = t.get("large_deltas")
    if large:
        big = max(large, key=lambda r: float(r["mean_abs_delta"]))
        c = top_column([big], "DARE p=")
        q = c[len("DARE "):] if c else ""

        def at_lr(method):
            return (f"{method} {q}", lambda r: lookup(r.get("large_deltas"),
                                                      {"lr": big["lr"]}, f"{method} {q}"))

        out.append(compare(
            "With large deltas, magnitude pruning beats DARE at the highest drop rate (Sec. "
            f"5.3, Table 6; lr {float(big['lr']):g})", at_lr("magnitude"), at_lr("DARE")))
    sweep = t.get("l2_sweep")
    if sweep:
        c = top_column(sweep, "DARE p=")
        strongest = max(float(r["l2_weight"]) for r in sweep)
        drops, worths = [], []
        for run in per_seed(t):  # the drop at the strongest weight, one per seed run
            row = lookup(run.get("l2_sweep"), {"l2_weight": strongest})
            if row is not None and measured(row.get(c)) is not None:
                drops.append(float(row["unpruned"]) - float(row[c]))
                worths.append(_l2_delta_worth(run, row))
        claim = threshold_claim(f"The strongest AdamR-L2 lets DARE prune at {c[5:]} with a "
                                f"minor drop (< {MINOR_DROP:g}; Fig. 7)", drops, MINOR_DROP,
                                better="lower", fmt=".3f")
        claim = claim._replace(evidence=f"L2 weight {strongest:g}, accuracy drop "
                                        f"{claim.evidence}")
        out.append(worth_checked(claim, worths, MINOR_DROP))
    return out


# Fig. 7's "minor drop" of DARE's accuracy after AdamR-L2 (the paper gives no number)
MINOR_DROP = 0.05


def _pretrained(run: dict) -> float | None:
    """The pre-trained model's digits accuracy in one seed run (the ``finetuned`` table);
    None where not recorded."""
    return measured((run.get("finetuned") or [{}])[0].get("pre-trained acc digits"))


def _l2_delta_worth(run: dict, row: dict) -> float | None:
    """What an AdamR-L2 delta of the sweep is worth in one seed run: its unpruned accuracy
    over the pre-trained model's; None where not recorded. A weight strong enough to keep
    the delta at zero loses nothing to pruning, and gains nothing."""
    pre = _pretrained(run)
    return None if pre is None else float(row["unpruned"]) - pre
