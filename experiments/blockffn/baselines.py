"""BlockFFN vs TopK MoE / DeepSeekMoE / GRIN / ReMoE / dense at matched total and active parameters
(BlockFFN paper Table 2 and Fig. 1a analogs), on the CPython stdlib source bytes.

Per size and training seed: BlockFFN (AL + CS, adaptive lambda_cs) is trained first; its
validation TLS fixes the active parameters of the baselines trained on the same seed (see
:func:`baselines`): TopK and DSMoE use ``k = round(N (1 - TLS))`` of the same ``N`` experts
(DSMoE: one of them shared), GRIN (SparseMixer-v2 routing) the same k (``grin_k=two``: its
own top-2), ReMoE's controller targets the same TLS, and the dense model has one FFN of width
``N d_expert``; every model has the same attention, expert count and width, data and steps.
Sizes: ``small`` / ``large`` (82K / 183K parameters, the quick default) and ``xl`` (5.3M, a
few CPU minutes per model; ``sizes=(xl,)``). Writes PPL / TLS / CLS_8 / reuse (mean and std
over ``seeds``), every model's achieved TLS minus BlockFFN's, paired BlockFFN - baseline PPL
differences, CLS_L against L (Fig. 1a), PPL bars with the dense reference, per-layer
activation magnitudes (Fig. 4) and BlockFFN's per-token expert allocation (Fig. 3). The quick
preset uses AL sharpness alpha = 10 instead of the paper's 100 (see
experiments/blockffn/ablations.py, table ``alpha``).

    python -m experiments.blockffn.baselines                          # quick (CPU)
    python -m experiments.blockffn.baselines "sizes=(xl,)"            # 5.3M params (CPU)
    python -m experiments.blockffn.baselines preset=full              # GPU
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from experiments.blockffn.common import (
    PAPER_CLS_8,
    PAPER_REUSE,
    PAPER_SCALE,
    PAPER_TLS,
    SparseLMStudyConfig,
    blockffn_changes,
    denser_explains_cls,
    sparser_explains_ppl,
    tls_checked,
)
from moejax.config import config
from moejax.harness.claims import Claim, all_hold, measured, paired, paired_claim, threshold_claim
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.harness.tables import seed_summary
from moejax.ops.sparsity_metrics import CHUNK_LENS
from moejax.sparse_lm import SparseLMConfig, summary_row, train_and_evaluate

Size = Literal["small", "large", "xl"]


@config
class BaselinesConfig(SparseLMStudyConfig):
    NONEMPTY = ("sizes",)

    sizes: tuple[Size, ...] = ("small", "large")
    small_d_model: int = 48
    small_d_expert: int = 16
    large_d_model: int = 64
    large_d_expert: int = 32
    # xl: >= 5M parameters that still trains in CPU minutes (5.3M at the defaults)
    xl_d_model: int = 256
    xl_d_expert: int = 128
    xl_n_layers: int = 4
    seeds: int = 5  # training seeds (model init and data order) of every model
    # GRIN's experts per token: "matched" = TopK's k (the paper compares at close TLS; more
    # than two stages is our extension of SparseMixer-v2), "two" = GRIN's own top-2
    grin_k: Literal["matched", "two"] = "matched"
    # the baselines trained beside BlockFFN (which is always trained: its TLS sets theirs)
    models: tuple[Literal["TopK", "DSMoE", "GRIN", "ReMoE", "Dense"], ...] = (
        "TopK", "DSMoE", "GRIN", "ReMoE", "Dense")

    MODEL_ARCHS = ("blockffn", "topk", "dsmoe", "grin", "remoe", "dense")
    MODEL_SET_HERE = {
        "arch": "it sets each model's architecture",
        "top_k": "it sets k = round(N (1 - TLS)) from BlockFFN's TLS",
        "n_shared": "DSMoE has one shared expert", "target_tls": "ReMoE targets BlockFFN's TLS",
        "d_model": "it takes small_d_model, large_d_model and xl_d_model",
        "d_expert": "it takes small_d_expert, large_d_expert and xl_d_expert"}

    def unread_fields(self) -> dict[str, str]:
        unread = {f"{size}_{f}": f"read only with {size!r} in sizes (this config has "
                                 f"sizes={self.sizes})"
                  for size, fields in (("small", ("d_model", "d_expert")),
                                       ("large", ("d_model", "d_expert")),
                                       ("xl", ("d_model", "d_expert", "n_layers")))
                  if size not in self.sizes for f in fields}
        if "GRIN" not in self.models:
            unread["grin_k"] = f"read only with GRIN in models (this config has {self.models})"
        return unread

    def validate(self):
        super().validate()
        self._require(self.model.n_experts >= 2, f"model.n_experts={self.model.n_experts}: "
                      "the baselines need 2 or more (DSMoE: one shared, the others routed)")
        for size in self.sizes:  # every size must build a valid model, every baseline too
            spec = self.size_spec(size)
            # the active experts follow BlockFFN's TLS: all of them, and one (the fewest)
            for tls in (0.0, 1.0 - 1.0 / spec.n_experts):
                self._checked(baselines, spec, tls, self.grin_k)

    def size_spec(self, size: str) -> SparseLMConfig:
        d, de, n_layers = {
            "small": (self.small_d_model, self.small_d_expert, self.model.n_layers),
            "large": (self.large_d_model, self.large_d_expert, self.model.n_layers),
            "xl": (self.xl_d_model, self.xl_d_expert, self.xl_n_layers)}[size]
        return self.model.replace(d_model=d, d_expert=de, n_layers=n_layers)


def make_config(preset: str) -> BaselinesConfig:
    if preset == "quick":
        return BaselinesConfig.from_preset(preset)
    return BaselinesConfig.from_preset(preset, small_d_model=256, small_d_expert=64,
                                       large_d_model=512, large_d_expert=128, seeds=1)


def baselines(base: SparseLMConfig, tls: float, grin_k: str = "matched"
              ) -> dict[str, tuple[SparseLMConfig, float]]:
    """The models compared with a BlockFFN of validation TLS ``tls``: ``name -> (spec, the
    number of active experts it is built for)``. TopK and DSMoE take
    ``k = round(N (1 - TLS))`` (at least 2; DSMoE: one shared + k - 1 routed), GRIN the same
    ``k`` (``grin_k="matched"``) or its own 2 (``"two"``), ReMoE's controller targets ``tls``,
    and the dense model has one FFN of width ``N d_expert``."""
    N = base.n_experts
    k = int(min(N, max(2, round(N * (1.0 - tls)))))
    kg = k if grin_k == "matched" else 2
    return {"TopK": (base.replace(arch="topk", top_k=k), k),
            "DSMoE": (base.replace(arch="dsmoe", top_k=k, n_shared=1), k),
            "GRIN": (base.replace(arch="grin", top_k=kg), kg),
            "ReMoE": (base.replace(arch="remoe", target_tls=float(tls)), N * (1.0 - tls)),
            "Dense": (base.replace(arch="dense"), N)}


def _train_all(cfg: BaselinesConfig):
    """Every model of every size and seed trained and evaluated: the per-seed rows, the CLS_L
    rows, seed 0's activation magnitudes, and BlockFFN's allocation on the largest size."""
    N = cfg.model.n_experts
    rows, cls_rows, mag_rows, alloc = [], [], [], None
    for seed in range(cfg.seeds):
        tcfg = cfg.train.replace(seed=cfg.train.seed + seed)
        train_src, val = cfg.sources(tcfg.seed)
        for size in cfg.sizes:
            base = cfg.size_spec(size)
            bf = train_and_evaluate(base.replace(arch="blockffn"), tcfg, train_src, val)
            runs = {"BlockFFN": (bf, N * (1.0 - bf["tls"]))}
            for name, (spec, active) in baselines(base, bf["tls"], cfg.grin_k).items():
                if name in cfg.models:
                    runs[name] = (train_and_evaluate(spec, tcfg, train_src, val), active)
            for name, (ev, active) in runs.items():
                tls = ev.get("tls", 0.0)
                rows.append(summary_row(name, ev, {
                    "seed": seed, "size": size, "d_model": base.d_model,
                    "d_expert": base.d_expert, "n_layers": base.n_layers,
                    "active_experts": active,
                    "TLS - TLS_BlockFFN": tls - bf["tls"] if name != "Dense" else float("nan")}))
                if name != "Dense":
                    cls_rows += [{"size": size, "model": name, "L": L, "CLS": ev[f"cls_{L}"]}
                                 for L in CHUNK_LENS]
                if name in ("BlockFFN", "ReMoE") and seed == 0:
                    mag_rows += [{"size": size, "model": name, "layer": layer,
                                  "act_magnitude": m.get("magnitude", float("nan"))}
                                 for layer, m in ev["layers"].items()]
            if seed == 0 and size == cfg.sizes[-1]:
                alloc = (size, bf["allocation"])
    return rows, cls_rows, mag_rows, alloc


def _plots(run: RunDir, cfg: BaselinesConfig, summary, cls_rows, alloc) -> None:
    """CLS_L against L (Fig. 1a), PPL per model with the dense model drawn in, and BlockFFN's
    expert allocation per token id (Fig. 3)."""
    cls_mean = seed_summary(cls_rows, ["size", "model", "L"], ["CLS"])
    run.line_plot("cls_vs_L", {
        f"{m} ({s})": ([r["L"] for r in cls_mean if (r["model"], r["size"]) == (m, s)],
                       [r["CLS"] for r in cls_mean if (r["model"], r["size"]) == (m, s)])
        for s, m in dict.fromkeys((r["size"], r["model"]) for r in cls_mean)},
        xlabel="chunk length L", ylabel="CLS_L (mean over seeds)",
        title="Chunk-level sparsity vs chunk length (Fig. 1a)", logx=True, markers=True,
        hlines={f"paper's BlockFFN CLS_8 {PAPER_CLS_8:g}": PAPER_CLS_8}, vlines={"L=8": 8})
    for size in cfg.sizes:
        sel = [r for r in summary if r["size"] == size]
        dense = dict(("dense", r["val_ppl"]) for r in sel if r["model"] == "Dense")
        moes = [r for r in sel if r["model"] != "Dense"]
        run.bar_plot(f"ppl_{size}", [r["model"] for r in moes], [r["val_ppl"] for r in moes],
                     errors=[r["val_ppl std"] for r in moes], hlines=dense,
                     ylabel="validation PPL", title=f"PPL at matched TLS ({size}, "
                     f"{sel[0]['params'] / 1e6:.2f}M params, {cfg.seeds} seeds)")
    if alloc is not None:
        size, (ids, counts, frac) = alloc
        hi = float(min(1.0, max(0.05, frac.max() * 1.05)))
        hist, edges = np.histogram(frac, bins=20, range=(0, hi), weights=counts)
        run.bar_plot("allocation_hist", [f"{edges[i]:.2f}" for i in range(20)],
                     (hist / hist.sum()).tolist(), ylabel="fraction of tokens",
                     title=f"BlockFFN ({size}, seed 0) expert allocation per token id (Fig. 3)")


def run(cfg: BaselinesConfig, run: RunDir) -> dict:
    if note := blockffn_changes(cfg.model, cfg.MODEL_SET_HERE):
        run.note(note)
    rows, cls_rows, mag_rows, alloc = _train_all(cfg)
    values = ["val_ppl", "TLS", "TLS - TLS_BlockFFN", "active_experts", "CLS_8", "reuse"]
    summary = seed_summary(rows, ["size", "model", "d_model", "d_expert", "n_layers", "params"],
                           values)
    run.table("baselines", summary, title=(
        f"Validation PPL and sparsity at matched parameters, mean and std over {cfg.seeds} "
        "training seeds (TopK/DSMoE k and ReMoE's target set from BlockFFN's TLS of the same "
        f"seed; GRIN k: {cfg.grin_k})"),
        columns=["size", "model", "params", "d_model", "d_expert", "n_layers", "n_seeds",
                 "val_ppl", "val_ppl std", "TLS", "TLS std", "TLS - TLS_BlockFFN",
                 "active_experts", "CLS_8", "CLS_8 std", "reuse"])
    run.table("baselines_per_seed", rows, title="Every trained model, per seed",
              columns=["seed", "size", "model", "params", "active_experts", "val_ppl", "TLS",
                       "TLS - TLS_BlockFFN", "CLS_8", "reuse"])
    paired = paired_gaps(rows, cfg.sizes)
    run.table("blockffn_minus_baseline", paired, title=(
        "Paired PPL difference BlockFFN - model, same size and seed (negative: BlockFFN "
        "better); mean, std and how many seeds BlockFFN wins"))
    _plots(run, cfg, summary, cls_rows, alloc)
    run.table("act_magnitude", mag_rows, title="Mean ||A||_2 per layer, seed 0 (Fig. 4 analog)")
    lines, best = [], {}
    for size in cfg.sizes:
        moe = [r for r in summary if r["size"] == size and r["model"] != "Dense"]
        best[size] = min(moe, key=lambda r: r["val_ppl"])["model"]
        b = next(r for r in moe if r["model"] == "BlockFFN")
        gaps = {r["model"]: r for r in paired if r["size"] == size and r["model"] != "Dense"}
        wins = sum(r["BlockFFN wins"] for r in gaps.values())
        lines.append(
            f"{size} ({b['params'] / 1e6:.2f}M): BlockFFN PPL {b['val_ppl']:.3f} +- "
            f"{b['val_ppl std']:.3f}, TLS {b['TLS']:.3f}, CLS_8 {b['CLS_8']:.3f}; lowest-PPL "
            f"MoE {best[size]}; BlockFFN beats {wins} of {len(gaps) * cfg.seeds} paired "
            "(MoE baseline, seed) comparisons")
    return {"headline": "; ".join(lines), "best_moe": best}


def paired_gaps(rows: list[dict], sizes) -> list[dict]:
    """Per size and baseline: BlockFFN's PPL minus the baseline's on the same seed, mean and
    std over seeds, and the number of seeds where BlockFFN's PPL is lower."""
    bf = {(r["size"], r["seed"]): r["val_ppl"] for r in rows if r["model"] == "BlockFFN"}
    out = []
    for size in sizes:
        for name in dict.fromkeys(r["model"] for r in rows if r["model"] != "BlockFFN"):
            d = np.asarray([bf[(size, r["seed"])] - r["val_ppl"] for r in rows
                            if r["size"] == size and r["model"] == name])
            out.append({"size": size, "model": name, "dPPL": float(d.mean()),
                        "dPPL std": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
                        "BlockFFN wins": int((d < 0).sum()), "n_seeds": len(d)})
    return out


def close_tls(rows: list[dict]) -> float | None:
    """How far a baseline's validation TLS may lie from BlockFFN's and still be "close TLS"
    (Table 2): half an expert of the ``N``, the most rounding ``k = round(N (1 - TLS))`` moves
    it (``N = active_experts / (1 - TLS)`` of a BlockFFN row); None where the rows cannot
    say."""
    for r in rows:
        if r["model"] == "BlockFFN":
            active, tls = measured(r.get("active_experts")), measured(r.get("TLS"))
            if active and tls is not None and tls < 1.0:
                return 0.5 * (1.0 - tls) / active + 1e-6
    return None


# per metric: (column, sign making higher better, what, whether a baseline's TLS minus
# BlockFFN's explains the verdict): a denser model has the lower PPL, a sparser the higher CLS
METRICS = (("val_ppl", -1.0, "the lowest PPL", sparser_explains_ppl),
           ("CLS_8", 1.0, "the highest chunk-level sparsity CLS_8", denser_explains_cls))


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """BlockFFN's claims against the other MoEs at matched parameters and close TLS (Table 2),
    each judged on the paired per-seed differences against every other MoE
    (:func:`moejax.harness.claims.paired_claim`): holds when BlockFFN beats each one, does not
    hold when one beats it. A comparison counts only at close TLS (:func:`close_tls`), unless
    the TLS gap runs against the verdict (a sparser baseline that still has the lower PPL)."""
    rows = t.get("baselines_per_seed") or []
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        at = [r for r in rows if r["size"] == size and r["model"] != "Dense"]
        tol = close_tls(at)
        by = {}
        for r in at:
            by.setdefault(r["model"], {})[int(float(r["seed"]))] = r
        if "BlockFFN" not in by or len(by) < 2:
            continue
        for column, sign, what, confounds in METRICS:
            pairs = []
            for other in by:
                if other == "BlockFFN":
                    continue
                seeds = sorted(set(by["BlockFFN"]) & set(by[other]))
                label = (f"BlockFFN - {other} {column}" if sign > 0
                         else f"{other} - BlockFFN {column}")
                gaps = [measured(by[other][s].get("TLS - TLS_BlockFFN")) for s in seeds]
                gap = (None if not gaps or None in gaps else float(np.mean(gaps)))
                row = paired(label, [sign * float(by["BlockFFN"][s][column]) for s in seeds],
                             [sign * float(by[other][s][column]) for s in seeds])
                pairs.append(tls_checked(paired_claim(label, row), gap, tol, confounds))
            claim = (f"BlockFFN has {what} of the MoEs ({size}; Table 2"
                     f"{', Fig. 1a' if column == 'CLS_8' else ''})")
            out.append(all_hold(claim, pairs, "; ".join(c.evidence for c in pairs)))
        out.append(_sparsity_levels(size, list(by["BlockFFN"].values())))
        out.append(_reuse_level(size, list(by["BlockFFN"].values())))
    return out


def _sparsity_levels(size: str, rows: list[dict]) -> Claim:
    """BlockFFN's own sparsity against the paper's levels (the abstract's): its TLS over
    :data:`PAPER_TLS` and its CLS_8 over :data:`PAPER_CLS_8` in the seed runs (``rows``:
    BlockFFN's per-seed rows), both with 95% confidence
    (:func:`moejax.harness.claims.threshold_claim`)."""
    parts = [threshold_claim("", [float(r[k]) for r in rows if measured(r.get(k)) is not None],
                             level, fmt=".3f")
             for k, level in (("TLS", PAPER_TLS), ("CLS_8", PAPER_CLS_8))]
    return all_hold(f"BlockFFN reaches over 80% TLS and over 70% CLS_8 ({size}; abstract, "
                    "Table 2)", parts, f"TLS {parts[0].evidence}; CLS_8 {parts[1].evidence}")


def _reuse_level(size: str, rows: list[dict]) -> Claim:
    """BlockFFN's expert selection stability against the paper's level (Sec. 4.1.2, Table 4):
    its reuse ratio (the share of a token's active experts that the next token activates
    too) over :data:`PAPER_REUSE` in the seed runs (``rows``: BlockFFN's per-seed rows), with
    95% confidence; not measured where a seed run did not record it."""
    claim = (f"BlockFFN reuses over 85% of a token's experts at the next token ({size}; Sec. "
             "4.1.2, Table 4)")
    values = [measured(r.get("reuse")) for r in rows]
    if None in values:
        return Claim(claim, None, "the reuse ratio was not recorded in every seed run")
    c = threshold_claim(claim, values, PAPER_REUSE, fmt=".3f")
    return c._replace(evidence=f"reuse ratio {c.evidence}")


STUDY = Study(
    "blockffn_baselines", make_config, run, claims=claims,
    paper_scale=PAPER_SCALE,
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
