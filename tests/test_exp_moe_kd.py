"""Smoke test: the MoE distillation study runs tiny end to end (tiny substrate, both teachers,
two training seeds, the teacher-k and learning-rate sweeps, SAR's router KL over seeds) and
writes its tables; the paired comparison and its claim are recomputed from the per-seed runs.
Every method's training is covered by tests/test_distill_train.py."""

import csv
import re
from pathlib import Path

import pytest

from experiments.kd import claims as kd_claims
from experiments.kd import moe_kd as mod  # imported before tiny_recipes patches the registry
from experiments.kd.setup import data
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.data.tokenizer import ByteTokenizer
from moejax.harness.claims import paired_claim
from moejax.harness.experiment import run_experiment
from moejax.train.hparams import TrainConfig
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig
from tests.tiny_substrates import tiny_lm


def _tiny_config(tiny_recipes, **kw) -> mod.MoEKDConfig:
    return mod.MoEKDConfig(**{**dict(
        model="dense_lm_prose", dense_lm_prose=tiny_lm("dense_lm_prose", "quick"),
        substrate_cache=str(tiny_recipes),
        upcycle=UpcycleConfig(blocks="all", expert_form="split", moe=UPCYCLE_MOE.replace(
            n_experts=4, top_k=2, router="noisy", balance_loss="cv2", dispatch="dense")),
        student_layers=1, prompt_len=12,
        response_len=6, n_train=64, n_val=4, n_test=6,
        sft=TrainConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, log_every=1),
        distill=TrainConfig(steps=4, batch_size=4, lr=1e-3, warmup_steps=0, eval_every=2,
                            log_every=2),
        methods=("kd", "sar"), dense_teacher_methods=("kd",), teacher_ks=(4,), ka_lambdas=(),
        ka_ms=(), lr_sweep=(3e-3,), router_lr_sweep=(), seeds=2, eval_seeds=2), **kw})


@pytest.mark.slow
def test_moe_kd_tiny(tiny_recipes, tmp_path):
    cfg = _tiny_config(tiny_recipes)
    summary, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                                  claims=mod.claims, out=tmp_path / "kd")
    rows = list(csv.DictReader(open(run.path / "main.csv")))
    assert [(r["teacher"], r["method"]) for r in rows] == (
        [("MoE teacher", m) for m in ("KD", "SAR")]
        + [("dense teacher", "KD")])
    for r in rows:  # one score per training x sampling seed; the summary has the table's values
        assert int(r["scores"]) == 4 and int(r["runs"]) == 2
        key = f"{r['method']}_{r['teacher'].split()[0]}"
        assert summary[key] == float(r["rouge_l"])
    # the paired table recomputed from the per-seed runs
    per = {(r["teacher"], r["method"], int(r["seed"])): r
           for r in csv.DictReader(open(run.path / "per_seed.csv"))}
    d = [float(per[("dense teacher", "KD", s)]["rouge_l"])
         - float(per[("MoE teacher", "KD", s)]["rouge_l"]) for s in (0, 1)]
    pair = {(r["comparison"], r["metric"]): r for r in csv.DictReader(open(run.path /
                                                                            "paired.csv"))}
    got = pair[("KD: dense - MoE teacher", "rouge_l")]
    assert float(got["mean_diff"]) == pytest.approx(sum(d) / 2, abs=1e-9)
    assert int(got["wins"]) == sum(x > 0 for x in d) and int(got["n"]) == 2
    refs = {r["model"] for r in csv.DictReader(open(run.path / "references.csv"))}
    assert refs == {"MoE teacher", "student (SFT)", "dense teacher"}
    sweep = list(csv.DictReader(open(run.path / "lr_sweep.csv")))
    assert [float(r["student_lr"]) for r in sweep] == [3e-3]
    # KD trains no router: blank router columns, not a NaN that reads as unmeasured
    assert [(r["router_lr"], r["router_kl"]) for r in sweep] == [("", "")]
    mass = list(csv.DictReader(open(run.path / "gate_mass.csv")))
    assert [int(m["layer"]) for m in mass] == [0, 1]  # one row per MoE layer of the teacher
    ks = list(csv.DictReader(open(run.path / "teacher_k.csv")))
    assert [(int(r["k"]), int(r["n_seeds"])) for r in ks] == [(4, 2)]  # every training seed
    each = list(csv.DictReader(open(run.path / "teacher_k_per_seed.csv")))
    assert [(int(r["seed"]), int(r["of_experts"])) for r in each] == [(0, 4), (1, 4)]
    kl = list(csv.DictReader(open(run.path / "sar_kl.csv")))  # per layer, over the 2 seeds
    # the student-aware router moves away from the teacher's: a KL that is there, and finite
    assert len(kl) == 2 and all(0 < float(r["mean_kl"]) <= float(r["max_kl"]) < 1e3
                                and int(r["n_seeds"]) == 2 for r in kl)
    assert (run.path / "main.png").exists() and (run.path / "gate_mass.png").exists()
    text = (run.path / "summary.md").read_text()
    assert "Paired comparisons are judged on ROUGE-L" in text
    assert "Teacher worth distilling" in text
    assert set(summary["shape_holds"]) == {"KD: dense - MoE teacher"}
    # no GKD run: every claim that needs it is unmeasured; the dense-vs-MoE KD one is judged
    verdicts = {c["claim"]: c["verdict"] for c in csv.DictReader(open(run.path / "claims.csv"))}
    assert len(verdicts) == 7
    kd_claim = next(v for c, v in verdicts.items() if c.startswith("KD from the dense"))
    rows = [r for r in csv.DictReader(open(run.path / "paired.csv"))
            if r["comparison"] == "KD: dense - MoE teacher"]
    assert {r["metric"] for r in rows} == {"rouge_l", "-ppl"}  # both reported
    paired_kd = paired_claim("KD", [{k: (float(v) if k in ("mean_diff", "std_diff") else v)
                                     for k, v in r.items()} for r in rows
                                    if r["metric"] == "rouge_l"])
    refs = {r["model"]: {k: (v if k == "model" else float(v)) for k, v in r.items()}
            for r in csv.DictReader(open(run.path / "references.csv"))}
    unfit = paired_kd.holds is not None and kd_claims.setting_fault(
        "KD: dense - MoE teacher", paired_kd.holds, refs) is not None
    assert kd_claim == ("inconclusive" if unfit else paired_kd.verdict)
    # and Fig. 2's: k = 4 of 4 experts is all of them, short of which nothing was swept
    assert sum(v == "not measured" for v in verdicts.values()) == 6
    # each training seed distilled from its own draw of the teachers and the SFT student
    assert {int(r["teachers"]) for r in rows} == {2}
    assert [int(per[("MoE teacher", "KD", s)]["teacher_draw"]) for s in (0, 1)] == [0, 1]
    draws = {(r["model"], int(r["seed"])): r
             for r in csv.DictReader(open(run.path / "references_per_seed.csv"))}
    assert set(draws) == {(m, s) for m in refs for s in (0, 1)}
    for m in refs:  # two fine-tuning runs, two models; the pooled table their mean
        ppl = [float(draws[(m, s)]["ppl"]) for s in (0, 1)]
        assert ppl[0] != ppl[1] and float(refs[m]["ppl"]) == pytest.approx(sum(ppl) / 2)


def test_moe_kd_shared_teachers(tiny_recipes, tmp_path):
    """``teachers=shared``: one draw for both seeds (no per-seed references), the pairs say
    so, and the dense-vs-MoE claim is not judged on them."""
    cfg = _tiny_config(tiny_recipes, methods=("kd",), lr_sweep=(), teacher_ks=(),
                       teachers="shared")
    _, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                            claims=mod.claims, out=tmp_path / "kd")
    per = list(csv.DictReader(open(run.path / "per_seed.csv")))
    assert {(int(r["seed"]), int(r["teacher_draw"])) for r in per} == {(0, 0), (1, 0)}
    assert not (run.path / "references_per_seed.csv").exists()
    pair = [r for r in csv.DictReader(open(run.path / "paired.csv"))]
    assert {(int(r["teachers"]), int(r["n"])) for r in pair} == {(1, 2)}
    dense_vs = [r for r in pair if r["comparison"] == "KD: dense - MoE teacher"]
    assert "not the teachers'" in kd_claims.draws_fault("KD: dense - MoE teacher", dense_vs)
    verdicts = {c["claim"]: c["verdict"] for c in csv.DictReader(open(run.path / "claims.csv"))}
    assert next(v for k, v in verdicts.items() if k.startswith("KD from the dense")) in (
        "inconclusive", "not measured")
    assert "teachers=shared" in (run.path / "summary.md").read_text()


def test_the_summary_names_each_distillation_setting_changed_from_the_papers():
    """A run whose methods sample or weigh otherwise than the paper says so beside its
    verdicts (kd.on_policy_fraction=0.5 ran GKD, ALL, KA and SAR half off-policy, unnoted);
    the presets change none."""
    for preset in ("quick", "full"):
        assert "Changed from the paper's" not in mod._setting_note(mod.make_config(preset))
    cfg = mod.make_config("quick")
    note = mod._setting_note(cfg.replace(kd=cfg.kd.replace(on_policy_fraction=0.5,
                                                           temperature=0.7, sar_beta=0.0)))
    assert ("Changed from the paper's distillation: kd.on_policy_fraction=0.5 (the share of "
            "rows whose response the student samples; the paper's: 1.0); kd.temperature=0.7 "
            "(the student's sampling temperature; the paper's: 1.0); kd.sar_beta=0.0 "
            "(SAR's balance-loss weight; the paper's: 0.01).") in note


def test_a_derslm_teacher_rank_past_full_rank_is_refused_before_anything_runs():
    """The upcycled teacher's DeRS-LM rank is checked against its substrate's FFN (d_model
    256, d_hidden 768 for dense_lm_chat) with the config, not when the teacher is built."""
    cfg = mod.make_config("quick")
    with pytest.raises(ConfigError, match=re.escape("upcycle.lm_rank=257: a rank past "
                                                    "min(d_model, d_hidden) = 256")):
        apply_overrides(cfg, ["upcycle.expert_form=lm", "upcycle.lm_rank=257"])
    assert apply_overrides(cfg, ["upcycle.expert_form=lm", "upcycle.lm_rank=256"])


def test_teacher_gap_needs_both_the_rouge_and_the_perplexity_gap():
    def gap(t, s, tp, sp):
        return mod.teacher_gap({"MoE teacher": {"rouge_l": t, "ppl": tp},
                                "student (SFT)": {"rouge_l": s, "ppl": sp}})

    g = gap(0.75, 0.5, 3.0, 4.0)  # +50% ROUGE-L, 25% lower perplexity
    assert (g["rouge_l_rel_gain"], g["ppl_reduction"], g["worth_distilling"]) == (0.5, 0.25, True)
    assert gap(0.55, 0.5, 3.0, 4.0)["worth_distilling"] is True  # +0.05 absolute (+10%) suffices
    assert gap(0.06, 0.05, 3.0, 4.0)["worth_distilling"] is False  # +20%, +0.01: too small
    assert gap(0.75, 0.5, 3.5, 4.0)["worth_distilling"] is False  # perplexity only 12.5% lower


# before distillation: an MoE teacher 40% ahead of the student, a dense teacher level with it
REFERENCES = [{"model": "MoE teacher", "rouge_l": 0.070, "ppl": 4.0},
              {"model": "student (SFT)", "rouge_l": 0.050, "ppl": 6.0},
              {"model": "dense teacher", "rouge_l": 0.070, "ppl": 3.8}]


def _runs(gain: float = 0.01, seeds: int = 5) -> list[dict]:
    """A ``per_seed`` table: every (teacher, method) at each seed, each method ``gain``
    ROUGE-L above the SFT student trained on alike (seed noise 0.001 apart)."""
    return [{"teacher": f"{kind} teacher", "method": m, "seed": s,
             "rouge_l": 0.05 + (0.0 if m == "SFT" else gain + 0.001 * (s % 2))}
            for kind in ("MoE", "dense") for m in ("SFT", "KD", "GKD", "ALL", "KA", "SAR")
            for s in range(seeds)]


RUNS = _runs()


def test_claims_are_judged_on_rouge_l_alone_with_perplexity_beside_it():
    """The paper's metric is ROUGE-L: a ROUGE-L win with a perplexity loss holds; a ROUGE-L
    loss with a perplexity win does not; the perplexity row is in the evidence either way."""
    def rows(rouge, ppl):
        return {"references": REFERENCES, "per_seed": RUNS, "paired": [
            {"metric": "rouge_l", "comparison": "GKD - KD (MoE teacher)", "mean_diff": rouge,
             "std_diff": 0.001, "wins": 5 if rouge > 0 else 0, "n": 5},
            {"metric": "-ppl", "comparison": "GKD - KD (MoE teacher)", "mean_diff": ppl,
             "std_diff": 0.01, "wins": 5 if ppl > 0 else 0, "n": 5}]}

    first = lambda t: mod.claims(t)[0]  # noqa: E731
    c = first(rows(0.02, -0.3))
    assert c.verdict == "holds" and "not judged" in c.evidence and "-ppl" in c.evidence
    assert first(rows(-0.02, 0.3)).verdict == "does not hold"
    assert first(rows(0.0001, -0.3)).verdict == "inconclusive"
    assert first({"paired": []}).verdict == "not measured"


def _paired(comparison: str, diff: float, teachers: int = 5) -> dict:
    """One comparison's ROUGE-L row, 5 of 5 seeds ``diff`` apart (std 0.001), from
    ``teachers`` teacher draws."""
    return {"metric": "rouge_l", "comparison": comparison, "mean_diff": diff,
            "std_diff": 0.001, "wins": 5 if diff > 0 else 0, "n": 5, "teachers": teachers}


def test_a_verdict_stands_only_in_a_setting_that_can_test_it():
    """Every claim needs an MoE teacher ahead of the student by Table 1's weakest margin
    (8.9%); a dense-vs-MoE claim needs comparable teachers (within 2.5%, Sec. 5.1), except
    where the weaker teacher's student won. Otherwise the verdict reads inconclusive, with the
    reason in its evidence; without a references table nothing is judged."""
    def verdicts(moe, dense, student=0.050, diff=0.01):
        refs = [{"model": "MoE teacher", "rouge_l": moe, "ppl": 4.0},
                {"model": "student (SFT)", "rouge_l": student, "ppl": 6.0},
                {"model": "dense teacher", "rouge_l": dense, "ppl": 4.0}]
        got = mod.claims({"references": refs, "per_seed": RUNS,
                          "paired": [_paired(label, diff) for label in mod.CLAIMS]})[:6]
        return [c.verdict for c in got], got

    method, dense_vs = ["holds"] * 4, ["holds"] * 2
    assert verdicts(0.070, 0.070)[0] == method + dense_vs  # a fit setting: as the pairs say
    assert verdicts(0.070, 0.071)[0] == method + dense_vs  # +1.4%: still comparable
    # the dense teacher 10% ahead: its students winning says nothing; losing still does
    v, got = verdicts(0.070, 0.077)
    assert v == method + ["inconclusive"] * 2
    assert "dense teacher is itself the better one" in got[4].evidence
    assert verdicts(0.070, 0.077, diff=-0.01)[0] == ["does not hold"] * 6
    # the MoE teacher 10% ahead: the dense-teacher students losing says nothing
    assert verdicts(0.077, 0.070, diff=-0.01)[0] == ["does not hold"] * 4 + ["inconclusive"] * 2
    assert verdicts(0.077, 0.070)[0] == ["holds"] * 6
    # an MoE teacher only 8% ahead of the student: no claim is judged, either way
    for diff in (0.01, -0.01):
        v, got = verdicts(0.054, 0.054, diff=diff)
        assert v == ["inconclusive"] * 6 and "nothing here to distil" in got[0].evidence
    assert verdicts(float("nan"), 0.07)[0] == ["inconclusive"] * 6  # a teacher not measured
    v, got = verdicts(0.070, float("nan"))  # the dense teacher not measured: its claims only
    assert v == method + ["inconclusive"] * 2 and "comparable teachers unchecked" in \
        got[4].evidence
    no_refs = mod.claims({"paired": [_paired(label, 0.01) for label in mod.CLAIMS]})[:6]
    assert [c.verdict for c in no_refs] == ["inconclusive"] * 6
    assert "no references table" in no_refs[0].evidence


def test_teacher_kinds_are_compared_only_over_a_teacher_draw_per_seed():
    """A dense-vs-MoE verdict needs a draw of each teacher per paired seed: with one MoE and
    one dense teacher for all seeds (or a table that does not say, from a run with one) it
    reads inconclusive either way; the method claims, made with one teacher, stand."""
    def verdicts(teachers, diff=0.01, key=True):
        rows = [_paired(label, diff, teachers) for label in mod.CLAIMS]
        if not key:
            rows = [{k: v for k, v in r.items() if k != "teachers"} for r in rows]
        return mod.claims({"references": REFERENCES, "paired": rows, "per_seed": RUNS})[:6]

    assert [c.verdict for c in verdicts(5)] == ["holds"] * 6
    for diff, method in ((0.01, "holds"), (-0.01, "does not hold")):
        for got in (verdicts(1, diff), verdicts(4, diff), verdicts(5, diff, key=False)):
            assert [c.verdict for c in got] == [method] * 4 + ["inconclusive"] * 2
            assert "not the teachers'" in got[4].evidence


def test_a_method_win_stands_only_where_the_winner_beats_sft_alone():
    """A method's win counts only where the winner also beats the SFT student trained on for
    the same steps without a teacher, paired per seed: a winner level with SFT won by the
    other's harm. A "does not hold" stands either way; with no SFT run, a "holds" is
    unchecked. The dense-versus-MoE claims compare the teachers' effect, harm included, and
    take no such control."""
    def verdicts(runs, diff=0.01):
        got = mod.claims({"references": REFERENCES, "per_seed": runs,
                          "paired": [_paired(label, diff) for label in mod.CLAIMS]})[:6]
        return [c.verdict for c in got], got

    assert verdicts(_runs(0.01))[0] == ["holds"] * 6
    v, got = verdicts(_runs(0.0))  # every method level with SFT (noise 0.001 either way)
    assert v == ["inconclusive"] * 4 + ["holds"] * 2
    assert "distils nothing shown of its teacher" in got[0].evidence
    assert verdicts(_runs(-0.01))[0] == ["inconclusive"] * 4 + ["holds"] * 2  # all harm
    assert verdicts(_runs(0.0), diff=-0.01)[0] == ["does not hold"] * 6
    v, got = verdicts([r for r in RUNS if r["method"] != "SFT"])
    assert v == ["inconclusive"] * 4 + ["holds"] * 2 and "was not recorded" in got[0].evidence
    assert "it beats the SFT student" in verdicts(RUNS)[1][0].evidence
    # the winner is checked against SFT, not the loser: GKD above SFT, KD harming below it
    gains = {"SFT": 0.0, "KD": -0.01, "GKD": 0.01}
    split = [{**r, "rouge_l": 0.05 + gains[r["method"]] + 0.001 * (r["seed"] % 2)}
             for r in RUNS if r["method"] in gains]
    v, got = verdicts(split)
    assert v[0] == "holds" and "it beats the SFT student" in got[0].evidence


def test_more_experts_claim_pairs_the_students_short_of_all_the_experts():
    """Fig. 2: the KD student from the largest k short of all the experts against the one
    from the smallest, paired per seed; k = all is left out (the paper's exception); a
    teacher not worth distilling, or a winner no better than SFT alone, is no verdict."""
    def rows(gain, at_all=-1.0):  # student ROUGE-L 0.06 at k=1, + gain at k=4, k=8 of 8
        return [{"seed": s, "k": k, "of_experts": 8, "teacher_rouge_l": 0.07,
                 "student_rouge_l": 0.06 + 0.001 * (s % 2) + {1: 0.0, 4: gain, 8: at_all}[k]}
                for s in range(5) for k in (1, 4, 8)]

    def claim(gain, refs=REFERENCES, runs=RUNS, **kw):
        return mod.claims({"references": refs, "per_seed": runs,
                           "teacher_k_per_seed": rows(gain, **kw)})[6]

    c = claim(0.01)
    assert c.verdict == "holds" and "k=4 - k=1" in c.evidence  # k=8, all of them, left out
    k2 = [{**r, "k": 2, "student_rouge_l": r["student_rouge_l"] + 0.02}  # a k between them
          for r in rows(0.01) if r["k"] == 1]
    c = mod.claims({"references": REFERENCES, "per_seed": RUNS,
                    "teacher_k_per_seed": rows(0.01) + k2})[6]
    assert c.verdict == "holds" and "k=4 - k=1" in c.evidence  # the smallest k, not the next
    assert claim(-0.01).verdict == "does not hold"
    assert claim(0.01, at_all=0.5).verdict == "holds"  # whatever k = all does
    weak = [{**r, "rouge_l": 0.052} if r["model"] == "MoE teacher" else r for r in REFERENCES]
    assert "nothing here to distil" in claim(0.01, refs=weak).evidence
    level = [{**r, "rouge_l": 0.1} if r["method"] == "SFT" else r for r in RUNS]
    assert "distils nothing shown" in claim(0.01, runs=level).evidence
    assert mod.claims({"references": REFERENCES})[6].verdict == "not measured"


HF_QWEN3 = Path(__file__).parent / "fixtures" / "hf_moe" / "qwen3_moe"


@pytest.mark.slow
def test_moe_kd_distils_an_imported_hugging_face_moe(tmp_path):
    """``teacher=hf:<dir>``: the tiny Qwen3-MoE fixture (its char-level tokenizer.json) is the
    teacher, its first block the student; KD and GKD run, the summary names the teacher, and
    what an imported teacher cannot do is refused before anything runs."""
    cfg = mod.make_config("quick").replace(
        teacher=f"hf:{HF_QWEN3}", student_layers=1, prompt_len=24, response_len=8,
        n_train=32, n_val=2, n_test=3,
        sft=TrainConfig(steps=2, batch_size=2, lr=1e-3, warmup_steps=0, log_every=1),
        distill=TrainConfig(steps=2, batch_size=2, lr=1e-3, warmup_steps=0, eval_every=2,
                            log_every=1),
        methods=("kd", "gkd"), dense_teacher_methods=(), teacher_ks=(1,), ka_lambdas=(),
        ka_ms=(), lr_sweep=(), router_lr_sweep=(), seeds=1, eval_seeds=1)
    summary, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [],
                                  claims=mod.claims, out=tmp_path / "kd")
    rows = list(csv.DictReader(open(run.path / "main.csv")))
    assert [(r["teacher"], r["method"]) for r in rows] == [("MoE teacher", "KD"),
                                                           ("MoE teacher", "GKD")]
    assert "MoE teacher: the imported checkpoint qwen3_moe (2 layers, 4 experts, top-2" in (
        run.path / "summary.md").read_text()
    assert [int(m["layer"]) for m in csv.DictReader(open(run.path / "gate_mass.csv"))] == [0, 1]
    # one draw of an imported teacher by default (seeds copies of a checkpoint), per seed asked
    assert (cfg.replace(seeds=3).teacher_draws,
            cfg.replace(seeds=3, teachers="per_seed").teacher_draws) == (1, 3)
    assert (cfg.replace(teacher="", seeds=3).teacher_draws,
            cfg.replace(teacher="", seeds=3, teachers="shared").teacher_draws) == (3, 1)
    for bad, words in [(dict(dense_teacher_methods=("kd",)), "has no dense teacher"),
                       (dict(methods=("sar",)), "router is softmax: drop sar"),
                       (dict(teacher_ks=(8,)), "must lie in [1, 4]"),
                       (dict(student_layers=2), "must be in [1, 2)"),
                       (dict(prompt_len=60), "exceeds the model's max_seq_len (64)"),
                       (dict(teacher=f"hf:{tmp_path}"), "give hf:<dir> of a Hugging Face")]:
        with pytest.raises(Exception, match=re.escape(words)):
            cfg.replace(**bad)


def test_paired_rows_pair_the_shared_seeds_and_flip_perplexity():
    """GKD ran seeds 0-2, KD seeds 0-1: the pairs are seeds 0 and 1; the perplexity row is
    oriented so that a positive difference means the first method's is lower."""
    rows = [{"teacher": "MoE teacher", "method": m, "seed": s, "rouge_l": r, "ppl": p}
            for m, s, r, p in (("GKD", 0, 0.30, 5.0), ("GKD", 1, 0.32, 6.0), ("GKD", 2, 0.9, 1.0),
                               ("KD", 0, 0.20, 7.0), ("KD", 1, 0.30, 7.0))]
    out = {r["metric"]: r for r in kd_claims.paired_rows(rows)
           if r["comparison"] == "GKD - KD (MoE teacher)"}
    assert out["rouge_l"]["n"] == 2 == out["-ppl"]["n"]
    assert out["rouge_l"]["mean_diff"] == pytest.approx(0.06)
    assert out["-ppl"]["mean_diff"] == pytest.approx(1.5) and out["-ppl"]["wins"] == 2


def test_more_chat_pairs_than_a_split_holds_are_refused_before_training():
    """The validation and test evaluators take one batch of n_val / n_test pairs, and a
    batch past a split's end wraps round to its first rows: 8,000 test pairs asked of a
    split of 7,316 would score 684 of them twice and call it 8,000."""
    cfg = mod.make_config("quick").replace(n_train=64, n_val=8, n_test=8000)
    with pytest.raises(ValueError, match="n_test=8000: the chit-chat test split holds 7316 "
                                         "pairs; lower n_test"):
        data(cfg, ByteTokenizer())
    train_src, _, test = data(cfg.replace(n_test=8), ByteTokenizer())
    assert len(train_src(4, 0)) == 64


def test_the_teacher_gap_note_says_each_gap_in_the_direction_it_went():
    def note(t, s, tp, sp):
        return kd_claims.teacher_gap_note(kd_claims.teacher_gap(
            {"MoE teacher": {"rouge_l": t, "ppl": tp}, "student (SFT)": {"rouge_l": s,
                                                                         "ppl": sp}}))

    ahead = note(0.75, 0.5, 3.0, 4.0)
    assert "ROUGE-L is 50.0% higher (+0.2500) and its response perplexity 25.0% lower" in ahead
    assert ahead.endswith("holds. (The claims are judged where the teacher leads by at least "
                          "Table 1's weakest 8.9% ROUGE-L.)")
    behind = note(0.02, 0.025, 4.8, 4.0)  # a teacher worse on both counts
    assert "ROUGE-L is 20.0% lower (-0.0050) and its response perplexity 20.0% higher" in behind
    assert "does NOT hold." in behind and "-20" not in behind
    assert "ROUGE-L is not measured" in note(float("nan"), 0.5, 3.0, 4.0)
