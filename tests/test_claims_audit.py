"""Every study's claim rules can reach each verdict: for each study, synthetic tables (in the
layout its run writes, over several seeds) for which every one of its claims must read
holds, does not hold, and inconclusive. A rule that cannot produce all three judges nothing.

Each builder takes ``d(seed)``, the per-seed margin of the claim's first arm over its second
(or of the quantity over its threshold), in the claim's own direction: clearly positive for
holds, clearly negative for does not hold, straddling zero for inconclusive."""

from __future__ import annotations

import pytest

from experiments import study_module
from experiments.blockffn import ablations, baselines, granularity, speculative
from experiments.darex import controlled, decoder, encoder, storage
from experiments.ders import compression, upcycling, upcycling_claims
from experiments.ders.compression_claims import PAPER_SETTINGS
from experiments.extraction import moee
from experiments.kd import moe_kd
from experiments.main import REGISTRY, entries
from moejax.harness.claims import SEED_TABLES

SEEDS = range(4)
MARGINS = {"holds": lambda s: 0.1 + 0.001 * s,
           "does not hold": lambda s: -0.1 - 0.001 * s,
           "inconclusive": lambda s: (0.05, -0.06, 0.07, -0.05)[s]}


def _seeded(per_seed_tables: list[dict]) -> dict:
    """A repeated study's tables: the seed runs' and (for the rules that read them) the
    first run's as the merged ones."""
    return {**per_seed_tables[0], SEED_TABLES: per_seed_tables}


def darex_encoder(d):
    # each claim's first arm one level above its second: d, per-layer q_v 2 d over DARE
    level = {("AdamW", "DARE"): 0, ("AdamW", "DAREx-q (q_v)"): 1,
             ("AdamW", "DAREx-q (per-layer q_v)"): 2, ("AdamR-L2", "AdamR-L2 + DARE"): 1,
             ("AdamW", "DAREx-q (q_e)"): 1, ("AdamW", "DAREx-q (per-layer q_e)"): 1,
             ("AdamW", "structural DPP + q_v"): 0,
             ("AdamR-L2", "AdamR-L2 + structural DPP + q_v"): 1,
             ("AdamW", "magnitude"): 0, ("AdamR-L1", "AdamR-L1 + magnitude"): 1}
    rows = []
    for s in SEEDS:
        for (ft, m), k in level.items():
            rows.append({"task": "pos", "seed": s, "fine-tuning": ft, "method": m,
                         "accuracy": 0.5 + k * d(s)})
        for ft in ("AdamW", "AdamR-L2", "AdamR-L1"):  # the control: the deltas dropped whole
            rows.append({"task": "pos", "seed": s, "fine-tuning": ft, "method": encoder.DROPPED,
                         "accuracy": 0.3 + 0.01 * s})
    return {"per_seed": rows}


def darex_decoder(d):
    def run(s):  # lower loss is better: the first arm's loss is lower by d
        return {"pruned_wide": [
            {"fine-tuning": "AdamW", "method": "DARE", "p=0.95": 2.0, "p=0.99": 2.0},
            {"fine-tuning": "AdamW", "method": "DAREx-q (q_v)", "p=0.99": 2.0 - d(s)},
            {"fine-tuning": "AdamR-L2", "method": "DARE", "p=0.99": 2.0 - d(s)},
            {"fine-tuning": "AdamW", "method": "DAREx-q (q_e)", "p=0.99": 2.0 - d(s)},
            {"fine-tuning": "AdamW", "method": "DAREx-q (per-layer q_e)",
             "p=0.99": 2.0 - d(s)}],
            # the winners beat the pre-trained model (their control) when d > 0
            "finetuned": [{"fine-tuning": ft, "test_loss_pretrained": 2.05,
                           "test_loss_finetuned": 1.5} for ft in ("AdamW", "AdamR-L2")],
            # Fig. 3: the one AdamR-L2 weight keeps 0.9 + d of AdamW's gain
            "l2_sweep": [{"l2_weight": 0.0, "DARE p=0.99": 2.0, "kept_of_AdamW_gain": 0.1},
                         {"l2_weight": 0.1, "DARE p=0.99": 2.0,
                          "kept_of_AdamW_gain": 0.9 + d(s)}]}
    return _seeded([run(s) for s in SEEDS])


def darex_controlled(d):
    def run(s):
        x = d(s)
        return {
            "accuracy": [{"fine-tuning": "no reg (Adam)", "method": "DARE", "p=0.99": 0.5},
                         {"fine-tuning": "no reg (Adam)", "method": "DAREx-q (q_v)",
                          "p=0.99": 0.5 + x},
                         {"fine-tuning": "AdamR-L2", "method": "DARE", "p=0.99": 0.5 + x},
                         {"fine-tuning": "no reg (Adam)", "method": "DAREx-q (q_e)",
                          "p=0.99": 0.5 + x}],
            "lora": [{"p": 0.9, "method": "DARE on LoRA factors", "accuracy": 0.5},
                     {"p": 0.9, "method": "DAREx-q (q_v) on LoRA factors",
                      "accuracy": 0.5 + x}],
            "large_deltas": [{"lr": 0.03, "mean_abs_delta": 0.01, "DARE p=0.9": 0.5,
                              "magnitude p=0.9": 0.5 + x}],
            # the drop at the strongest weight: 0.05 - x/2 (below 0.05 when x > 0)
            "l2_sweep": [{"l2_weight": 0.1, "unpruned": 0.9, "DARE p=0.999": 0.5},
                         {"l2_weight": 1.0, "unpruned": 0.9,
                          "DARE p=0.999": 0.9 - (0.05 - x / 2)}],
            "finetuned": [{"pre-trained acc digits": 0.4}]}  # the deltas worth 0.5
    return _seeded([run(s) for s in SEEDS])


def darex_storage(d):
    def run(s):  # 14x smaller, losing 0.02 - d / 10 accuracy (within the tolerance if d > 0)
        return {"storage": [{"p": 0.0, "bits": 32, "ratio_vs_fp32": 1.0, "metric": 0.9},
                            {"p": 0.9, "bits": 32, "ratio_vs_fp32": 8.0, "metric": 0.9},
                            {"p": 0.9, "bits": 4, "ratio_vs_fp32": 14.0,
                             "metric": 0.9 - (0.02 - d(s) / 10)}],
                "delta_worth": [{"pretrained": 0.4, "finetuned": 0.9, "delta_worth": 0.5}]}
    return _seeded([run(s) for s in SEEDS])


def ders_compression(d):
    def run(s):  # every paper setting keeps worth 1 - d_loss / base = 0.9 + d/2
        rows, bases = [], set()
        for sc, dec, settings, _ in PAPER_SETTINGS:
            if (sc, dec) not in bases:
                bases.add((sc, dec))
                rows.append({"scenario": sc, "decomposed": dec, "method": "base_only",
                             "setting": "", "d_loss": 1.0})
            rows += [{"scenario": sc, "decomposed": dec, "method": method, "setting": setting,
                      "d_loss": 0.1 - d(s) / 2} for method, setting in settings]
        return {"sweep": rows}
    return _seeded([run(s) for s in SEEDS])


def ders_upcycling(d):
    def row(variant, form, gap, ratio):
        return {"variant": variant, "form": form, "d_loss_vs_vanilla": gap,
                "val_loss": 1.7 + gap, "added_vs_vanilla": ratio}

    def run(s):  # DeRS within MATCH_NATS of vanilla by d/10; the control well outside;
        gap = upcycling_claims.MATCH_NATS - d(s) / 10  # each ablation's loser d/20 behind
        return {"upcycling": [row("vanilla", "vanilla", 0.0, 1.0),
                              row("DeRS-SM p=0.99", "sm", gap, 50.0),
                              row("DeRS-SM p=0.9999", "sm", gap + d(s) / 20, 500.0),
                              row("DeRS-LM r=4", "lm", gap, 20.0),
                              row("DeRS-LM r=64", "lm", gap + d(s) / 20, 2.0),
                              row("DeRS-SM p=0.99 frozen shared", "sm-frozen",
                                  gap + d(s) / 20, 50.0),
                              row(upcycling.CONTROL, "dense", 0.1, 1e9)],
                # Table 6's variants that ran cost d less than vanilla's 1 in every column
                "cost": [{"variant": v, "stored": c, "peak_train_bytes": c,
                          "peak_infer_bytes": c}
                         for v, c in (("vanilla", 1.0), ("DeRS-SM p=0.99", 1.0 - d(s)),
                                      ("DeRS-LM r=4", 1.0 - d(s)))]}
    return _seeded([run(s) for s in SEEDS])


def blockffn_baselines(d):
    rows = []
    for s in SEEDS:
        # BlockFFN's own TLS, CLS_8 and reuse over the paper's 80%, 70% and 85% by d / 2,
        # d and d
        rows += [{"size": "small", "model": "BlockFFN", "seed": s, "val_ppl": 10 - 10 * d(s),
                  "CLS_8": 0.7 + d(s), "TLS": 0.8 + d(s) / 2, "reuse": 0.85 + d(s),
                  "active_experts": 3.2, "TLS - TLS_BlockFFN": 0.0},
                 {"size": "small", "model": "ReMoE", "seed": s, "val_ppl": 10.0, "CLS_8": 0.7,
                  "TLS": 0.81, "active_experts": 3.04, "TLS - TLS_BlockFFN": 0.01},
                 {"size": "small", "model": "Dense", "seed": s, "val_ppl": 9.0, "CLS_8": 0.0}]
    return {"baselines_per_seed": rows}


def blockffn_ablations(d):
    def run(s):
        x = d(s)
        tls = {"TLS": 0.8, "n_experts": 16}  # every model at the same TLS: close
        return {"objectives": [{"model": "AL+CS", "val_ppl": 10 - 10 * x, "CLS_8": 0.5 + x,
                                **tls},
                               {"model": "AL+L1", "val_ppl": 10.0, "CLS_8": 0.5, **tls},
                               {"model": "AL+Ent", "val_ppl": 10.0, "CLS_8": 0.5, **tls},
                               {"model": "AL", "val_ppl": 10.0, "CLS_8": 0.5, **tls},
                               {"model": "CS", "val_ppl": 10.0, "CLS_8": 0.5, **tls}],
                "rmsnorm": [{"model": "AL+CS", "val_ppl": 10 - 10 * x, "act_magnitude": 4.0,
                             **tls},
                            {"model": "AL+CS, no RMSNorm", "val_ppl": 10.0,
                             "act_magnitude": 4.0 + x, **tls}]}
    return _seeded([run(s) for s in SEEDS])


def blockffn_granularity(d):
    def run(s):  # each finer setting lower by 10 d; the middle one sparser by d / 10 (within
        # half an expert of its neighbours: the PPL claims stay at close TLS)
        return {"granularity": [{"n_experts": n, "val_ppl": 10 - 10 * d(s) * i,
                                 "TLS": 0.8 + 0.1 * d(s) * (n == 8),
                                 "CLS_8": 0.6 + 0.1 * d(s) * (n == 8)}
                                for i, n in enumerate((4, 8, 32))]}
    return _seeded([run(s) for s in SEEDS])


def moe_kd_tables(d):
    rows = []
    for comparison in moe_kd.CLAIMS:
        diffs = [d(s) for s in SEEDS]
        mean = sum(diffs) / len(diffs)
        sd = (sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1)) ** 0.5
        rows += [{"metric": "rouge_l", "comparison": comparison, "mean_diff": mean,
                  "std_diff": sd, "wins": sum(x > 0 for x in diffs), "n": len(diffs),
                  "teachers": len(diffs)},  # a teacher draw per seed
                 {"metric": "-ppl", "comparison": comparison, "mean_diff": -mean,
                  "std_diff": sd, "wins": 0, "n": len(diffs),
                  "teachers": len(diffs)}]  # the other way: not judged
    # a setting that can test every claim: the MoE teacher well ahead of the student, the
    # dense teacher level with it
    refs = [{"model": "MoE teacher", "rouge_l": 0.07, "ppl": 4.0},
            {"model": "student (SFT)", "rouge_l": 0.05, "ppl": 6.0},
            {"model": "dense teacher", "rouge_l": 0.07, "ppl": 4.0}]
    # each method's winner beats the SFT student trained on alike (its control)
    runs = [{"teacher": f"{kind} teacher", "method": m, "seed": s,
             "rouge_l": 0.05 + (0.0 if m == "SFT" else 0.02 + 0.001 * s)}
            for kind in ("MoE", "dense") for m in ("SFT", "KD", "GKD", "ALL", "KA", "SAR")
            for s in SEEDS]
    # Fig. 2: the KD student from k = 4 of 8 experts d ahead of the one from k = 1
    ks = [{"seed": s, "k": k, "of_experts": 8, "teacher_rouge_l": 0.07,
           "student_rouge_l": 0.07 + (d(s) if k == 4 else 0.0)} for s in SEEDS for k in (1, 4)]
    return {"paired": rows, "references": refs, "per_seed": runs, "teacher_k_per_seed": ks}


def moee_tables(d):
    """Every MoEE claim's margin d: MACs cut 27 + 100 d %, non-embedding parameters cut
    20 + 100 d %, accuracy after KD (98 + 10 d)% of the dense model's, 0.1 d better than
    MoEfication and the Table 2 ablations at equal MACs (right after extraction and after
    KD), load CV lower by d, 10 d more experts in the later layers."""
    dense = {"model": "dense", "acc_after_kd": 1.0}
    mean = lambda f: sum(f(s) for s in SEEDS) / len(SEEDS)  # noqa: E731
    moee_row = {"model": "MoEE", "MACs_change_%": mean(lambda s: -27 - 100 * d(s)),
                "params_change_%": -20.0, "kd_vs_dense_%": 98.0, "acc_extracted": 0.8,
                "acc_after_kd": 0.9, "load_cv": 0.5}
    moef = {"model": "MoEfication (mlp router)", "MACs_change_%": moee_row["MACs_change_%"],
            "acc_after_kd": 0.9, "load_cv": 0.5}
    rand, magnitude, dbscan = ({"model": m, "MACs_change_%": moee_row["MACs_change_%"],
                                "accuracy": 0.8, "accuracy_after_kd": 0.98}
                               for m in ("random clusters + random neurons + random routing",
                                         "magnitude selection", "DBSCAN"))
    per1, per2, params = [], [], []
    for s in SEEDS:
        x = d(s)
        per1 += [{"model": "MoEE", "seed": s, "MACs_change_%": -27 - 100 * x,
                  "accuracy": 0.8 + 0.1 * x, "accuracy_after_kd": 0.98 + 0.1 * x,
                  "load_cv": 0.5 - x, "experts": f"2/2/{2 + round(100 * x)}/2"},
                 {"model": moef["model"], "seed": s, "accuracy_after_kd": 0.98,
                  "load_cv": 0.5}]
        per2 += [{"model": r["model"], "seed": s, "accuracy": 0.8, "accuracy_after_kd": 0.98}
                 for r in (rand, magnitude, dbscan)]
        params += [{"seed": s, "layer": "whole model", "removed_%": 10.0},
                   {"seed": s, "layer": "without embeddings", "removed_%": 20 + 100 * x}]
    return {"table1": [dense, moee_row, moef], "table1_per_seed": per1,
            "table2_ablations": [rand, magnitude, dbscan], "table2_per_seed": per2,
            "params_per_layer": params}


def bench_speculative(d):
    row = {"model": "grown", "params": 2e8, "mode": "spec chunk-sparse",
           "decode_dtype": "float32", "draft": "d", "speedup_vs_AR_token_sparse": 1.5,
           "draft_len": 4, "tokens_per_s": 100.0, "mean_accepted_length": 3.0,
           "same_tokens_as_AR": "True", "tokens_matching_AR": 1.0}
    dense = {**row, "mode": "spec dense", "tokens_per_s": 50.0}
    ar = [{**row, "mode": m, "draft": "", "draft_len": "", "tokens_per_s": x}
          for m, x in (("AR dense", 30.0), ("AR token-sparse", 100 / 1.5))]
    base = {"model": "grown", "draft": "", "draft_len": ""}
    prompts = []
    for s in SEEDS:  # one prompt per "seed": AR 1 s, speculative 1 / (1.5 + 5 d) s, and
        spec = 1.0 / (1.5 + 5 * d(s))  # its dense verification (1 + 5 d) times as long
        prompts += [{**base, "mode": "AR token-sparse", "prompt": s, "seconds": 1.0},
                    {**base, "mode": row["mode"], "draft": "d", "draft_len": 4, "prompt": s,
                     "seconds": spec},
                    {**base, "mode": "spec dense", "draft": "d", "draft_len": 4, "prompt": s,
                     "seconds": spec * (1 + 5 * d(s))}]
    return {"decode": [row, dense, *ar], "decode_prompts": prompts}


STUDIES = {
    "darex_encoder": (encoder.claims, darex_encoder, 8),
    "darex_decoder": (decoder.claims, darex_decoder, 5),
    "darex_controlled": (controlled.claims, darex_controlled, 6),
    "darex_storage": (storage.claims, darex_storage, 1),
    "ders_compression": (compression.claims, ders_compression, 6),
    "ders_upcycling": (upcycling.claims, ders_upcycling, 8),
    "blockffn_baselines": (baselines.claims, blockffn_baselines, 4),
    "blockffn_ablations": (ablations.claims, blockffn_ablations, 8),
    "blockffn_granularity": (granularity.claims, blockffn_granularity, 3),
    "moe_kd": (moe_kd.claims, moe_kd_tables, 7),
    "moee": (moee.claims, moee_tables, 9),
    "bench_speculative": (speculative.claims, bench_speculative, 2),
}


def test_every_study_with_claims_is_audited():

    with_claims = set()
    for _, study, _ in entries(REGISTRY):
        module = study_module(study)
        if getattr(module, "claims", None) is not None:
            with_claims.add(study)
    assert with_claims == set(STUDIES)


@pytest.mark.parametrize("kind", list(MARGINS))
@pytest.mark.parametrize("study", list(STUDIES))
def test_each_claim_reaches_each_verdict(study, kind):
    claims, build, n = STUDIES[study]
    got = claims(build(MARGINS[kind]))
    assert len(got) == n, [c.claim for c in got]
    wrong = [(c.claim, c.verdict, c.evidence) for c in got if c.verdict != kind]
    assert not wrong, wrong
