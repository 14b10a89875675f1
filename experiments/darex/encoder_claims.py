"""darex_encoder's claim rules (DAREx Sec. 4-5, Tables 1-2, 5, 7, 9, App. C.9): the paper's
encoder comparisons, paired over every (task, seed) both methods ran, each with its control
(the winner beats its fine-tuning's delta dropped whole)."""

from __future__ import annotations

from experiments.darex.common import beats_pretrained
from moejax.harness.claims import Claim, paired, paired_claim

__all__ = ["DROPPED", "claims"]

UNIT = "(task, seed) pair"  # what each of a comparison's pairs is: one task at one seed

# the control row of every fine-tuning: its pruned deltas dropped whole (the head and any
# unpruned leaf keep theirs); a pruned model no better than this keeps nothing of its delta
DROPPED = "delta dropped (p = 1)"


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """The DAREx paper's encoder claims on this study's tables, each judged on the paired
    differences over every (task, seed) that both methods ran (:func:`moejax.harness.claims.
    paired_claim`), not on one task's means, with its control: the winner beats its
    fine-tuning's :data:`DROPPED` row (:func:`experiments.darex.common.beats_pretrained`)."""
    rows = t.get("per_seed") or []

    def acc(ft, m):
        return {(r["task"], int(float(r["seed"]))): float(r["accuracy"]) for r in rows
                if r["fine-tuning"] == ft and r["method"] == m}

    def judge(claim, a, b):
        (la, va), (lb, vb) = (a, acc(*a)), (b, acc(*b))
        units = sorted(set(va) & set(vb))
        if not units:
            return Claim(claim, None, f"{' '.join(la)} or {' '.join(lb)} not run")
        row = paired(f"{la[1]} - {lb[1]}", [va[u] for u in units], [vb[u] for u in units],
                     unit=UNIT)
        tasks = sorted({u[0] for u in units})
        c = paired_claim(claim, row)
        c = c._replace(evidence=f"{c.evidence} (tasks {', '.join(tasks)} x seeds)")
        base = acc(la[0], DROPPED)
        return beats_pretrained(c, [va[u] for u in units], [base.get(u) for u in units],
                                name=f"the {la[0]} delta dropped whole", unit=UNIT)

    dare = ("AdamW", "DARE")
    return [
        judge("DAREx-q (q_v) beats DARE (Tables 1-2)", ("AdamW", "DAREx-q (q_v)"), dare),
        judge("Per-layer DAREx-q (q_v) beats DARE (Sec. 4.1, App. C.9)",
              ("AdamW", "DAREx-q (per-layer q_v)"), dare),
        judge("DAREx-q (q_e) beats DARE (Tables 1-2)", ("AdamW", "DAREx-q (q_e)"), dare),
        judge("Per-layer DAREx-q (q_e) beats DARE (Sec. 4.1, App. C.9, Table 2)",
              ("AdamW", "DAREx-q (per-layer q_e)"), dare),
        judge("Per-layer rescaling beats global: per-layer DAREx-q (q_v) beats DAREx-q (q_v) "
              "on encoders (Sec. 5.1, Table 2)", ("AdamW", "DAREx-q (per-layer q_v)"),
              ("AdamW", "DAREx-q (q_v)")),
        judge("AdamR-L2 + DARE beats DARE after AdamW (Tables 1, 5)",
              ("AdamR-L2", "AdamR-L2 + DARE"), dare),
        judge("AdamR-L2 lifts structural DPP (Table 9)",
              ("AdamR-L2", "AdamR-L2 + structural DPP + q_v"),
              ("AdamW", "structural DPP + q_v")),
        judge("AdamR-L1 makes magnitude pruning better (Table 7)",
              ("AdamR-L1", "AdamR-L1 + magnitude"), ("AdamW", "magnitude")),
    ]
