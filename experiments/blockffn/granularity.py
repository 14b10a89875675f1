"""BlockFFN expert granularity sweep at a fixed FFN budget (Fig. 5/6 analog): ``N`` experts of
width ``budget / N``; validation PPL, TLS and CLS_8 against ``N``.

    python -m experiments.blockffn.granularity               # quick (CPU)
"""

from __future__ import annotations

from experiments.blockffn.common import (
    PAPER_CLS_8,
    PAPER_SCALE,
    PAPER_TLS,
    SparseLMStudyConfig,
    at_close_tls,
    blockffn_changes,
)
from moejax.config import config
from moejax.harness.claims import Claim, all_hold, lookup, measured, paired_compare, per_seed
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.sparse_lm import summary_row, train_and_evaluate

# App. F: "40 experts is the best setting for BlockFFN Medium"
PAPER_BEST_N = 40

# App. F: "a nonmonotonic relationship between sparsity and expert granularities"; "the
# setting with 40 experts ... achieves both the highest TLS and CLS_8"
PEAK_CLAIM = ("Sparsity peaks at an intermediate granularity: a middle N has higher TLS and "
              "CLS_8 than both the coarsest and the finest (App. F, Fig. 6; the paper's: "
              f"N={PAPER_BEST_N})")


@config
class GranularityConfig(SparseLMStudyConfig):
    NONEMPTY = ("n_experts",)

    ffn_width: int = 256  # N * d_expert, fixed
    n_experts: tuple[int, ...] = (4, 8, 16, 32)

    MODEL_SET_HERE = {"arch": "every model it trains is BlockFFN",
                      "n_experts": "it takes N from its own n_experts",
                      "d_expert": "it takes d_expert = ffn_width / N"}

    def validate(self):
        super().validate()
        for n in self.n_experts:
            self._require(self.ffn_width % int(n) == 0,
                          f"ffn_width={self.ffn_width} is not divisible by n_experts={n}")


def make_config(preset: str) -> GranularityConfig:
    if preset == "quick":
        return GranularityConfig.from_preset(preset)
    return GranularityConfig.from_preset(preset, ffn_width=2560,
                                         n_experts=(8, 16, 32, 40, 64, 80))


def run(cfg: GranularityConfig, run: RunDir) -> dict:
    if note := blockffn_changes(cfg.model, cfg.MODEL_SET_HERE):
        run.note(note)
    train_src, val = cfg.sources()
    rows = []
    for n in cfg.n_experts:
        n = int(n)
        spec = cfg.model.replace(arch="blockffn", n_experts=n, d_expert=cfg.ffn_width // n)
        ev = train_and_evaluate(spec, cfg.train, train_src, val)
        rows.append(summary_row(f"N={n}", ev, {"n_experts": n, "d_expert": cfg.ffn_width // n}))
    run.table("granularity", rows, title=f"Expert granularity at N * d_expert = "
              f"{cfg.ffn_width}", columns=["n_experts", "d_expert", "val_ppl", "TLS", "CLS_8",
                                           "reuse", "params"])
    xs = [r["n_experts"] for r in rows]
    best_n = {f"paper's best N={PAPER_BEST_N}": PAPER_BEST_N}
    run.line_plot("granularity_sparsity", {"TLS": (xs, [r["TLS"] for r in rows]),
                                           "CLS_8": (xs, [r["CLS_8"] for r in rows])},
                  xlabel="experts N", ylabel="sparsity", logx=True, markers=True,
                  vlines=best_n, hlines={f"paper's TLS {PAPER_TLS:g}": PAPER_TLS,
                                         f"paper's CLS_8 {PAPER_CLS_8:g}": PAPER_CLS_8},
                  title="TLS / CLS_8 vs expert granularity (Fig. 6)")
    run.line_plot("granularity_ppl", {"val PPL": (xs, [r["val_ppl"] for r in rows])},
                  xlabel="experts N", ylabel="validation PPL (bytes)", logx=True, markers=True,
                  vlines=best_n, title="Validation PPL vs expert granularity (Fig. 5)")
    best = min(rows, key=lambda r: r["val_ppl"])
    return {"headline": "; ".join(f"N={r['n_experts']}: PPL {r['val_ppl']:.3f} TLS "
                                  f"{r['TLS']:.3f} CLS8 {r['CLS_8']:.3f}" for r in rows),
            "best_n": best["n_experts"]}


def _sparsity_peaks_inside(t: dict, ns: list[float]) -> Claim:
    """App. F's non-monotonic sparsity: the middle setting of the highest mean TLS over the
    seed runs beats the coarsest and the finest setting on TLS and on CLS_8 (four paired
    comparisons, every one must hold). Picked as the best of the middle settings by its
    means, its intervals are widened to ``1 - 0.05 / K`` for ``K`` candidates (Bonferroni)."""
    inner = ns[1:-1]
    if not inner:
        return Claim(PEAK_CLAIM, None, f"{len(ns)} sizes: no setting between the coarsest "
                                       "and the finest")

    def value(n, column):
        return lambda run: lookup(run.get("granularity"), {"n_experts": n}, column)

    def mean_tls(n):
        vals = [measured(value(n, "TLS")(run)) for run in per_seed(t)]
        return -1.0 if None in vals else sum(vals) / len(vals)

    peak = max(inner, key=mean_tls)
    parts = [paired_compare("", t, (f"N={peak:.0f} {col}", value(peak, col)),
                            (f"N={end:.0f} {col}", value(end, col)), better="higher",
                            alpha=0.05 / len(inner))
             for col in ("TLS", "CLS_8") for end in (ns[0], ns[-1])]
    best = f" (the best of {len(inner)} middle settings: Bonferroni)" if len(inner) > 1 else ""
    return all_hold(PEAK_CLAIM, parts, f"N={peak:.0f}{best}: "
                    + "; ".join(c.evidence for c in parts))


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """Expert granularity (App. F, Figs. 5 and 6): finer experts at equal FFN width lower PPL,
    judged on the paired per-seed differences between the finest and the coarsest setting,
    and on every step between neighbouring settings (each finer one lowers PPL); each
    comparison at close TLS (:func:`experiments.blockffn.common.at_close_tls`: a denser finer
    setting's lower PPL could be its density). Sparsity peaks at a middle setting
    (:func:`_sparsity_peaks_inside`)."""
    rows = sorted(t.get("granularity") or [], key=lambda r: float(r["n_experts"]))
    if len(rows) < 2:
        return [Claim("Finer experts lower PPL (App. F)", None, "fewer than two sizes"),
                Claim(PEAK_CLAIM, None, "fewer than two sizes")]
    ns = [float(r["n_experts"]) for r in rows]

    def finer(claim, fine, coarse):  # fine has the lower PPL, at close TLS
        return at_close_tls(claim, t, "granularity", fine, coarse, key="n_experts",
                            labels=(f"N={fine:.0f}", f"N={coarse:.0f}"))

    out = [finer("Finer experts lower PPL at equal FFN width (App. F, Fig. 5)", ns[-1], ns[0])]
    if len(ns) > 2:
        steps = [finer("", b, a) for a, b in zip(ns, ns[1:])]
        out.append(all_hold("Each finer setting lowers PPL (App. F, Fig. 5)", steps,
                            "; ".join(f"N={b:.0f} vs N={a:.0f}: {c.verdict}"
                                      for (a, b), c in zip(zip(ns, ns[1:]), steps))))
    return out + [_sparsity_peaks_inside(t, ns)]


STUDY = Study(
    "blockffn_granularity", make_config, run, claims=claims,
    seed_keys=("train.seed",),
    quick_repeat=5,
    paper_scale=PAPER_SCALE,
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
