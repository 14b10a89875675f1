"""MoEE's claim rules (Berisha et al. 2025, Tables 1-2, Sec. 4-5): the cuts and the accuracy
regained against the paper's smallest model, and the comparisons with MoEfication and the
ablations (random components, magnitude selection, other clusterings) at equal MACs, or where
unequal MACs worked against the verdict, each judged over the seeds."""

from __future__ import annotations

import numpy as np

from moejax.harness.claims import (
    Claim,
    all_hold,
    lookup,
    measured,
    paired,
    paired_claim,
    threshold_claim,
    unjudged,
)

# Table 1's smallest model (DeiT-T): MACs -27.0%, parameters -20.1%; the abstract: 98% of the
# original accuracy regained after fine-tuning. Two rows are "at equal MACs" when their MACs
# changes differ by at most EQUAL_MACS_PTS points (Table 1's pairs differ by 0.4-1.6).
MACS_CUT_PCT, PARAMS_CUT_PCT, KD_RETAINED_PCT, EQUAL_MACS_PTS = 27.0, 20.0, 98.0, 2.0

# the clusterings Sec. 5.1 sets against HDBSCAN ("HDBSCAN consistently yielding the best
# results"), as the first word of their Table 2 rows
OTHER_CLUSTERINGS = ("DBSCAN", "OPTICS", "k-means", "BIRCH")


def _macs_checked(claim: str, moee: dict, other: dict, a: str, b: str,
                   moee_seeds: dict | None = None, other_seeds: dict | None = None) -> Claim:
    """``claim`` that MoEE's ``a`` beats ``other``'s ``b``: on the paired per-seed differences
    with their 95% interval where both have per-seed values (``{seed: value}``), else on the
    one pair of means (inconclusive: no interval). Where the two cut MACs unalike (more than
    :data:`EQUAL_MACS_PTS` apart) a verdict stands only where the MACs worked against it: MoEE
    winning with fewer MACs, or losing with more; otherwise it is inconclusive, the difference
    possibly the MACs' (more active neurons keep more of the dense MLP)."""
    mine, theirs = float(moee["MACs_change_%"]), float(other["MACs_change_%"])
    macs = f"MACs {mine:+.1f}% vs {theirs:+.1f}%"
    seeds = sorted(set(moee_seeds or {}) & set(other_seeds or {}))
    if seeds:
        c = paired_claim(claim, paired(f"MoEE - {other['model']}",
                                       [moee_seeds[s] for s in seeds],
                                       [other_seeds[s] for s in seeds]))
    else:
        c = paired_claim(claim, paired(f"MoEE - {other['model']} (means)",
                                       [float(moee[a])], [float(other[b])], unit="mean"))
    if abs(mine - theirs) <= EQUAL_MACS_PTS or c.verdict == "not measured":
        return c._replace(evidence=f"{c.evidence}; {macs}")
    cheaper = mine < theirs
    unequal = f"not at equal MACs: MoEE {mine:+.1f}% vs {other['model']} {theirs:+.1f}%"
    if (c.holds is True and cheaper) or (c.holds is False and not cheaper):
        return c._replace(evidence=f"{c.evidence}; {unequal}, and MoEE "
                                   f"{'wins with fewer' if cheaper else 'loses with more'} MACs")
    return unjudged(c, f"{unequal}: the difference may be the MACs'")


def _by_seed(rows, model: str, key: str) -> dict:
    """``{seed: value}`` of ``model``'s per-seed rows (measured values only)."""
    out = {}
    for r in rows or ():
        if r.get("model") == model and r.get(key) not in (None, ""):
            out[int(float(r["seed"]))] = float(r[key])
    return out


def _param_cut(t: dict, moee: dict) -> Claim:
    """The parameter claim on the non-embedding parameters (the paper's ViTs have no large
    embedding table: a patch projection), over the seeds, the whole-model cut beside it; on
    the whole model where the run counted no split."""
    claim = f"MoEE cuts non-embedding parameters by {PARAMS_CUT_PCT:g}% or more (Table 1)"
    rows = t.get("params_per_layer") or []
    cut = lambda name: [float(r["removed_%"]) for r in rows  # noqa: E731
                        if r.get("layer") == name and r.get("removed_%") not in (None, "")]
    ne, whole = cut("without embeddings"), cut("whole model")
    if not ne:
        per = _by_seed(t.get("table1_per_seed"), "MoEE", "params_change_%")
        c = threshold_claim(claim, list(per.values()) or [float(moee["params_change_%"])],
                            -PARAMS_CUT_PCT, better="lower", fmt="+.1f",
                            unit="seed" if per else "mean")
        return c._replace(evidence=f"{c.evidence} (whole model; no split counted)")
    c = threshold_claim(claim, ne, PARAMS_CUT_PCT, fmt=".1f")
    w = float(np.mean(whole)) if whole else float("nan")
    return c._replace(evidence=f"removed without embeddings {c.evidence}; whole model "
                               f"{w:.1f}% removed")


def _later_minus_earlier(experts: str) -> float | None:
    """Experts in the later half of the layers minus the earlier half, from ``"2/2/4/5"``;
    the middle layer of an odd count is in neither half (both halves have as many layers)."""
    counts = [float(c) for c in str(experts).split("/") if c != ""]
    if len(counts) < 2:
        return None
    half = len(counts) // 2
    return sum(counts[-half:]) - sum(counts[:half])


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """MoEE's claims (Sec. 4-5, Tables 1-2) on this study's tables, at the thresholds of the
    paper's smallest model (:data:`MACS_CUT_PCT` ...), each judged over the seeds: the cuts
    and the accuracy regained by :func:`moejax.harness.claims.threshold_claim` on the per-seed
    values, the comparisons with MoEfication and the ablations (random components, Table 2;
    magnitude selection, Sec. 5.2; the other clusterings, Sec. 5.1) on the paired per-seed
    differences, at equal MACs or where unequal MACs worked against the verdict
    (:func:`_macs_checked`). The ablations are compared after KD, as Sec. 5 evaluates them
    (the clusterings also right after extraction, Sec. 5.1's "accuracy retention"); a run
    that did not fine-tune them leaves Table 2's and Sec. 5.2's claims inconclusive, its
    numbers right after extraction in the evidence, and judges Sec. 5.1's on the retention
    alone."""
    t1 = t.get("table1") or []
    moee = lookup(t1, {"model": "MoEE"})
    if moee is None:
        return [Claim("MoEE extracts experts (Sec. 4)", None, "no MoEE row")]
    dense = lookup(t1, {"model": "dense"})
    moef = [r for r in t1 if str(r["model"]).startswith("MoEfication")]
    per1, per2 = t.get("table1_per_seed"), t.get("table2_per_seed")
    seeds = lambda model, key: _by_seed(per1, model, key)  # noqa: E731
    macs = list(seeds("MoEE", "MACs_change_%").values())
    kd = [100 * v / float(dense["acc_after_kd"]) for v in
          seeds("MoEE", "accuracy_after_kd").values()] if dense is not None else []
    out = [threshold_claim(f"MoEE cuts MACs by {MACS_CUT_PCT:g}% or more (Table 1)",
                           macs or [float(moee["MACs_change_%"])], -MACS_CUT_PCT,
                           better="lower", fmt="+.1f", unit="seed" if macs else "mean"),
           _param_cut(t, moee),
           threshold_claim(f"MoEE regains {KD_RETAINED_PCT:g}% of the dense accuracy after "
                           "fine-tuning (Table 1, abstract)", kd or [float(moee["kd_vs_dense_%"])],
                           KD_RETAINED_PCT, fmt=".1f", unit="seed" if kd else "mean")]
    for r in moef:
        out.append(_macs_checked(f"MoEE beats {r['model']} at equal MACs after KD (Table 1)",
                                 moee, r, "acc_after_kd", "acc_after_kd",
                                 seeds("MoEE", "accuracy_after_kd"),
                                 seeds(r["model"], "accuracy_after_kd")))
        if r.get("load_cv") not in (None, ""):
            out.append(_paired_lower(f"MoEE routes more evenly than {r['model']} (Sec. 5, "
                                     "Fig. 2)", "load CV", seeds("MoEE", "load_cv"),
                                     seeds(r["model"], "load_cv"), moee["load_cv"],
                                     r["load_cv"]))
    def extracted(claim, r):  # MoEE against an ablation right after extraction
        return _macs_checked(claim, moee, r, "acc_extracted", "accuracy",
                             seeds("MoEE", "accuracy"), _by_seed(per2, r["model"], "accuracy"))

    def after_kd(claim, r):  # ... and both fine-tuned alike
        return _macs_checked(claim, moee, r, "acc_after_kd", "accuracy_after_kd",
                             seeds("MoEE", "accuracy_after_kd"),
                             _by_seed(per2, r["model"], "accuracy_after_kd"))

    ablations = t.get("table2_ablations") or []
    # Sec. 5 evaluates the ablated models "after the previously described fine-tuning"; a run
    # that did not fine-tune them (finetune_ablations=false) cannot test Table 2 or Sec. 5.2
    tuned = bool(ablations) and all(measured(r.get("accuracy_after_kd")) is not None
                                    for r in ablations)

    def table2(claim, r):
        if tuned:
            return after_kd(claim, r)
        c = extracted(claim, r)
        if c.verdict == "not measured":
            return c
        return unjudged(c, "the ablations were not fine-tuned (finetune_ablations=false), and "
                           "Sec. 5 compares them after it: compared right after extraction only")

    for r in ablations:
        if "random" in str(r["model"]):
            out.append(table2(f"MoEE beats {r['model']} after KD (Table 2)", r))
        elif str(r["model"]).startswith("magnitude"):
            out.append(table2("Variance selection beats magnitude selection after KD "
                              "(Sec. 5.2)", r))
    others = [r for r in ablations if str(r["model"]).split()[0] in OTHER_CLUSTERINGS]
    if others:  # Sec. 5.1: HDBSCAN best "in accuracy retention as well as final accuracy"
        names = [str(r["model"]).split()[0] for r in others]
        names = ", ".join(names[:-1]) + " and " * (len(names) > 1) + names[-1]
        parts = [(r, "right after extraction", extracted("", r)) for r in others]
        if tuned:
            parts += [(r, "after KD", after_kd("", r)) for r in others]
        when = "right after extraction and after KD" if tuned else "right after extraction"
        out.append(all_hold(f"HDBSCAN beats {names} {when} (Sec. 5.1)", [c for *_, c in parts],
                            "; ".join(f"{r['model']}{' ' + w if tuned else ''}: {c.evidence}"
                                      for r, w, c in parts)))
    later = [d for d in (_later_minus_earlier(r.get("experts", "")) for r in per1 or ()
                         if r.get("model") == "MoEE") if d is not None]
    if not later:  # a run that kept one seed's layers only
        layers = sorted((r for r in t.get("experts_per_layer") or [] if r["model"] == "MoEE"),
                        key=lambda r: float(r["layer"]))
        d = _later_minus_earlier("/".join(str(r["experts"]) for r in layers))
        later = [] if d is None else [d]
    if later:
        c = threshold_claim("Later layers form more clusters (Sec. 4)", later, 0.0, fmt="+.1f")
        out.append(c._replace(evidence=f"experts in the later half minus the earlier half of "
                                       f"the layers: {c.evidence}"))
    return out


def _paired_lower(claim: str, what: str, a: dict, b: dict, mean_a, mean_b) -> Claim:
    """``claim`` that MoEE's ``what`` is lower than another's, paired per seed where both have
    per-seed values, else on the one pair of means (inconclusive: no interval)."""
    common = sorted(set(a) & set(b))
    if common:
        return paired_claim(claim, paired(f"other - MoEE {what}", [b[s] for s in common],
                                          [a[s] for s in common]))
    return paired_claim(claim, paired(f"other - MoEE {what} (means)", [float(mean_b)],
                                      [float(mean_a)], unit="mean"))
