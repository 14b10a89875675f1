"""Controlled DAREx study (paper App. B analog): a 2-layer MLP with RMSNorm.

``f(x) = W_o N(relu(W_1 N(x) + b_1)) + b_o`` (N = RMSNorm with a learnable scale,
:mod:`moejax.substrates.mlp`) is pre-trained on MNIST-5k and fine-tuned on the sklearn 8x8
digits upsampled to 28x28 (same 10 classes, a domain shift like the paper's CIFAR-10 -> SVHN)
three ways: no regularisation (Adam), AdamR-L2 and AdamR-L1 (decay anchored at the
pre-trained weights). The delta of the two weight matrices is then pruned with DARE, DAREx-q
(q_v: validation accuracy; q_e: last-layer output change on one batch), magnitude and WANDA
at p in {0.5, 0.7, 0.9, 0.95, 0.99}; the table reports test accuracy on the sklearn digits.

Large deltas (Table 6 analog): the same fine-tuning at learning rates ``large_lrs`` (x10 and
more), which makes the mean |delta| large; DARE, DAREx-q (q_v), magnitude and WANDA at
``large_ps``, mean and std over ``large_seeds`` fine-tuning seeds. The paper's claim: when the
deltas are large, importance-based pruning (magnitude, WANDA) beats DARE.

LoRA + DAREx-q (Table 4 analog): the pre-trained MLP is fine-tuned with LoRA (rank
``lora_rank`` on both matrices, ``lora_seeds`` seeds); the LoRA parameters themselves are
pruned at ``lora_ps`` (the paper: p = 0.9) with DARE (q = 1 - p) and DAREx-q (q_v), and, as
the option the paper does not use, the merged delta ``A B`` is pruned the same way.

    python -m experiments.darex.controlled                  # quick (CPU, < 1 min)
    python -m experiments.darex.controlled preset=full      # wider MLP, longer training
"""

from __future__ import annotations

from typing import Literal

import jax

from experiments.darex.common import PAPER_SCALE
from experiments.darex.controlled_claims import claims
from moejax import delta as dl
from moejax.config import Config, config
from moejax.delta import MethodName, PruneContext, delta_stats, matmul_input_stats, run_methods
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.harness.tables import seed_summary
from moejax.substrates import build as build_substrate
from moejax.substrates import substrate_config
from moejax.substrates.mlp import (
    MLPSubstrateConfig,
    accuracy_fn,
    finetune_mlp,
    finetune_mlp_lora,
    load_tasks,
    mlp,
)
from moejax.train import TrainConfig, adam_linear_config, require_read

MATRICES = r"^(w1|wo)$"  # the MLP's weight matrices (prune=matrices)


def pruned_mask(D, prune: str):
    """The pruned leaves: every delta (``"all"``, the official ``drop()``; the MLP has no
    new task head, its output layer is pre-trained) or the two weight matrices
    (``"matrices"``: biases and norm scales keep their delta)."""
    if prune == "all":
        return dl.select_leaves(D, min_ndim=0)
    return dl.select_leaves(D, include=MATRICES)


@config
class ControlledConfig(Config):
    """MLP width, training lengths, AdamR strengths and the pruning grid."""

    NONEMPTY = ("ps", "methods")

    # the pre-trained MLP (theta_P): the cached mlp_mnist5k substrate
    substrate: MLPSubstrateConfig = substrate_config("mlp_mnist5k", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    # the DAREx recipe (Adam, linear warmup then linear decay, clip 1); fine-tuning runs it
    # with Adam, AdamR-L2 (lambda = l2_weight) and AdamR-L1 (lambda = l1_weight)
    finetune: TrainConfig = adam_linear_config(300, 1e-3, batch_size=128, warmup=20)
    l2_weight: float = 0.1  # AdamR-L2 lambda
    l1_weight: float = 0.001  # AdamR-L1 lambda
    ps: tuple[float, ...] = (0.5, 0.7, 0.9, 0.95, 0.99)
    methods: tuple[MethodName, ...] = ("DARE", "DAREx-q (q_v)", "DAREx-q (q_e)", "magnitude",
                                       "WANDA", "structural DPP + q_v")
    # Fig. 7 analog: DARE after AdamR-L2 fine-tuning of increasing strength (empty = skip)
    l2_sweep: tuple[float, ...] = (0.01, 0.1, 1.0)
    sweep_ps: tuple[float, ...] = (0.9, 0.99, 0.999)
    q_num: int = 20
    seed: int = 0  # fine-tuning batch order and DARE masks (replaces finetune.seed)
    # Table 6 analog: fine-tuning learning rates giving large deltas (empty = skip)
    large_lrs: tuple[float, ...] = (1e-3, 1e-2, 3e-2)
    large_ps: tuple[float, ...] = (0.5, 0.9)
    large_methods: tuple[MethodName, ...] = ("DARE", "DAREx-q (q_v)", "magnitude", "WANDA")
    large_seeds: int = 3
    lora_rank: int = 8  # 0 = no LoRA table
    lora_ps: tuple[float, ...] = (0.9,)
    lora_seeds: int = 3
    lora_finetune: TrainConfig = adam_linear_config(300, 3e-3, batch_size=128, warmup=20)
    # what is pruned: "all" (every delta, as the official drop()) or "matrices" (w1 and wo)
    prune: Literal["all", "matrices"] = "all"
    q_spacing: Literal["geometric", "linear"] = "geometric"  # the searched q grid (q_grid)

    def validate(self):
        require_read(self, "finetune", "each fine-tune")
        require_read(self, "lora_finetune", "each LoRA fine-tune")
        self._require(all(0 < p < 1 for p in self.ps), f"ps={self.ps} must lie in (0, 1)")
        self._require(self.q_num >= 1, f"q_num={self.q_num} must be >= 1 grid steps")
        self._require(all(0 < p < 1 for p in self.sweep_ps) and all(w >= 0 for w in
                                                                     self.l2_sweep),
                      "sweep_ps must lie in (0, 1) and l2_sweep weights be >= 0")
        for name in ("l2_weight", "l1_weight"):
            self._require(getattr(self, name) > 0, f"{name}={getattr(self, name)}: AdamR's "
                          "lambda must be > 0 (lambda 0 is the Adam run it is compared with)")
        self._require(not self.l2_sweep or max(self.l2_sweep) > 0,
                      f"l2_sweep={self.l2_sweep}: the strongest weight must be > 0 (weight 0 "
                      "is Adam, not AdamR-L2), or l2_sweep=()")
        self._require(not self.l2_sweep or self.sweep_ps,
                      "sweep_ps is empty while l2_sweep is not; give drop rates or l2_sweep=()")
        self._require(all(0 < p < 1 for p in self.lora_ps),
                      f"lora_ps={self.lora_ps} must lie in (0, 1)")
        self._require(self.lora_rank == 0 or self.lora_ps,
                      "lora_ps is empty while lora_rank > 0; give drop rates or lora_rank=0")
        self._require(all(lr > 0 for lr in self.large_lrs) and self.large_seeds >= 1
                      and all(0 < p < 1 for p in self.large_ps),
                      "large_lrs must be > 0, large_ps in (0, 1) and large_seeds >= 1")
        self._require(not self.large_lrs or (self.large_ps and self.large_methods),
                      "large_ps and large_methods must be non-empty while large_lrs is not; "
                      "or large_lrs=()")
        self._require(self.lora_rank >= 0 and self.lora_seeds >= 1,
                      "lora_rank must be >= 0 and lora_seeds >= 1")


def make_config(preset: str) -> ControlledConfig:
    if preset == "quick":
        return ControlledConfig()
    return ControlledConfig(substrate=substrate_config("mlp_mnist5k", "full"),
                            finetune=adam_linear_config(2000, 1e-3, batch_size=128, warmup=20))


def pretrain_and_finetune(cfg: ControlledConfig, tasks: dict, regs=("none", "l2", "l1")):
    """``(theta_P, {reg: theta_F}, substrate)`` for the requested fine-tuning regularisers."""
    sub = build_substrate("mlp_mnist5k", cfg.substrate, cache_dir=cfg.substrate_cache or None,
                          progress=True)
    pre = sub.model.params()
    tuned = {reg: finetune_mlp(pre, tasks, finetune_config(cfg, reg),
                               desc=f"finetune digits ({reg})") for reg in regs}
    return pre, tuned, sub


def finetune_config(cfg: ControlledConfig, reg: str, weight: float | None = None,
                    **changes) -> TrainConfig:
    """``finetune`` with the fine-tuning regulariser ``reg`` (``"none"``: Adam, no decay;
    ``"l2"`` / ``"l1"``: AdamR-L2 / -L1, lambda ``weight`` or ``l2_weight`` / ``l1_weight``)
    and ``changes`` (lr, seed): the one place the recipe sets the optimizer of a run."""
    optimizer, default = {"none": ("adam", 0.0), "l2": ("adamr_l2", cfg.l2_weight),
                          "l1": ("adamr_l1", cfg.l1_weight)}[reg]
    return cfg.finetune.replace(optimizer=optimizer,
                                weight_decay=default if weight is None else weight,
                                **{"seed": cfg.seed, **changes})


REG_NAMES = {"none": "no reg (Adam)", "l2": "AdamR-L2", "l1": "AdamR-L1"}
LORA_METHODS = ("LoRA unpruned", "DARE on LoRA factors", "DAREx-q (q_v) on LoRA factors",
                "DARE on merged delta", "DAREx-q (q_v) on merged delta")


def _context(cfg, pre, fin, D, mask, seed, acc_val, acc_test, calib_x) -> PruneContext:
    """What every pruning method of :func:`moejax.delta.run_methods` needs for one delta."""
    outputs = lambda prm: mlp(prm, calib_x)  # noqa: E731
    return PruneContext(pretrained=pre, delta=D, mask=mask, key=jax.random.key(seed),
                        val_metric=acc_val, test_metric=acc_test, outputs_fn=outputs,
                        x_stats=matmul_input_stats(outputs, fin), q_num=cfg.q_num,
                        q_spacing=cfg.q_spacing)


def lora_rows(cfg: ControlledConfig, pre, tasks, acc_val, acc_test) -> list[dict]:
    """Test accuracy of every (seed, p, LoRA pruning method)."""
    rows = []
    for seed in range(cfg.lora_seeds):
        s = cfg.seed * cfg.lora_seeds + seed  # disjoint seeds across `repeat` runs
        lora = finetune_mlp_lora(pre, tasks, cfg.lora_finetune.replace(seed=s),
                                 cfg.lora_rank, desc=f"LoRA r={cfg.lora_rank} seed {seed}")
        merged = dl.lora_delta(pre, lora)
        mask = pruned_mask(merged, cfg.prune)
        key = jax.random.key(s + 31)
        for p in cfg.lora_ps:
            grid = dl.q_grid(p, cfg.q_num, spacing=cfg.q_spacing)
            factors = dl.lora_factor_pruner(pre, p)
            qf = dl.search_q_v(key, pre, lora, p, acc_val, grid=grid, pruner=factors).best
            qm = dl.search_q_v(key, pre, merged, p, acc_val, grid=grid, mask=mask).best
            got = {"LoRA unpruned": acc_test(dl.apply_delta(pre, merged)),
                   "DARE on LoRA factors": acc_test(dl.apply_delta(
                       pre, factors(key, lora, 1 - p))),
                   "DAREx-q (q_v) on LoRA factors": acc_test(dl.apply_delta(
                       pre, factors(key, lora, qf))),
                   "DARE on merged delta": acc_test(dl.apply_delta(
                       pre, dl.dare(key, merged, p, mask=mask))),
                   "DAREx-q (q_v) on merged delta": acc_test(dl.apply_delta(
                       pre, dl.dare(key, merged, p, q=qm, mask=mask)))}
            qs = {"DAREx-q (q_v) on LoRA factors": qf, "DAREx-q (q_v) on merged delta": qm}
            rows += [{"seed": seed, "p": p, "method": m, "accuracy": float(a),
                      "q": qs.get(m, 1 - p if m.startswith("DARE ") else "")}
                     for m, a in got.items()]
    return rows


def run(cfg: ControlledConfig, run: RunDir) -> dict:
    tasks = load_tasks(cfg.substrate.split_seed)
    pre, tuned, sub = pretrain_and_finetune(cfg, tasks)
    test_b, val_b = tasks["B", "test"], tasks["B", "validation"]
    calib_x = tasks["B", "train"][0][:256]
    acc_test, acc_val = accuracy_fn(test_b), accuracy_fn(val_b)
    acc_test_a = accuracy_fn(tasks["A", "test"])
    rows, base_rows = [], []
    for reg, fin in tuned.items():
        D = dl.delta(pre, fin)
        mask = pruned_mask(D, cfg.prune)
        ctx = _context(cfg, pre, fin, D, mask, cfg.seed + 7, acc_val, acc_test, calib_x)
        base_rows.append({"fine-tuning": REG_NAMES[reg], "test acc digits": acc_test(fin),
                          "pre-trained acc digits": acc_test(pre),
                          "pre-trained acc MNIST": acc_test_a(pre),
                          **delta_stats(D, mask)})
        rows += [{"fine-tuning": REG_NAMES[reg], **r}
                 for r in run_methods(ctx, cfg.methods, cfg.ps, desc=f"prune ({reg})")]
    d = cfg.substrate.d_hidden
    run.note(f"Started from substrate mlp_mnist5k ({sub.path.name}, MNIST test accuracy "
             f"{sub.metrics['test_accuracy']:.3f}). "
             f"Fine-tuned {cfg.finetune.steps} steps at lr {cfg.finetune.lr:g}. Pruned: "
             + (f"every delta (w1 [784, {d}], wo [{d}, 10], biases and RMSNorm scales, as the "
                "official drop())" if cfg.prune == "all" else
                f"the matrices w1 [784, {d}] and wo [{d}, 10] (prune=matrices; biases and "
                "RMSNorm scales keep their full delta)")
             + f"; q searched over a {cfg.q_spacing} grid of {cfg.q_num} steps. "
             "q_v is chosen on the digits validation "
             f"split ({val_b[1].shape[0]} images); test = {test_b[1].shape[0]} images. "
             "DAREx-q uses the same drop mask as DARE (same key), only the rescaling differs.")
    run.table("finetuned", base_rows, title="Fine-tuned MLPs (unpruned), sklearn digits")
    _accuracy_tables(cfg, run, list(tuned), rows, base_rows)
    out = _headline(cfg, list(tuned), rows, base_rows)
    if cfg.l2_sweep:
        out.update(_l2_sweep(cfg, run, pre, tasks, acc_test))
    if cfg.large_lrs:
        out.update(_large_deltas(cfg, run, pre, tasks, acc_val, acc_test, calib_x))
    if cfg.lora_rank:
        out.update(_lora_table(cfg, run, pre, tasks, acc_val, acc_test))
    return out


def _accuracy_tables(cfg: ControlledConfig, run: RunDir, regs, rows, base_rows) -> None:
    """Accuracy by drop rate (one row per fine-tuning and method), every pruning with its q,
    and per fine-tuning a plot against the unpruned accuracy."""
    run.table("accuracy", [
        {"fine-tuning": REG_NAMES[reg], "method": m,
         **{f"p={r['p']}": r["metric"] for r in rows
            if r["fine-tuning"] == REG_NAMES[reg] and r["method"] == m}}
        for reg in regs for m in cfg.methods],
              title="Test accuracy (sklearn digits) after delta pruning")
    run.table("detail", rows, title="Every (fine-tuning, method, p) with the chosen q")
    for reg in regs:
        series = {m: (list(cfg.ps), [r["metric"] for r in rows
                                     if r["method"] == m and r["fine-tuning"] == REG_NAMES[reg]])
                  for m in cfg.methods}
        unpruned = next(b["test acc digits"] for b in base_rows
                        if b["fine-tuning"] == REG_NAMES[reg])
        run.line_plot(f"acc_vs_p_{reg}", series, xlabel="drop rate p", ylabel="test accuracy",
                      title=f"MLP, fine-tuned with {REG_NAMES[reg]}", markers=True,
                      hlines={"unpruned": unpruned})


def _headline(cfg: ControlledConfig, regs, rows, base_rows) -> dict:
    """DARE per fine-tuning and DAREx-q (q_v) at the highest drop rate, beside unpruned."""
    def pick(reg, m, p):
        return next(r["metric"] for r in rows if r["fine-tuning"] == REG_NAMES[reg]
                    and r["method"] == m and r["p"] == p)

    p_hi = max(cfg.ps)
    out = {"unpruned_none": base_rows[0]["test acc digits"]}
    if "DARE" in cfg.methods:
        out.update({f"dare_{reg}_p{p_hi}": pick(reg, "DARE", p_hi) for reg in regs})
    if "DAREx-q (q_v)" in cfg.methods:
        out[f"darex_qv_none_p{p_hi}"] = pick("none", "DAREx-q (q_v)", p_hi)
    out["headline"] = (
        f"MLP MNIST -> sklearn digits, unpruned {out['unpruned_none']:.3f}; at p={p_hi}: "
        + ", ".join(f"{k}={v:.3f}" for k, v in out.items() if k.startswith("dar")))
    return out


def _large_deltas(cfg, run, pre, tasks, acc_val, acc_test, calib_x) -> dict:
    """Table 6 analog: pruning methods on deltas made large by a higher fine-tuning lr."""
    detail = []
    for lr in cfg.large_lrs:
        for seed in range(cfg.large_seeds):
            s = cfg.seed * cfg.large_seeds + seed  # disjoint seeds across `repeat` runs
            fin = finetune_mlp(pre, tasks, finetune_config(cfg, "none", lr=lr, seed=s),
                               desc=f"finetune lr {lr} seed {seed}")
            D = dl.delta(pre, fin)
            mask = pruned_mask(D, cfg.prune)
            ctx = _context(cfg, pre, fin, D, mask, s + 7, acc_val, acc_test, calib_x)
            base = {"lr": lr, "seed": seed, **delta_stats(D, mask)}
            detail.append({**base, "p": 0.0, "method": "unpruned", "metric": acc_test(fin)})
            for r in run_methods(ctx, cfg.large_methods, cfg.large_ps, desc=f"prune lr {lr}"):
                detail.append({**base, **r})
    means = seed_summary(detail, ["lr", "method", "p"], ["metric", "mean_abs_delta"])
    rows = []
    for lr in cfg.large_lrs:  # wide: one row per lr, one column (+ std) per method and p
        row = {"lr": lr}
        for r in (r for r in means if r["lr"] == lr):
            key = r["method"] if r["method"] == "unpruned" else f"{r['method']} p={r['p']}"
            if r["method"] == "unpruned":
                row["mean_abs_delta"] = r["mean_abs_delta"]
            row[key], row[f"{key} std"] = r["metric"], r["metric std"]
        rows.append(row)
    run.table("large_deltas", rows, title=f"Large deltas (Table 6 analog): test accuracy, mean "
              f"over {cfg.large_seeds} fine-tuning seeds, by fine-tuning lr")
    run.table("large_deltas_detail", detail, title="Large deltas: every seed, method and p")
    p_hi = max(cfg.large_ps)
    big = max(rows, key=lambda r: r["mean_abs_delta"])
    small = min(rows, key=lambda r: r["mean_abs_delta"])
    at = lambda r: ", ".join(f"{m} {r[f'{m} p={p_hi}']:.3f}"  # noqa: E731
                             for m in cfg.large_methods)
    importance = [m for m in ("magnitude", "WANDA") if m in cfg.large_methods]
    imp = max((big[f"{m} p={p_hi}"] for m in importance), default=float("nan"))
    run.note(f"Large deltas: at p = {p_hi}, with the largest deltas (lr {big['lr']}, mean "
             f"|delta| {big['mean_abs_delta']:.2e}, unpruned {big['unpruned']:.3f}): {at(big)}; "
             f"with the smallest (lr {small['lr']}, {small['mean_abs_delta']:.2e}): "
             f"{at(small)} (the claim, judged from the seeds: the claims table).")
    out = {f"large_delta_best_importance_p{p_hi}": imp}
    if "DARE" in cfg.large_methods:
        out[f"large_delta_dare_p{p_hi}"] = big[f"DARE p={p_hi}"]
    return out


def _l2_sweep(cfg, run, pre, tasks, acc_test) -> dict:
    """Fig. 7 analog: test accuracy of DARE at ``sweep_ps`` after AdamR-L2 of each weight."""
    rows = []
    for w in cfg.l2_sweep:
        fin = finetune_mlp(pre, tasks, finetune_config(cfg, "l2", w), desc=f"AdamR-L2 {w}")
        D = dl.delta(pre, fin)
        mask = pruned_mask(D, cfg.prune)
        row = {"l2_weight": w, "unpruned": acc_test(fin), **delta_stats(D, mask)}
        for p in cfg.sweep_ps:
            row[f"DARE p={p}"] = acc_test(dl.apply_delta(
                pre, dl.dare(jax.random.key(cfg.seed + 7), D, p, mask=mask)))
        rows.append(row)
    run.table("l2_sweep", rows, title="AdamR-L2 strength vs DARE (Fig. 7 analog): test "
              "accuracy on the digits")
    run.line_plot("l2_sweep", {f"L2 {r['l2_weight']}": (list(cfg.sweep_ps),
                                                        [r[f"DARE p={p}"] for p in cfg.sweep_ps])
                               for r in rows},
                  xlabel="drop rate p", ylabel="test accuracy", markers=True,
                  title="DARE after AdamR-L2 of increasing strength (dashed: unpruned)",
                  hlines={f"unpruned, L2 {r['l2_weight']}": r["unpruned"] for r in rows})
    p_hi = max(cfg.sweep_ps)
    best = max(rows, key=lambda r: r[f"DARE p={p_hi}"])
    run.note(f"AdamR-L2 sweep: at p = {p_hi} DARE reaches "
             + ", ".join(f"{r[f'DARE p={p_hi}']:.3f} (L2 {r['l2_weight']}, unpruned "
                         f"{r['unpruned']:.3f})" for r in rows) + ".")
    return {f"l2_sweep_best_p{p_hi}": best[f"DARE p={p_hi}"]}


def _lora_table(cfg, run, pre, tasks, acc_val, acc_test) -> dict:
    rows = lora_rows(cfg, pre, tasks, acc_val, acc_test)
    summary = seed_summary(rows, ["p", "method"], ["accuracy"])
    run.table("lora", summary, title=f"LoRA (rank {cfg.lora_rank}) + DAREx-q, test accuracy "
              f"(sklearn digits), mean and std over {cfg.lora_seeds} seeds (Table 4 analog)")
    run.table("lora_detail", rows, title="LoRA pruning, every seed, with the chosen q")
    p = max(cfg.lora_ps)
    sel = [s for s in summary if s["p"] == p]
    run.bar_plot("lora", [s["method"] for s in sel[1:]], [s["accuracy"] for s in sel[1:]],
                 errors=[s["accuracy std"] for s in sel[1:]], ylabel="test accuracy",
                 title=f"LoRA deltas pruned at p = {p}",
                 hlines={"LoRA unpruned": sel[0]["accuracy"]})
    by = {s["method"]: s["accuracy"] for s in sel}
    run.note(f"LoRA at p = {p}: DARE on the factors {by['DARE on LoRA factors']:.3f}, DAREx-q "
             f"(q_v) {by['DAREx-q (q_v) on LoRA factors']:.3f} (unpruned "
             f"{by['LoRA unpruned']:.3f}).")
    return {"lora_unpruned": by["LoRA unpruned"],
            f"lora_dare_factors_p{p}": by["DARE on LoRA factors"],
            f"lora_darex_qv_factors_p{p}": by["DAREx-q (q_v) on LoRA factors"]}


STUDY = Study(
    "darex_controlled", make_config, run, claims=claims,
    seed_keys=("seed",),
    quick_repeat=5,
    smoke=("large_seeds=1", "lora_seeds=1"),
    paper_scale=PAPER_SCALE,
    derived_keys=(("finetune.optimizer", "Adam, AdamR-L2 or AdamR-L1 per fine-tuning run; "
                   "Adam for the large deltas"),
                  ("finetune.weight_decay", "0 for Adam, l2_weight, l1_weight and l2_sweep "
                   "for AdamR"),
                  ("finetune.seed", "seed (the large-delta runs: seed * large_seeds + i)"),
                  ("lora_finetune.seed", "seed * lora_seeds + i")),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
