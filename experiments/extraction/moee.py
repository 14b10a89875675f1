"""Expert extraction from trained MLPs (MoEE, Berisha et al. 2025, Sec. 3) against the
MoEfication baseline, on a ViT (MNIST-5k) or on the real all-MiniLM-L6-v2 (WordNet gloss ->
part of speech).

Recipe per seed: record the FFN inputs and hidden activations of ``extract.n_tokens`` random
training tokens; per layer cluster the activations with HDBSCAN (minimum cluster size 0.6% of
the sample; no cluster: the layer stays dense); per cluster keep the neurons covering p = 80% of
its variance; route each token to the cluster whose mean input is most cosine-similar; remove
the neurons no expert uses. Then fine-tune with knowledge distillation from the unmodified
model (AdamW, weight decay 0.01, cosine schedule, through the training loop). MoEfication:
the same layers cut into ``moefication_experts`` equal experts by balanced k-means over the
``W_up`` columns, top-k per layer chosen so its active neurons match MoEE's (equal MACs),
parameter-centre (``param``) and trained MLP routers as the MoEfication code builds them, the
same fine-tuning.

Outputs: Table 1 analog (MACs, parameters, accuracy right after extraction and after KD
fine-tuning, over seeds), per-layer experts, Table 2 analog (random clusters / neurons /
routing; DBSCAN, OPTICS, k-means, BIRCH; magnitude selection; Euclidean routing), extraction
stability against the sample size, per-class routing distributions and expert-mean cosine
similarity matrices of an early and a late extracted layer.

    python -m experiments.extraction.moee                       # quick: the ViT substrate on CPU
    python -m experiments.extraction.moee model=minilm seeds=2 kd.steps=60 kd.batch_size=32
        "ablations=(random_all,random_routing,kmeans,euclidean)" finetune_ablations=false
        "stability_tokens=(1000,2000)"               # (one line) the real MiniLM on CPU, ~15 min
    python -m experiments.extraction.moee preset=full           # GPU: bigger samples, longer KD
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from experiments.extraction.claims import claims
from experiments.extraction.common import PAPER_SCALE
from moejax.config import config
from moejax.extract import (
    extract_model,
    param_breakdown,
    record_ffn,
)
from moejax.extract.finetune import evaluate_extracted, kd_finetune, load_cv
from moejax.extract.pipeline import (
    ExtractConfig,
    cluster_layers,
    expert_summary,
    matched_top_k,
    moee_plans,
    moefication_model,
)
from moejax.extract.start import ExtractionSource, source_preset
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.harness.tables import mean_std, seed_summary
from moejax.substrates.classifier_data import ClassifierData
from moejax.train.hparams import TrainConfig, require_read

# ablation key -> (label, cluster method, neuron selection, router); "random" routing sends
# every token to a random expert (Table 2)
ABLATIONS = {
    "random_all": ("random clusters + random neurons + random routing", "random", "random",
                   "random"),
    "random_neurons_routing": ("HDBSCAN + random neurons + random routing", "hdbscan",
                               "random", "random"),
    "random_routing": ("HDBSCAN + variance + random routing", "hdbscan", "variance", "random"),
    "dbscan": ("DBSCAN", "dbscan", "variance", "cosine"),
    "optics": ("OPTICS", "optics", "variance", "cosine"),
    "kmeans": ("k-means (HDBSCAN's count)", "kmeans", "variance", "cosine"),
    "birch": ("BIRCH (HDBSCAN's count)", "birch", "variance", "cosine"),
    "magnitude": ("magnitude selection", "hdbscan", "magnitude", "cosine"),
    "euclidean": ("Euclidean routing", "hdbscan", "variance", "euclidean"),
}
KD = TrainConfig(steps=150, batch_size=64, lr=5e-4, schedule="cosine", warmup_steps=0,
                 optimizer="adamw", weight_decay=0.01, log_every=25)


@config
class MoEEStudyConfig(ExtractionSource):
    """The substrate and its recording (:class:`moejax.extract.start.ExtractionSource`);
    kd: the fine-tuning (``kd_alpha`` weight of the KL term, the rest cross-entropy);
    moefication_*: the baseline; ablations: keys of ``ABLATIONS``; stability_tokens /
    stability_draws: the sample-size study."""

    kd: TrainConfig = KD
    kd_alpha: float = 0.5
    kd_temperature: float = 1.0
    moefication_experts: int = 8
    moefication_routers: tuple[Literal["param", "mlp"], ...] = ("param", "mlp")
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    finetune_ablations: bool = True
    stability_tokens: tuple[int, ...] = (1000, 2000, 4000)
    stability_draws: int = 3
    seeds: int = 5  # paired for the claims (moejax.harness.claims)
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        require_read(self, "kd", "the KD fine-tune")
        r = self._require
        bad = [a for a in self.ablations if a not in ABLATIONS]
        r(not bad, f"ablations {bad} unknown; use a subset of {tuple(ABLATIONS)}")
        r(self.seeds >= 1 and self.stability_draws >= 1, "seeds and stability_draws must be >= 1")
        width = self.ffn_width()
        r(self.moefication_experts >= 1 and width % self.moefication_experts == 0,
          f"moefication_experts={self.moefication_experts} must divide the FFN width {width} "
          "(MoEfication's balanced experts are of equal size)")
        r(0.0 <= self.kd_alpha <= 1.0 and self.kd_temperature > 0,
          "kd_alpha in [0, 1], kd_temperature > 0")
        r(all(n >= 10 for n in self.stability_tokens), "stability_tokens must be >= 10 each")
        for n in self.stability_tokens:
            self.require_sample(n, "stability_tokens")


def make_config(preset: str) -> MoEEStudyConfig:
    if preset == "quick":
        return MoEEStudyConfig()
    return MoEEStudyConfig(
        **source_preset("full"),
        kd=KD.replace(steps=3000, batch_size=32, lr=1.5e-5), moefication_experts=16,
        stability_tokens=(5000, 20000, 50000, 100000), stability_draws=3, seeds=3)


# ------------------------------------------------------------------------------ steps


def _data(cfg: MoEEStudyConfig) -> ClassifierData:
    return cfg.classifier_data(train_rows=max(cfg.record_rows, 4 * cfg.kd.batch_size))


def _kd(cfg: MoEEStudyConfig, data: ClassifierData, model, seed: int):
    return kd_finetune(data, model, cfg.kd, alpha=cfg.kd_alpha,
                       temperature=cfg.kd_temperature, seed=seed)


def one_seed(cfg: MoEEStudyConfig, data: ClassifierData, dense: dict, seed: int, out: dict) -> None:
    ex = cfg.extract
    records = record_ffn(data.model, data.record_batches(cfg.record_rows, seed),
                         n_tokens=ex.n_tokens, seed=seed)
    labels = cluster_layers(records, ex.cluster, seed=seed)
    plans = moee_plans(records, labels, ex, seed=seed)
    moee = extract_model(data.model, plans, router=ex.router)
    variants = [("MoEE", moee)]
    row = evaluate_extracted(data, moee, "MoEE", dense)
    row["experts"] = _experts_per_layer(plans)
    active = {i: s["active_neurons"] for i, s in row["_stats"].items()}
    layers = sorted(active)
    F = {i: int(plans[i].masks_EF.shape[1]) for i in layers}
    rows = [row]
    if layers:
        size = {i: F[i] // cfg.moefication_experts for i in layers}
        ks = matched_top_k(active, size, cfg.moefication_experts)
        for r in cfg.moefication_routers:
            m, _ = moefication_model(data.model, records, layers, n_experts=cfg.moefication_experts,
                                     top_k=ks, router=r, seed=seed)
            variants.append((f"MoEfication ({r} router)", m))
            rows.append(evaluate_extracted(data, m, variants[-1][0], dense))
    for (_, m), r in zip(variants, rows):
        r["accuracy_after_kd"] = data.evaluator(_kd(cfg, data, m, seed))["accuracy"]
        r["load_cv"] = load_cv(r["_stats"]) if r["_stats"] else float("nan")
        r["seed"] = seed
        out["table1"].append(r)
    out["samples"][seed] = (records, labels)
    out["params"].extend({"seed": seed, **r} for r in param_breakdown(data.model, plans))
    if seed == cfg.seed:
        out["plans"] = plans
        out["moee_stats"] = rows[0]["_stats"]
        for name, r in zip([v[0] for v in variants], rows):
            for i, s in sorted(r["_stats"].items()):
                out["layers"].append({"model": name, "layer": i,
                                      "experts": len(s["load"]),
                                      "active_neurons": s["active_neurons"], "of_neurons": F[i],
                                      "max_load": float(s["load"].max()),
                                      "load_cv": float(np.std(s["load"]) / np.mean(s["load"]))})


def _experts_per_layer(plans: dict) -> str:
    """Experts of each FFN layer in order, ``"2/2/4"`` (0: the layer kept dense)."""
    return "/".join(str(0 if p is None else p.n_experts) for _, p in sorted(plans.items()))


def ablations(cfg: MoEEStudyConfig, data: ClassifierData, dense: dict, base: dict) -> list[dict]:
    """Table 2 analog, on every seed's token sample."""
    rows = []
    for seed, (records, hd_labels) in sorted(base["samples"].items()):
        counts = {i: int(lab.max() + 1) if lab.max() >= 0 else 0
                  for i, lab in hd_labels.items()}
        for key in cfg.ablations:
            label, method, selection, router = ABLATIONS[key]
            ex = cfg.extract.replace(selection=selection, router=router,
                                     cluster=cfg.extract.cluster.replace(method=method))
            labels = (hd_labels if method == "hdbscan"
                      else cluster_layers(records, ex.cluster, seed=seed, n_clusters=counts))
            plans = moee_plans(records, labels, ex, seed=seed)
            m = extract_model(data.model, plans, router=router)
            r = evaluate_extracted(data, m, label, dense)
            r["experts"] = _experts_per_layer(plans)
            if cfg.finetune_ablations:
                r["accuracy_after_kd"] = data.evaluator(_kd(cfg, data, m, seed))["accuracy"]
            rows.append({**r, "seed": seed})
    return rows


def stability(cfg: MoEEStudyConfig, data: ClassifierData) -> list[dict]:
    """Experts per layer and mean expert size against the token-sample size (draws = seeds)."""
    rows = []
    for n in cfg.stability_tokens:
        per = []
        for d in range(cfg.stability_draws):
            seed = cfg.seed + 100 + d  # apart from the seed runs' samples
            rec = record_ffn(data.model, data.record_batches(cfg.record_rows, seed),
                             n_tokens=n, seed=seed)
            labels = cluster_layers(rec, cfg.extract.cluster, seed=seed)
            plans = moee_plans(rec, labels, cfg.extract, seed=seed)
            per.append(expert_summary(plans))
        for li in range(len(per[0])):
            ex = np.asarray([p[li]["experts"] for p in per], float)
            size = np.asarray([p[li].get("size_mean", 0.0) for p in per], float)
            rows.append({"tokens": n, "layer": per[0][li]["layer"], "experts_mean": ex.mean(),
                         "experts_std": mean_std(ex)[1], "size_mean": size.mean(),
                         "size_std": mean_std(size)[1]})
    return rows


# ------------------------------------------------------------------------------ report


def _table1(run: RunDir, rows: list, dense: dict, cfg) -> dict:
    out, by = [], {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    for name, rs in by.items():
        acc, acc_s = mean_std([r["accuracy"] for r in rs])
        kd, kd_s = mean_std([r["accuracy_after_kd"] for r in rs])
        out.append({"model": name, "MACs": np.mean([r["MACs"] for r in rs]),
                    "MACs_change_%": np.mean([r["MACs_change_%"] for r in rs]),
                    "params": np.mean([r["params"] for r in rs]),
                    "params_change_%": np.mean([r["params_change_%"] for r in rs]),
                    "acc_extracted": acc, "acc_extracted_std": acc_s,
                    "acc_after_kd": kd, "acc_after_kd_std": kd_s,
                    "kd_vs_dense_%": 100 * kd / dense["accuracy"],
                    "load_cv": np.mean([r["load_cv"] for r in rs]), "seeds": len(rs)})
    run.table("table1", [{"model": "dense", "MACs": dense["MACs"], "params": dense["params"],
                          "acc_extracted": dense["accuracy"], "acc_after_kd": dense["accuracy"],
                          "kd_vs_dense_%": 100.0}] + out,
              title=f"Table 1 analog: {cfg.model}, mean over {cfg.seeds} seeds (MACs per "
                    "example; load_cv: coefficient of variation of the expert loads, mean "
                    "over layers)")
    run.bar_plot("table1_accuracy", [r["model"] for r in out],
                 [r["acc_after_kd"] for r in out], errors=[r["acc_after_kd_std"] for r in out],
                 ylabel="test accuracy after KD", hlines={"dense": dense["accuracy"]},
                 title="Accuracy after KD fine-tuning (dense model drawn in)")
    return {r["model"]: r for r in out}


def _plots(run: RunDir, data: ClassifierData, base: dict) -> list[int]:
    stats, plans = base["moee_stats"], base["plans"]
    layers = sorted(stats)
    if not layers:
        return []
    picks = sorted({layers[0], layers[-1]})
    for i in picks:
        s = stats[i]
        xs = np.arange(len(s["load"]))
        series = {data.class_names[c]: (xs, s["per_class"][c])
                  for c in range(min(data.n_classes, 6))}
        series["all"] = (xs, s["load"])
        run.line_plot(f"routing_layer{i}", series, xlabel="expert", ylabel="share of tokens",
                      markers=True, title=f"Layer {i}: routing per class (first classes) and "
                      "over all classes")
        r = plans[i].router_ED.astype(np.float64)
        r = r / np.maximum(np.linalg.norm(r, axis=1, keepdims=True), 1e-12)
        run.heatmap(f"similarity_layer{i}", r @ r.T, xlabel="expert", ylabel="expert",
                    vmin=-1, vmax=1, title=f"Layer {i}: cosine similarity of expert mean inputs")
    return picks


def run(cfg: MoEEStudyConfig, run: RunDir) -> dict:
    data = _data(cfg)
    d = evaluate_extracted(data, data.model, "dense", {})
    dense = {"accuracy": d["accuracy"], "MACs": d["MACs"], "params": d["params"]}
    out = {"table1": [], "layers": [], "samples": {}, "params": []}
    for s in range(cfg.seeds):
        one_seed(cfg, data, dense, cfg.seed + s, out)
    t1 = _table1(run, out["table1"], dense, cfg)
    _seed_tables(cfg, run, out, ablations(cfg, data, dense, out))
    _stability(cfg, run, data)
    picks = _plots(run, data, out)
    moee = t1["MoEE"]
    moef = {k: v for k, v in t1.items() if k.startswith("MoEfication")}
    exp = {r["layer"]: r["experts"] for r in out["layers"] if r["model"] == "MoEE"}
    counts = [exp.get(i, 0) for i in sorted(out["plans"])]
    run.note(_recipe_note(cfg, data, dense, counts))
    if picks:
        run.note(f"Routing and similarity plots: layers {picks}.")
    res = {"dense_acc": dense["accuracy"], "moee_acc": moee["acc_extracted"],
           "moee_acc_kd": moee["acc_after_kd"], "moee_macs_%": moee["MACs_change_%"],
           "moee_params_%": moee["params_change_%"], "clusters": counts,
           **{f"{k}_acc_kd": v["acc_after_kd"] for k, v in moef.items()}}
    res["headline"] = (
        f"MoEE on {cfg.model}: MACs {moee['MACs_change_%']:+.1f}%, params "
        f"{moee['params_change_%']:+.1f}%, accuracy {moee['acc_extracted']:.3f} extracted -> "
        f"{moee['acc_after_kd']:.3f} after KD (dense {dense['accuracy']:.3f}); "
        + ", ".join(f"{k} {v['acc_after_kd']:.3f}" for k, v in moef.items())
        + f" (mean of {cfg.seeds} seeds)")
    return res


def _no_stats(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "_stats"} for r in rows]


def _seed_tables(cfg: MoEEStudyConfig, run: RunDir, out: dict, abl: list[dict]) -> None:
    """Table 1 per seed, the extracted layers, Table 2 (per seed and over seeds) and where
    the parameters go."""
    run.table("table1_per_seed", _no_stats(out["table1"]), title="Table 1, every seed")
    run.table("experts_per_layer", out["layers"],
              title=f"Per extracted layer (seed {cfg.seed}): experts, mean active neurons per "
                    "token, routing balance")
    if abl:
        run.table("table2_per_seed", _no_stats(abl), title="Table 2 analog, every seed")
        run.table("table2_ablations", seed_summary(abl, ["model"], [
            "accuracy", "accuracy_after_kd", "MACs_change_%", "params_change_%"]),
                  title=f"Table 2 analog, mean and sample std over {cfg.seeds} seeds: "
                        "components replaced by random counterparts, other clustering, "
                        "selection and routing")
    run.table("params_per_layer", out["params"],
              title="Where the parameters go, every seed: per layer the FFN width, the neurons "
                    "some expert keeps, and the parameters removed; the last rows count the "
                    "whole model, the model without its token/patch embedding, and the FFNs")


def _stability(cfg: MoEEStudyConfig, run: RunDir, data) -> None:
    """Experts found against the number of recorded tokens, per layer."""
    stab = stability(cfg, data) if cfg.stability_tokens else []
    if not stab:
        return
    run.table("stability", stab, title="Extraction against the token-sample size "
              f"({cfg.stability_draws} draws each): experts per layer, mean expert size")
    series = {f"layer {li}": ([r["tokens"] for r in stab if r["layer"] == li],
                              [r["experts_mean"] for r in stab if r["layer"] == li])
              for li in sorted({r["layer"] for r in stab})}
    run.line_plot("stability", series, xlabel="recorded tokens", ylabel="experts (mean)",
                  logx=True, markers=True, title="Experts found vs sample size")


def _recipe_note(cfg: MoEEStudyConfig, data, dense: dict, counts: list[int]) -> str:
    """What ran: the extraction (beside the paper's minimum cluster size and extraction
    percentage where this run changes them), the KD fine-tune's optimizer and schedule as
    configured, the MoEfication baseline, and whether the ablations were fine-tuned."""
    paper = ExtractConfig()
    changed = [f"{what} {got} (the paper's: {want})" for what, got, want in (
        ("minimum cluster size", f"{cfg.extract.cluster.min_cluster_frac:.2%}",
         f"{paper.cluster.min_cluster_frac:.2%}"),
        ("extraction percentage p", f"{cfg.extract.p:g}", f"{paper.p:g}")) if got != want]
    recipe = ("the paper's recipe" if not changed else
              "the paper's recipe but for its " + "; ".join(changed))
    return (f"Started from substrate {data.substrate}; dense test accuracy "
            f"{dense['accuracy']:.4f} on {len(data.test['labels'])} test rows. Extraction: "
            f"{cfg.extract.n_tokens} recorded tokens of {data.record_rows(cfg.record_rows)} "
            f"training rows, {cfg.extract.cluster.method} with min "
            f"cluster size {cfg.extract.cluster.min_cluster_frac:.2%} of the sample, p = "
            f"{cfg.extract.p}, {cfg.extract.selection} selection, {cfg.extract.router} routing "
            f"to cluster mean inputs ({recipe}). Clusters per layer (seed {cfg.seed}): "
            f"{counts}. KD: {cfg.kd.steps} steps of {cfg.kd.optimizer_label()}, lr "
            f"{cfg.kd.lr}, {cfg.kd.schedule} schedule, loss {cfg.kd_alpha} "
            f"KL(T={cfg.kd_temperature}) + {1 - cfg.kd_alpha:g} CE (the paper does not give its "
            f"KD loss). MoEfication: {cfg.moefication_experts} balanced k-means experts per "
            "extracted layer, top-k matched per layer to MoEE's mean active neurons, routed by "
            "their parameter centres (param) or the trained Linear-Tanh-Linear MLP router "
            "(mlp), as the MoEfication code builds them. Random routing sends each token to a "
            "random expert."
            + ("" if not cfg.ablations else
               " The ablations get the same KD before they are compared (Sec. 5)."
               if cfg.finetune_ablations else
               " The ablations are not fine-tuned (finetune_ablations=false; Sec. 5 compares "
               "them after the KD)."))


STUDY = Study(
    "moee", make_config, run, claims=claims,
    smoke=("extract.n_tokens=2000", "record_rows=200", "stability_tokens=(2000,)", "seeds=1",
             "eval_rows=64"),
    paper_scale=PAPER_SCALE,
    derived_keys=(("kd.seed", "each extraction seed"),
                  *((f"extract.{k}", f"the MoEE row is the paper's {what}; ablations= runs "
                                     "the others, each against it")
                    for k, what in (("selection", "variance selection"),
                                    ("router", "cosine routing"),
                                    ("cluster.method", "HDBSCAN"))),
                  ("extract.cluster.n_clusters", "HDBSCAN's count per layer, for the "
                                                 "ablations that need one")),
    # the recipe on a real pretrained transformer: all-MiniLM-L6-v2 fine-tuned on WordNet
    # parts of speech (a shorter KD and ablation set than the ViT's, for the CPU's time)
    variants=(("minilm", ("model=minilm", "seeds=3", "kd.steps=60", "kd.batch_size=32",
                          "ablations=(random_all,random_routing,kmeans,euclidean)",
                          "finetune_ablations=false", "stability_tokens=(1000,2000)")),),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
