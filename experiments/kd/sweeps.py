"""The MoE-distillation study's sweeps around its main table (Every Expert Matters, Sec. 5):
Fig. 2 (the teacher's k), KA's lambda and M over seeds, Fig. 6 (SAR's router KL per layer)
and the student and router learning rates. Each takes the study's config and its setup
(:class:`experiments.kd.setup.Setup`: ``distil``, ``score``, the teachers and the data)."""

from __future__ import annotations

import numpy as np

from moejax.distill.routing_modes import RoutingMode, with_routing
from moejax.evaluate_generation import router_kl_by_layer
from moejax.harness.results import RunDir
from moejax.harness.tables import seed_summary

__all__ = ["teacher_k_sweep", "ka_sweep", "sar_kl_table", "lr_sweeps"]


def teacher_k_sweep(cfg, run: RunDir, s) -> None:
    """Fig. 2: each training seed's MoE teacher and its KD student as the teacher's k grows
    (the teacher's routing at k, :func:`moejax.distill.routing_modes.with_routing`), with
    ``of_experts``, the teacher's expert count (the paper's exception: all of them)."""
    if not cfg.teacher_ks:
        return
    n_experts = cfg.teacher_moe()[0].n_experts
    rows = []
    for seed in range(cfg.seeds):
        d = s.draw(seed)
        for k in cfg.teacher_ks:
            t_k = with_routing(d.moe_teacher, RoutingMode(mode="topk", top_k=int(k)))
            st, _ = s.distil(cfg, s.kd.replace(method="kd", teacher_k=int(k)), seed,
                             f"KD teacher k={k} s{seed}")
            rows.append({"seed": seed, "k": int(k), "of_experts": n_experts,
                         "teacher_rouge_l": d.score(t_k, kl=False)["rouge_l"],
                         "student_rouge_l": d.score(st, kl=False)["rouge_l"]})
    run.table("teacher_k_per_seed", rows, title="Teacher and KD student as the teacher's k "
              "grows, every training seed (Fig. 2 analog)")
    mean = seed_summary(rows, ["k", "of_experts"], ["teacher_rouge_l", "student_rouge_l"])
    run.table("teacher_k", mean, title="Teacher and KD student as the teacher's k grows, mean "
              "and std over training seeds (Fig. 2 analog)")
    ks = [r["k"] for r in mean]
    run.line_plot("teacher_k", {"teacher": (ks, [r["teacher_rouge_l"] for r in mean]),
                                "student (KD)": (ks, [r["student_rouge_l"] for r in mean])},
                  xlabel="teacher experts k", ylabel="test ROUGE-L", markers=True,
                  title="Fig. 2 analog")


def ka_sweep(cfg, run: RunDir, s, per_seed: list[dict]) -> None:
    """KA's lambda and M over the training seeds (the main table's KA runs included)."""
    kd = s.kd
    ka = [("lambda", float(x), kd.replace(method="ka", ka_lambda=float(x)))
          for x in cfg.ka_lambdas if float(x) != kd.ka_lambda]
    ka += [("M", int(x), kd.replace(method="ka", ka_m=int(x))) for x in cfg.ka_ms
           if int(x) != kd.ka_m]
    if not ka:
        return
    ka_rows = [{"lambda": kd.ka_lambda, "M": kd.ka_m, "seed": r["seed"],
                "rouge_l": r["rouge_l"], "ppl": r["ppl"]} for r in per_seed
               if r["method"] == "KA" and r["teacher"] == "MoE teacher"]
    for what, x, dcfg in ka:
        for seed in range(cfg.seeds):
            st, _ = s.distil(cfg, dcfg, seed, f"KA {what}={x} s{seed}")
            sc = s.score(st, kl=False)
            ka_rows.append({"lambda": dcfg.ka_lambda, "M": dcfg.ka_m, "seed": seed,
                            "rouge_l": sc["rouge_l"], "ppl": sc["ppl"]})
    run.table("ka_sweep", seed_summary(ka_rows, ["lambda", "M"], ["rouge_l", "ppl"]),
              title=f"KA: lambda and M, mean and std over training seeds (ROUGE-L of "
                    f"each run: mean over {cfg.eval_seeds} sampling seeds)")


def sar_kl_table(run: RunDir, sar_kls: list[dict]) -> None:
    """Fig. 6: KL between the original and the SAR-trained router per layer, over seeds."""
    if not sar_kls:
        return
    kl = seed_summary(sar_kls, ["layer"], ["mean_kl", "max_kl"])
    run.table("sar_kl", kl, title="KL(original gate || SAR gate) per layer, mean and std "
              "over training seeds (Fig. 6 analog; each teacher on its own hidden states)")
    layers = [r["layer"] for r in kl]
    run.line_plot("sar_kl", {"mean": (layers, [r["mean_kl"] for r in kl]),
                             "max": (layers, [r["max_kl"] for r in kl])},
                  xlabel="layer", ylabel="KL", markers=True, title="Fig. 6 analog")


def lr_sweeps(cfg, run: RunDir, s, per_seed, sar_kls) -> None:
    """Student (KD) and router (SAR) learning rates within the step budget (first seed; the
    main table's run is reused where its rate is swept)."""

    def main_run(method):  # the scores of the main table's first-seed run (MoE teacher)
        return next(({"rouge_l": r["rouge_l"], "ppl": r["ppl"], "kl": r["kl_to_moe_teacher"]}
                     for r in per_seed if (r["teacher"], r["method"], r["seed"])
                     == ("MoE teacher", method, 0)), None)

    lr_rows = []
    for lr in cfg.lr_sweep:
        sc = main_run("KD") if float(lr) == cfg.distill.lr else None
        if sc is None:
            sc = s.score(s.distil(cfg, s.kd.replace(method="kd"), 0, f"KD lr={lr:g}",
                                  lr=float(lr))[0])
        # KD trains no router: its router columns are blank (no setting), not NaN (unmeasured)
        lr_rows.append({"method": "KD", "student_lr": float(lr), "router_lr": "",
                        "rouge_l": sc["rouge_l"], "ppl": sc["ppl"], "kl": sc["kl"],
                        "router_kl": ""})
    for lr in cfg.router_lr_sweep:
        sc = main_run("SAR") if float(lr) == s.kd.router_lr else None
        if sc is not None:
            rk = [r for r in sar_kls if r["seed"] == 0]
        else:
            st, pair = s.distil(cfg, s.kd.replace(method="sar", router_lr=float(lr)), 0,
                                f"SAR router lr={lr:g}")
            sc = s.score(st)
            rk = router_kl_by_layer(s.moe_teacher, pair.teacher, [s.val.batches[0]])
        lr_rows.append({"method": "SAR", "student_lr": cfg.distill.lr, "router_lr": float(lr),
                        "rouge_l": sc["rouge_l"], "ppl": sc["ppl"], "kl": sc["kl"],
                        "router_kl": float(np.mean([r["mean_kl"] for r in rk]))})
    if lr_rows:
        run.table("lr_sweep", lr_rows, title=f"Learning rates within {cfg.distill.steps} "
                  f"steps (first training seed; the study distils at student lr "
                  f"{cfg.distill.lr:g}, router lr {cfg.kd.router_lr:g}; the paper: 1e-5)")
