"""BlockFFN training-objective ablations (Table 5 analog) and RMSNorm on/off (Section 4.1.4).

Settings (same model, data and steps): AL+CS (standard), CS, AL, Null, AL+L1, AL+Ent and
AL+CS without the router RMSNorm, and AL+CS with the other AL sharpness (alpha 10 <-> 100). CS
uses the adaptive lambda_cs scheduler; L1 (on the ReLU activations A1) and router entropy use
fixed coefficients, chosen so that AL+L1 and AL+Ent reach AL+CS's TLS: the PPL comparisons
count only at close TLS (half an expert, as Table 2 compares), since a sparser model has the
higher PPL whatever its objective. The quick preset's are calibrated so (training seed 0: TLS
0.819 with L1 1.5e-3 and 0.833 with entropy 7e-3, against AL+CS's 0.816); the full preset's
have not been, and its claims say so where the TLS lands apart.

alpha: the paper's alpha = 100 assumes small router scores; with this library's router init
(``A0 ~ N(0, 1)`` at init) the quick models train better with alpha = 10 (measured: see the
``alpha`` table), so the quick presets use 10 and the full presets keep the paper's 100.

    python -m experiments.blockffn.ablations                 # quick (CPU)
"""

from __future__ import annotations

from experiments.blockffn.common import (
    PAPER_SCALE,
    SparseLMStudyConfig,
    at_close_tls,
    blockffn_changes,
)
from moejax.config import config
from moejax.harness.claims import Claim, all_hold, lookup, paired_compare
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.sparse_lm import summary_row, train_and_evaluate


@config
class AblationsConfig(SparseLMStudyConfig):
    l1_coef: float = 1e-2  # AL+L1's coefficient
    entropy_coef: float = 5e-2  # AL+Ent's coefficient

    # each setting names its objective: the model's switches for them are the settings' own
    MODEL_SET_HERE = {
        "arch": "every model it trains is BlockFFN",
        "use_cs": "each setting turns CS on or off (on in AL+CS and CS)",
        "rmsnorm": "each setting has the router RMSNorm but 'AL+CS, no RMSNorm'",
        "l1_coef": "AL+L1 alone takes the study's own l1_coef",
        "entropy_coef": "AL+Ent alone takes the study's own entropy_coef"}

    def validate(self):
        super().validate()
        self._require(self.model.al_coef > 0,
                      f"model.al_coef={self.model.al_coef} leaves AL out of every setting "
                      "(AL+CS would be CS, AL would be Null); give a weight > 0, the one the "
                      "AL settings train with (CS and Null set it to 0)")
        for name, arm in (("l1_coef", "AL+L1"), ("entropy_coef", "AL+Ent")):
            self._require(getattr(self, name) > 0, f"{name}={getattr(self, name)} makes {arm} "
                          f"the setting AL; give {arm}'s weight > 0")


def make_config(preset: str) -> AblationsConfig:
    if preset == "quick":  # AL+L1 and AL+Ent at AL+CS's TLS (module docstring)
        return AblationsConfig.from_preset(preset, l1_coef=1.5e-3, entropy_coef=7e-3)
    return AblationsConfig.from_preset(preset)


def run(cfg: AblationsConfig, run: RunDir) -> dict:
    if note := blockffn_changes(cfg.model, cfg.MODEL_SET_HERE):
        run.note(note)
    train_src, val = cfg.sources()
    m = cfg.model.replace(arch="blockffn")
    no_al = dict(al_coef=0.0)
    settings = {
        "AL+CS": m,
        "CS": m.replace(**no_al),
        "AL": m.replace(use_cs=False),
        "Null": m.replace(use_cs=False, **no_al),
        "AL+L1": m.replace(use_cs=False, l1_coef=cfg.l1_coef),
        "AL+Ent": m.replace(use_cs=False, entropy_coef=cfg.entropy_coef),
        "AL+CS, no RMSNorm": m.replace(rmsnorm=False),
    }
    other_alpha = 100.0 if m.alpha != 100.0 else 10.0
    settings[f"AL+CS, alpha={other_alpha:g}"] = m.replace(alpha=other_alpha)
    rows = []
    for name, spec in settings.items():
        ev = train_and_evaluate(spec, cfg.train, train_src, val)
        rows.append(summary_row(name, ev, {"CLS_64": ev.get("cls_64", float("nan")),
                                   "act_magnitude": ev.get("magnitude", float("nan")),
                                   "n_experts": spec.n_experts}))
    run.table("objectives", [r for r in rows if "," not in r["model"]],
              title="Training-objective ablations (Table 5 analog)",
              columns=["model", "val_ppl", "TLS", "CLS_8", "CLS_64", "reuse", "n_experts"])
    rms = [r for r in rows if r["model"] in ("AL+CS", "AL+CS, no RMSNorm")]
    run.table("rmsnorm", rms, title="Router RMSNorm on/off (Section 4.1.4)",
              columns=["model", "val_ppl", "TLS", "CLS_8", "reuse", "act_magnitude",
                       "n_experts"])
    run.table("alpha", [r for r in rows if r["model"] == "AL+CS" or "alpha" in r["model"]],
              title=f"AL sigmoid sharpness (preset alpha={m.alpha:g})",
              columns=["model", "val_ppl", "TLS", "CLS_8", "reuse"])
    best = min(rows, key=lambda r: r["val_ppl"])
    return {"headline": "; ".join(f"{r['model']}: PPL {r['val_ppl']:.3f} TLS {r['TLS']:.3f} "
                                  f"CLS8 {r['CLS_8']:.3f}" for r in rows[:3]),
            "lowest_ppl": best["model"]}


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """BlockFFN's objective and RMSNorm ablations (Table 5, Sec. 4.1.4, 4.2), each judged on
    the paired per-seed differences (:func:`moejax.harness.claims.paired_compare`). A
    comparison of two objectives counts only at close TLS
    (:func:`experiments.blockffn.common.at_close_tls`): a sparser
    model has the higher PPL and the higher CLS whatever its objective (the paper explains
    AL+CS's lead over CS by its lower TLS, Sec. 4.2). AL+CS against AL alone is about the
    sparsity CS adds, and needs no such check. Removing AL (CS alone) costs CLS and PPL
    (Sec. 4.2: "without AL (Setting CS), the model suffers from lower CLS and considerably
    higher PPL"), each at close TLS. Without RMSNorm, "the magnitudes of activation values in
    BlockFFN considerably rise" (Sec. 4.1.4): the mean ``||A||_2`` of the routing weights."""
    def col(table, model, column):
        return model, lambda r: lookup(r.get(table), {"model": model}, column)

    def cls_over(other):
        return at_close_tls("", t, "objectives", "AL+CS", other, "CLS_8")

    cls = [cls_over(other) for other in ("AL+L1", "AL+Ent")]
    return [
        at_close_tls("AL+CS has a lower PPL than AL+L1 (Table 5)", t, "objectives", "AL+CS",
                     "AL+L1"),
        at_close_tls("AL+CS has a lower PPL than AL+Ent (Table 5)", t, "objectives", "AL+CS",
                     "AL+Ent"),
        all_hold("AL+CS has a higher CLS_8 than AL+L1 and AL+Ent (Table 5, Sec. 4.2)", cls,
                 "; ".join(c.evidence for c in cls)),
        paired_compare("CS adds chunk-level sparsity: AL+CS has a higher CLS_8 than AL alone "
                       "(Table 5)", t, col("objectives", "AL+CS", "CLS_8"),
                       col("objectives", "AL", "CLS_8")),
        at_close_tls("AL adds chunk-level sparsity: AL+CS has a higher CLS_8 than CS alone "
                     "(Sec. 4.2, Table 5)", t, "objectives", "AL+CS", "CS", "CLS_8"),
        at_close_tls("AL+CS has a lower PPL than CS alone (Sec. 4.2, Table 5)", t, "objectives",
                     "AL+CS", "CS"),
        at_close_tls("The router RMSNorm lowers PPL (Sec. 4.1.4)", t, "rmsnorm", "AL+CS",
                     "AL+CS, no RMSNorm", labels=("with", "without")),
        paired_compare("Without the router RMSNorm the activation magnitudes rise (Sec. 4.1.4, "
                       "Fig. 4)", t, col("rmsnorm", "AL+CS, no RMSNorm", "act_magnitude"),
                       col("rmsnorm", "AL+CS", "act_magnitude")),
    ]


STUDY = Study(
    "blockffn_ablations", make_config, run, claims=claims,
    seed_keys=("train.seed",),
    quick_repeat=5,
    paper_scale=PAPER_SCALE,
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
