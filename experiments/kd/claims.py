"""MoE KD's claim rules (Every Expert Matters, Table 1 and Sec. 5): the paper's comparisons,
paired per training seed on ROUGE-L, each judged only in a setting that can test it (a
teacher worth distilling; comparable dense and MoE teachers, Sec. 5.1, and a draw of each
teacher per training seed), a method's win only where the winner distilled something (it
beats the SFT student trained on alike, Table 1's SFT row)."""

from __future__ import annotations

import math

from moejax.harness.claims import Claim, beats_control, paired, paired_claim, unjudged

# the paper's comparisons: (label, (teacher, method) that should win, (teacher, method))
COMPARISONS = (
    ("GKD - KD (MoE teacher)", ("MoE", "GKD"), ("MoE", "KD")),
    ("ALL - GKD (MoE teacher)", ("MoE", "ALL"), ("MoE", "GKD")),
    ("KA - GKD (MoE teacher)", ("MoE", "KA"), ("MoE", "GKD")),
    ("SAR - GKD (MoE teacher)", ("MoE", "SAR"), ("MoE", "GKD")),
    ("KD: dense - MoE teacher", ("dense", "KD"), ("MoE", "KD")),
    ("GKD: dense - MoE teacher", ("dense", "GKD"), ("MoE", "GKD")),
)


def _by_run(per_seed: list[dict]) -> dict:
    """``{(teacher kind, method): {training seed: row}}`` of the ``per_seed`` table."""
    by = {}
    for r in per_seed:
        by.setdefault((str(r["teacher"]).split()[0], r["method"]), {})[int(float(r["seed"]))] = r
    return by


def paired_rows(per_seed: list[dict]) -> list[dict]:
    """Each of :data:`COMPARISONS` both runs made, per training seed (ROUGE-L: the mean over
    the shared sampling seeds; perplexity: lower is better, so the sign is flipped), with
    ``teachers``, how many teacher draws the pairs came from (a row's ``teacher_draw``)."""
    by = _by_run(per_seed)
    out = []
    for label, a, b in COMPARISONS:
        if a not in by or b not in by:
            continue
        seeds = sorted(set(by[a]) & set(by[b]))
        draws = {"teachers": len({by[a][s].get("teacher_draw", 0) for s in seeds})}
        out.append({"metric": "rouge_l", **paired(label, [by[a][s]["rouge_l"] for s in seeds],
                                                  [by[b][s]["rouge_l"] for s in seeds]),
                    **draws})
        out.append({"metric": "-ppl", **paired(label, [-by[a][s]["ppl"] for s in seeds],
                                               [-by[b][s]["ppl"] for s in seeds]), **draws})
    return out


def teacher_gap(refs: dict) -> dict:
    """How much better the MoE teacher is than the SFT student before distillation: relative
    and absolute ROUGE-L gain, relative perplexity reduction, and whether the setting has a
    teacher worth distilling (>= 50% relative or 0.05 absolute ROUGE-L, >= 20% perplexity)."""
    t, s = refs["MoE teacher"], refs["student (SFT)"]
    rel = (t["rouge_l"] - s["rouge_l"]) / max(s["rouge_l"], 1e-12)
    ppl = 1.0 - t["ppl"] / s["ppl"]
    return {"rouge_l_rel_gain": rel, "rouge_l_abs_gain": t["rouge_l"] - s["rouge_l"],
            "ppl_reduction": ppl,
            "worth_distilling": bool((rel >= 0.5 or t["rouge_l"] - s["rouge_l"] >= 0.05)
                                     and ppl >= 0.2)}


def teacher_gap_note(gap: dict) -> str:
    """The note on :func:`teacher_gap`'s numbers, each gap said in the direction it went
    ("2.4% lower", never "-2.4% higher")."""
    def way(frac: float, up: str, down: str) -> str:
        if math.isnan(frac):
            return "not measured"
        return f"{100 * abs(frac):.1f}% {up if frac >= 0 else down}"

    return (f"Teacher worth distilling: the MoE teacher's ROUGE-L is "
            f"{way(gap['rouge_l_rel_gain'], 'higher', 'lower')} "
            f"({gap['rouge_l_abs_gain']:+.4f}) and its response perplexity "
            f"{way(gap['ppl_reduction'], 'lower', 'higher')} than the SFT student's: the >= "
            "50% (or 0.05) ROUGE-L and >= 20% perplexity gap this setting is built for "
            + ("holds." if gap["worth_distilling"] else "does NOT hold.")
            + " (The claims are judged where the teacher leads by at least Table 1's weakest "
            f"{100 * MIN_TEACHER_GAIN:.1f}% ROUGE-L.)")


def rouge_claim(claim: str, rows: list[dict] | None) -> Claim:
    """``claim`` judged on the paired per-seed ROUGE-L differences alone, the paper's one
    metric ("We adopt the ROUGE-L score as the evaluation metric", Table 1); the response
    perplexity's paired row is reported beside it, never as a condition (teacher-forced
    perplexity on the reference responses favours the methods trained on them)."""
    rows = rows or []
    rouge = [r for r in rows if r.get("metric", "rouge_l") == "rouge_l"]
    c = paired_claim(claim, rouge)
    ppl = [r for r in rows if r.get("metric") == "-ppl"]
    if rouge and ppl:
        c = c._replace(evidence=f"{c.evidence}; beside it, not judged: "
                                f"{paired_claim(claim, ppl).evidence}")
    return c


# Table 1's weakest teacher still beats its student by this much average ROUGE-L
# (Llama-MoE-3.0B 23.77 vs the SFT Sheared-Llama-1.3B 21.82): a claim about distilling from
# the MoE teacher is judged only where its teacher is at least as far ahead.
MIN_TEACHER_GAIN = 0.089

# Sec. 5.1: "For this comparison to be fair, dense teacher and MoE teacher should have
# comparable performances". Table 1's dense teacher (average ROUGE-L 24.18) lies within 2.4%
# of every MoE teacher's (23.77-24.76): teachers further apart than this are not comparable.
COMPARABLE_TEACHERS = 0.025

# the claims that set the dense teacher against the MoE teacher
DENSE_VS_MOE = ("KD: dense - MoE teacher", "GKD: dense - MoE teacher")


def setting_fault(label: str, holds: bool, refs: dict) -> str | None:
    """Why the verdict ``holds`` (True: holds, False: does not hold) on the comparison
    ``label`` says nothing about the paper here, or None. Every claim needs an MoE teacher
    ahead of the SFT student by :data:`MIN_TEACHER_GAIN` ROUGE-L; a dense-versus-MoE claim
    also needs teachers of comparable ROUGE-L (:data:`COMPARABLE_TEACHERS`), unless the
    weaker teacher is the one whose student came out better. ``refs``: the ``references``
    table's rows by model (ROUGE-L before distillation)."""
    if "MoE teacher" not in refs or "student (SFT)" not in refs:
        return "no references table: the teacher's lead over the student is unchecked"
    gain = teacher_gap(refs)["rouge_l_rel_gain"]
    if not gain >= MIN_TEACHER_GAIN:  # NaN (a teacher or student not measured) too
        return (f"the MoE teacher leads the SFT student by {100 * gain:+.1f}% ROUGE-L before "
                f"distillation, under the {100 * MIN_TEACHER_GAIN:.1f}% of Table 1's weakest "
                "teacher: nothing here to distil")
    if label not in DENSE_VS_MOE:
        return None
    if "dense teacher" not in refs:
        return "no dense teacher in the references table: comparable teachers unchecked"
    dense, moe = (float(refs[k]["rouge_l"]) for k in ("dense teacher", "MoE teacher"))
    rel = dense / max(moe, 1e-12) - 1.0
    if rel != rel:
        return "a teacher's ROUGE-L not measured: comparable teachers unchecked"
    if (rel > COMPARABLE_TEACHERS) if holds else (rel < -COMPARABLE_TEACHERS):
        better = "dense" if rel > 0 else "MoE"
        return (f"the {better} teacher is itself the better one before distillation (ROUGE-L "
                f"dense {dense:.4f} vs MoE {moe:.4f}, {100 * rel:+.1f}%; comparable: within "
                f"{100 * COMPARABLE_TEACHERS:g}%, Sec. 5.1)")
    return None


def draws_fault(label: str, rows: list[dict]) -> str | None:
    """Why a dense-versus-MoE comparison's pairs cannot speak for the teacher kinds, or None:
    they need a teacher draw of each kind per training seed (the rows' ``teachers``; a table
    without it had one draw). With one MoE and one dense teacher for every seed, the interval
    covers the students' training only, and the difference could be those two fine-tuning
    runs' (a noisy top-k teacher's fine-tuning is chaotic: a change in the last bits of its
    numerics flips routing choices and ends in a different teacher)."""
    if label not in DENSE_VS_MOE:
        return None
    rouge = [r for r in rows if r.get("metric", "rouge_l") == "rouge_l"]
    teachers, n = (min(int(r.get(k, 1)) for r in rouge) for k in ("teachers", "n"))
    if teachers >= n:
        return None
    return (f"{teachers} teacher draw(s) of each kind for {n} paired seeds: the interval "
            "covers the students' training, not the teachers' (teachers=per_seed trains a "
            "draw per seed)")


# the control run: the SFT student trained on for the distillation's steps with no teacher
SFT = ("MoE", "SFT")


def distilled(c: Claim, label: str, per_seed: list[dict] | None) -> Claim:
    """``c`` with its control: the winner of the method comparison ``label`` beats the SFT
    student trained on for the same steps without a teacher (Table 1's SFT baseline, "which
    does not involve knowledge distillation"), paired per training seed on ROUGE-L
    (:func:`moejax.harness.claims.beats_control`). A method that wins only by another's harm
    to the student has distilled nothing shown; in Table 1 GKD, ALL, KA and SAR are 2.5-4.3
    ROUGE-L above the SFT student. The dense-versus-MoE claims need no such control: they
    compare what each teacher does to the student, harm included (Table 1's MoE-teacher KD
    ends below the SFT student)."""
    if label in DENSE_VS_MOE:
        return c
    a, b = next((a, b) for lab, a, b in COMPARISONS if lab == label)
    by = _by_run(per_seed or [])
    seeds = sorted(set(by.get(a, {})) & set(by.get(b, {})))
    return _beats_sft(c, {s: float(by[a][s]["rouge_l"]) for s in seeds}, seeds, per_seed)


def _beats_sft(c: Claim, winner: dict, seeds: list[int], per_seed: list[dict] | None) -> Claim:
    """``c`` where the winner (``{seed: ROUGE-L}``) beats the SFT student trained on alike
    over ``seeds`` (:func:`moejax.harness.claims.beats_control`)."""
    sft = _by_run(per_seed or []).get(SFT, {})
    return beats_control(c, [winner[s] for s in seeds],
                         [float(sft[s]["rouge_l"]) if s in sft else None for s in seeds],
                         name="the SFT student trained on alike (no teacher)", fmt=".4f",
                         so="it distils nothing shown of its teacher")


def judged(label: str, rows: list[dict] | None, refs: dict,
           per_seed: list[dict] | None = None) -> Claim:
    """The claim of the comparison ``label`` on its paired rows (:func:`rouge_claim`), made
    inconclusive where the setting cannot test it (:func:`setting_fault`,
    :func:`draws_fault`) or where its winner distilled nothing shown (:func:`distilled`,
    from the ``per_seed`` table's runs)."""
    c = rouge_claim(CLAIMS[label], rows)
    if c.holds is None:
        return c
    fault = setting_fault(label, c.holds, refs) or draws_fault(label, rows)
    return distilled(c, label, per_seed) if fault is None else unjudged(c, fault)


MORE_EXPERTS = ("A KD student gains as its MoE teacher uses more experts, short of all of "
                "them (Sec. 3, Fig. 2)")


def more_experts(t: dict[str, list[dict]], refs: dict) -> Claim:
    """Fig. 2: "using more experts does not necessarily increase the performance of the
    teacher, but it certainly increases the performance of the student, except when all are
    used". The KD student from the largest swept k short of all the experts against the one
    from the smallest, paired per training seed on ROUGE-L (``teacher_k_per_seed``), in a
    setting with a teacher worth distilling (:func:`setting_fault`), and with the method
    claims' control: the winner beats the SFT student trained on alike (:func:`distilled`'s
    rule, from ``per_seed``)."""
    rows = t.get("teacher_k_per_seed") or []
    by = {}
    for r in rows:
        if float(r["k"]) < float(r["of_experts"]):
            by.setdefault(int(float(r["k"])), {})[int(float(r["seed"]))] = float(
                r["student_rouge_l"])
    if len(by) < 2:
        return Claim(MORE_EXPERTS, None, "fewer than two teacher k short of all the experts "
                                         "swept over the seeds")
    lo, hi = min(by), max(by)
    seeds = sorted(set(by[lo]) & set(by[hi]))
    c = paired_claim(MORE_EXPERTS, paired(f"KD student, teacher k={hi} - k={lo}",
                                          [by[hi][s] for s in seeds],
                                          [by[lo][s] for s in seeds]))
    if c.holds is None:
        return c
    fault = setting_fault("", c.holds, refs)
    if fault is not None:
        return unjudged(c, fault)
    return _beats_sft(c, by[hi], seeds, t.get("per_seed"))


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """The paper's main-table claims (Table 1, Sec. 5.2), each judged on the paired
    per-seed ROUGE-L differences (:func:`rouge_claim`: holds when the 95% interval lies above
    zero): with an MoE teacher ALL, KA and SAR beat GKD, which beats KD; a comparable dense
    teacher gives better KD and GKD students than the MoE teacher. A verdict stands only in a
    setting that can test it (:func:`setting_fault`, from the ``references`` table), a
    method's "holds" only where its winner beats SFT alone (:func:`distilled`, from
    ``per_seed``); and Fig. 2's more experts for the student (:func:`more_experts`)."""
    rows = {}
    for r in t.get("paired") or []:
        rows.setdefault(r["comparison"], []).append(r)
    refs = {r["model"]: r for r in t.get("references") or []}
    return [*(judged(label, rows.get(label), refs, t.get("per_seed")) for label in CLAIMS),
            more_experts(t, refs)]


CLAIMS = {"GKD - KD (MoE teacher)": "GKD beats KD with the MoE teacher (Table 1)",
          "ALL - GKD (MoE teacher)": "ALL beats GKD with the MoE teacher (Table 1)",
          "KA - GKD (MoE teacher)": "KA beats GKD with the MoE teacher (Table 1)",
          "SAR - GKD (MoE teacher)": "SAR beats GKD with the MoE teacher (Table 1)",
          "KD: dense - MoE teacher": "KD from the dense teacher beats KD from the MoE "
                                     "teacher (Table 1, Sec. 5.2)",
          "GKD: dense - MoE teacher": "GKD from the dense teacher beats GKD from the MoE "
                                      "teacher (Table 1, Sec. 5.2)"}
