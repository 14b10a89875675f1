"""Smoke test: the MoEE study runs tiny on the (tiny) ViT substrate, writes Table 1 / Table 2 /
stability tables and the routing and similarity plots, names its substrate, and the
extracted model's accounting is consistent."""

import csv
import re

import pytest

from experiments import study_module
from experiments.extraction import moee as mod  # imported before tiny_recipes patches the registry
from experiments.extraction.moee import _recipe_note, make_config
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.extract import ClusterConfig
from moejax.extract.pipeline import ExtractConfig
from moejax.harness.experiment import run_experiment
from moejax.io.hf_tokenizer import tokenizer_from_json
from moejax.io.minilm import minilm_dir
from moejax.substrates.classify import ViTSubstrateConfig, mnist_arrays, wordnet_arrays
from tests.tiny_substrates import tiny_train


def run_tiny(cache, out, min_cluster_frac: float, **overrides):
    """The study on the tiny ViT substrate; ``(run dir, {model: Table 1 row})``."""
    cfg = mod.make_config("quick").replace(
        vit=ViTSubstrateConfig(d_model=16, n_layers=2, n_heads=2, d_hidden=32,
                               train=tiny_train(3)),
        substrate_cache=str(cache), record_rows=40, eval_rows=100, seeds=1,
        extract=ExtractConfig(n_tokens=300,
                              cluster=ClusterConfig(min_cluster_frac=min_cluster_frac)),
        **overrides)
    _, run = run_experiment(mod.STUDY.name, lambda preset: cfg, mod.run, [], claims=mod.claims,
                            out=out)
    return run, {r["model"]: r for r in csv.DictReader(open(run.path / "table1.csv"))}


@pytest.mark.slow
def test_moee_tiny(tiny_recipes, tmp_path):
    run, rows = run_tiny(tiny_recipes, tmp_path / "moee", 0.02,
                         kd=mod.KD.replace(steps=2, batch_size=8),
                         ablations=("random_all", "kmeans"), stability_tokens=(200,),
                         stability_draws=1, moefication_experts=4,
                         finetune_ablations=False)
    assert "dense" in rows
    text = (run.path / "summary.md").read_text()
    assert "Started from substrate vit_mnist5k" in text
    claims = {r["claim"]: r["verdict"] for r in csv.DictReader(open(run.path / "claims.csv"))}
    assert any(c.startswith("MoEE beats MoEfication") for c in claims)  # judged from tables
    for name in ("stability.csv", "experts_per_layer.csv"):
        assert (run.path / name).is_file()
    m = rows["MoEE"]
    assert float(m["MACs"]) < float(rows["dense"]["MACs"])  # the tiny layers form clusters
    correct = float(m["acc_after_kd"]) * 100  # eval_rows=100: a count of correct rows
    assert abs(correct - round(correct)) < 1e-6
    assert {"MoEfication (param router)", "MoEfication (mlp router)"} <= set(rows)
    # the parameter breakdown accounts for exactly the parameters the extraction removed
    per_seed = {r["model"]: r for r in csv.DictReader(open(run.path / "table1_per_seed.csv"))}
    parts = {r["layer"]: r for r in csv.DictReader(open(run.path / "params_per_layer.csv"))}
    whole = parts["whole model"]
    assert float(whole["total_params"]) == float(rows["dense"]["params"])
    assert (float(rows["dense"]["params"]) - float(whole["params_removed"])
            == float(per_seed["MoEE"]["params"]))
    abl = list(csv.DictReader(open(run.path / "table2_ablations.csv")))
    assert [r["model"] for r in abl] == [mod.ABLATIONS[k][0] for k in ("random_all", "kmeans")]
    assert list(run.path.glob("similarity_layer*.png"))
    assert list(run.path.glob("routing_layer*.png"))


def test_moee_without_clusters_keeps_the_dense_model_and_says_so(tiny_recipes, tmp_path):
    run, rows = run_tiny(tiny_recipes, tmp_path / "moee0", 0.05,
                         kd=mod.KD.replace(steps=1, batch_size=8), ablations=(),
                         stability_tokens=())
    assert set(rows) == {"dense", "MoEE"}  # no extracted layer: no MoEfication either
    assert rows["MoEE"]["MACs"] == rows["dense"]["MACs"]
    claims = {r["claim"]: r["verdict"] for r in csv.DictReader(open(run.path / "claims.csv"))}
    assert not any("MoEfication" in c for c in claims)  # nothing to compare with
    # +0% against the 27% bar, but one seed gives no interval: the rule cannot tell
    assert claims["MoEE cuts MACs by 27% or more (Table 1)"] == "inconclusive"


def test_stability_draws_follow_the_base_seed(monkeypatch):
    """Each stability draw records, clusters and plans from ``seed + 100 + d``: another base
    seed draws other token samples (the seed runs use ``seed + s``, s < 100)."""
    seen = []

    class Data:
        model = None

        def record_batches(self, rows, seed):
            seen.append(("batches", seed))

    monkeypatch.setattr(mod, "record_ffn", lambda m, b, n_tokens, seed: seen.append(
        ("record", seed)))
    monkeypatch.setattr(mod, "cluster_layers", lambda r, c, seed: seen.append(("cluster", seed)))
    monkeypatch.setattr(mod, "moee_plans", lambda r, lab, ex, seed: seen.append(("plan", seed)))
    monkeypatch.setattr(mod, "expert_summary", lambda plans: [{"layer": 0, "experts": 1}])
    for base in (0, 7):
        seen.clear()
        cfg = mod.make_config("quick").replace(seed=base, stability_tokens=(50,),
                                               stability_draws=2)
        mod.stability(cfg, Data())
        assert {s for _, s in seen} == {base + 100, base + 101}
        assert len(seen) == 8  # four steps a draw, every one seeded


def test_each_stability_row_records_the_tokens_it_names(monkeypatch):
    """Each sample size is recorded as named, past 4x extract.n_tokens too (the row's number
    is the sample's)."""
    recorded = []

    class Data:
        model = None

        def record_batches(self, rows, seed):
            return []

    monkeypatch.setattr(mod, "record_ffn", lambda m, b, n_tokens, seed: recorded.append(n_tokens))
    monkeypatch.setattr(mod, "cluster_layers", lambda r, c, seed: None)
    monkeypatch.setattr(mod, "moee_plans", lambda r, lab, ex, seed: None)
    monkeypatch.setattr(mod, "expert_summary", lambda plans: [{"layer": 0, "experts": 1}])
    cfg = mod.make_config("quick").replace(extract=ExtractConfig(n_tokens=1000),
                                           stability_tokens=(500, 8000), stability_draws=1)
    rows = mod.stability(cfg, Data())
    assert recorded == [500, 8000] and [r["tokens"] for r in rows] == [500, 8000]


@pytest.mark.parametrize("study,bad,words", [
    ("moee", "moefication_experts=3", "must divide the FFN width 128"),
    ("moee", "model=minilm moefication_experts=7", "must divide the FFN width 1536"),
    ("moee", "stability_tokens=(20000,)", "stability_tokens=20000 exceeds the 17000 tokens that "
                                         "record_rows=1000 rows of vit hold (17 each"),
    ("moee", "record_rows=100", "extract.n_tokens=4000 exceeds the 1700 tokens"),
    ("moee", "model=minilm extract.n_tokens=40000", "32000 tokens that record_rows=1000 rows "
                                                    "of minilm hold (32 each at most)"),
    ("bench_extracted", "model=vit record_rows=10", "exceeds the 170 tokens"),
])
def test_a_sample_or_split_the_substrate_cannot_give_is_refused(study, bad, words):
    """MoEfication's equal experts must divide the FFN width, and a token sample must fit in
    the recorded rows: refused before the substrate is built or anything trained, not when
    the partition or the recording meets them."""
    m = study_module(study)
    with pytest.raises(ConfigError, match=re.escape(words)):
        apply_overrides(m.make_config("quick"), bad.split())


@pytest.mark.parametrize("model", ["vit", "minilm"])
def test_the_full_preset_sample_fits_in_the_real_tokens_of_its_rows(model):
    """The full preset's token samples (100k, and each stability size) fit in the real tokens
    of the training rows it records, for either substrate, whichever rows are drawn: a
    gloss's real tokens are fewer than ``seq_len``, which the config's check assumes."""
    import numpy as np

    cfg = mod.make_config("full").replace(model=model)
    need = max(cfg.extract.n_tokens, *cfg.stability_tokens)
    if model == "vit":  # every image has all its tokens
        real = min(cfg.record_rows, len(mnist_arrays("train")[1])) * cfg.tokens_per_row()
    else:  # the rows ClassifierData holds (mod._data), the fewest real tokens drawn of them
        held = max(cfg.record_rows, 4 * cfg.kd.batch_size, cfg.minilm.max_train_examples)
        tok = tokenizer_from_json(minilm_dir() / "tokenizer.json")
        mask = wordnet_arrays(cfg.minilm.task, "train", tok, cfg.minilm.seq_len, held)[2]
        real = int(np.sort(mask.sum(1))[:cfg.record_rows].sum())
    assert real >= need, f"{model}: {real} real tokens in the recorded rows, {need} sampled"


def _per_seed(model, n=3, **values):
    """``n`` per-seed rows of ``model``, each value a little apart per seed."""
    return [{"model": model, "seed": s, **{k: v + 0.001 * (s - 1) for k, v in values.items()}}
            for s in range(n)]


def test_claims_compare_at_equal_macs_and_use_the_papers_thresholds():
    dense = {"model": "dense", "acc_after_kd": 0.92}
    moee = {"model": "MoEE", "MACs_change_%": -27.5, "params_change_%": -20.5,
            "kd_vs_dense_%": 97.5, "acc_extracted": 0.80, "acc_after_kd": 0.897, "load_cv": 0.3}
    moef = {"model": "MoEfication (param)", "MACs_change_%": -27.0, "acc_after_kd": 0.85,
            "load_cv": 0.6}
    rand = {"model": "MoEE, random routing", "MACs_change_%": -17.4, "accuracy": 0.5}
    per = (_per_seed("MoEE", **{"MACs_change_%": -27.5, "params_change_%": -20.5,
                                "accuracy_after_kd": 0.897, "accuracy": 0.8, "load_cv": 0.3})
           + _per_seed(moef["model"], accuracy_after_kd=0.85, load_cv=0.6))
    got = {c.claim: c for c in mod.claims({"table1": [dense, moee, moef],
                                           "table1_per_seed": per,
                                           "table2_ablations": [rand]})}
    by = lambda word: next(c for k, c in got.items() if word in k)  # noqa: E731
    assert by("cuts MACs").holds is True and by("cuts non-embedding parameters").holds is True
    assert by("regains 98%").holds is False          # 97.5% passed the old 97% bar
    assert by("MoEfication (param) at equal").holds is True
    assert by("more evenly").holds is True
    rnd = by("random routing")                       # -27.5% vs -17.4%, one pair of means
    assert rnd.verdict == "inconclusive" and "not at equal MACs" in rnd.evidence
    far = {**moef, "MACs_change_%": -20.0}
    c = next(c for c in mod.claims({"table1": [dense, moee, far]}) if "equal MACs" in c.claim)
    assert c.verdict == "inconclusive"
    one = {c.claim: c for c in mod.claims({"table1": [dense, moee]})}
    assert one["MoEE cuts MACs by 27% or more (Table 1)"].verdict == "inconclusive"  # one value
    assert "one mean: no interval" in one["MoEE cuts MACs by 27% or more (Table 1)"].evidence
    means = {c.claim: c for c in mod.claims({"table1": [dense, moee, moef]})}  # no seeds
    for claim in ("MoEE beats MoEfication (param) at equal MACs after KD (Table 1)",
                  "MoEE routes more evenly than MoEfication (param) (Sec. 5, Fig. 2)"):
        assert means[claim].verdict == "inconclusive", claim  # one pair of means
        assert "wins 1/1 means, one mean: no interval" in means[claim].evidence


VARIANCE = "Variance selection beats magnitude selection after KD (Sec. 5.2)"
HDBSCAN_RETAINS = "HDBSCAN beats DBSCAN and k-means right after extraction (Sec. 5.1)"
NOT_TUNED = "the ablations were not fine-tuned (finetune_ablations=false)"


def test_selection_and_clustering_ablations_are_judged_where_macs_cannot_explain_them():
    """Sec. 5.1-5.2 in a run that did not fine-tune the ablations: HDBSCAN against every
    other clustering the run tried (named in the claim) on the accuracy retained right after
    extraction, paired per seed, each at equal MACs or where unequal MACs worked against the
    verdict; variance against magnitude selection, which Sec. 5 compares after fine-tuning,
    inconclusive whatever the numbers before it (shown in the evidence)."""
    moee = {"model": "MoEE", "MACs_change_%": -27.5, "params_change_%": -10.0,
            "kd_vs_dense_%": 99.0, "acc_extracted": 0.8, "acc_after_kd": 0.9}
    rows = [{"model": "magnitude selection", "MACs_change_%": -28.0, "accuracy": 0.7},
            {"model": "DBSCAN", "MACs_change_%": -27.0, "accuracy": 0.75},
            {"model": "k-means (HDBSCAN's count)", "MACs_change_%": -26.0, "accuracy": 0.7}]
    per1 = [{"model": "MoEE", "seed": s, "accuracy": 0.8 + 0.01 * (s % 2),
             "MACs_change_%": -27.5} for s in range(4)]
    per2 = [{"model": r["model"], "seed": s, "accuracy": r["accuracy"]}
            for r in rows for s in range(4)]

    def got(ablations):
        return {c.claim: c for c in mod.claims({
            "table1": [moee], "table1_per_seed": per1, "table2_ablations": ablations,
            "table2_per_seed": per2})}

    c = got(rows)
    variance = c[VARIANCE]
    assert variance.verdict == "inconclusive" and NOT_TUNED in variance.evidence
    assert "MoEE - magnitude selection: 0.1050" in variance.evidence  # it led before KD
    hdb = c[HDBSCAN_RETAINS]
    assert hdb.verdict == "holds" and "MACs -27.5% vs -26.0%" in hdb.evidence
    # unequal MACs: a verdict stands only where the MACs worked against it
    km = HDBSCAN_RETAINS
    for macs, acc, verdict in ((-20.0, 0.7, "holds"),           # MoEE wins with fewer MACs
                               (-20.0, 0.9, "inconclusive"),    # loses with fewer
                               (-35.0, 0.9, "does not hold"),   # loses with more
                               (-35.0, 0.7, "inconclusive")):   # wins with more
        per2[8:] = [{**r, "accuracy": acc} for r in per2[8:]]
        hdb = got([rows[0], rows[1], {**rows[2], "MACs_change_%": macs}])[km]
        assert hdb.verdict == verdict, (macs, acc, hdb)
        assert f"MoEE -27.5% vs k-means (HDBSCAN's count) {macs:+.1f}%" in hdb.evidence
        assert ("the difference may be the MACs'" in hdb.evidence) == (verdict == "inconclusive")
    better = [{**rows[0], "accuracy": 0.9}, *rows[1:]]
    per2[:4] = [{**r, "accuracy": 0.9} for r in per2[:4]]
    trails = got(better)[VARIANCE]  # behind before KD: still not the paper's comparison
    assert trails.verdict == "inconclusive" and NOT_TUNED in trails.evidence


def test_fine_tuned_ablations_are_judged_after_kd_as_the_paper_evaluates_them():
    """Sec. 5: the ablated models are evaluated "after the previously described fine-tuning".
    Where the run fine-tuned them, Table 2's and Sec. 5.2's claims are judged on the accuracy
    after KD (here MoEE leads right after extraction and trails after KD: does not hold), and
    Sec. 5.1's on both ("accuracy retention as well as final accuracy")."""
    moee = {"model": "MoEE", "MACs_change_%": -27.5, "params_change_%": -10.0,
            "kd_vs_dense_%": 99.0, "acc_extracted": 0.8, "acc_after_kd": 0.9}
    names = ("random clusters + random neurons + random routing", "magnitude selection",
             "DBSCAN")
    rows = [{"model": m, "MACs_change_%": -27.0, "accuracy": 0.7, "accuracy_after_kd": 0.95}
            for m in names]
    per1 = [{"model": "MoEE", "seed": s, "accuracy": 0.8 + 0.01 * (s % 2),
             "accuracy_after_kd": 0.9 + 0.01 * (s % 2), "MACs_change_%": -27.5}
            for s in range(4)]
    per2 = [{"model": m, "seed": s, "accuracy": 0.7, "accuracy_after_kd": 0.95}
            for m in names for s in range(4)]

    def got(per2):
        return {c.claim: c for c in mod.claims({"table1": [moee], "table1_per_seed": per1,
                                                "table2_ablations": rows,
                                                "table2_per_seed": per2})}

    c = got(per2)
    table2 = c[f"MoEE beats {names[0]} after KD (Table 2)"]
    assert table2.verdict == "does not hold" and "MoEE - " in table2.evidence
    assert c["Variance selection beats magnitude selection after KD (Sec. 5.2)"].verdict == \
        "does not hold"
    sec51 = c["HDBSCAN beats DBSCAN right after extraction and after KD (Sec. 5.1)"]
    assert sec51.verdict == "does not hold"  # it leads in retention, trails in final accuracy
    assert "DBSCAN right after extraction: " in sec51.evidence
    assert "DBSCAN after KD: " in sec51.evidence
    ahead = [{**r, "accuracy_after_kd": 0.85} for r in per2]  # MoEE ahead both times
    assert {k: v.verdict for k, v in got(ahead).items() if "after KD" in k} == {
        f"MoEE beats {names[0]} after KD (Table 2)": "holds",
        "Variance selection beats magnitude selection after KD (Sec. 5.2)": "holds",
        "HDBSCAN beats DBSCAN right after extraction and after KD (Sec. 5.1)": "holds"}


def test_moefication_claim_is_paired_per_seed_with_an_interval():
    """Per-seed differences -0.003, -0.001, -0.009 against the MLP router: the interval
    spans zero, so inconclusive (the unpaired means read 'does not hold'); a consistent win
    holds."""
    moee = {"model": "MoEE", "MACs_change_%": -27.5, "params_change_%": -10.0,
            "kd_vs_dense_%": 99.0, "acc_extracted": 0.8, "acc_after_kd": 0.900}
    mlp = {"model": "MoEfication (mlp router)", "MACs_change_%": -27.0, "acc_after_kd": 0.904}

    def per_seed(diffs):
        rows = []
        for s, d in enumerate(diffs):
            rows += [{"model": "MoEE", "seed": s, "accuracy_after_kd": 0.9 + d, "accuracy": 0.8},
                     {"model": mlp["model"], "seed": s, "accuracy_after_kd": 0.9}]
        return rows

    def verdict(diffs):
        got = mod.claims({"table1": [moee, mlp], "table1_per_seed": per_seed(diffs)})
        return next(c for c in got if "mlp router) at equal" in c.claim)

    c = verdict([-0.003, -0.001, -0.009])
    assert c.verdict == "inconclusive" and "95% CI" in c.evidence
    assert verdict([0.010, 0.012, 0.011]).verdict == "holds"
    assert verdict([-0.010, -0.012, -0.011]).verdict == "does not hold"


def test_parameter_claim_is_judged_without_the_embedding_table():
    """MiniLM: -14.0% of the whole model, -29.7% without its word embeddings: the claim
    (the paper's ViTs have no large embedding table) reads holds, the whole-model cut beside."""
    moee = {"model": "MoEE", "MACs_change_%": -44.0, "params_change_%": -14.0,
            "kd_vs_dense_%": 99.0, "acc_extracted": 0.8, "acc_after_kd": 0.9}
    split = [{"layer": name, "removed_%": v + 0.1 * s, "seed": s} for s in range(3)
             for name, v in (("whole model", 14.0), ("without embeddings", 29.7),
                             ("FFNs only", 44.6))]
    got = {c.claim: c for c in mod.claims({"table1": [moee], "params_per_layer": split})}
    c = next(v for k, v in got.items() if "non-embedding parameters" in k)
    assert c.holds is True and "removed without embeddings 29.8 (mean of 3)" in c.evidence
    assert "whole model 14.1% removed" in c.evidence
    low = [dict(r, **{"removed_%": 9.4}) if r["layer"] == "without embeddings" else r
           for r in split]
    got = mod.claims({"table1": [moee], "params_per_layer": low})
    assert next(c for c in got if "non-embedding" in c.claim).holds is False


def test_later_layers_claim_compares_halves_of_equal_size_in_layer_order():
    """Sec. 4's "later layers form more clusters": later half minus earlier half, over the
    seeds. An odd layer count leaves its middle layer out (so equal counts read 0, never a
    spurious rise); the fallback on one seed's layer rows orders them by number (layer 10
    after layer 9)."""
    moee = {"model": "MoEE", "MACs_change_%": -27.5, "params_change_%": -10.0,
            "kd_vs_dense_%": 99.0, "acc_extracted": 0.8, "acc_after_kd": 0.9}

    def later(experts_by_seed):
        per = [{"model": "MoEE", "seed": s, "experts": e} for s, e in enumerate(experts_by_seed)]
        got = mod.claims({"table1": [moee], "table1_per_seed": per})
        return next(c for c in got if c.claim.startswith("Later layers"))

    flat = later(["3/3/3", "4/4/4", "2/2/2"])  # the old split read +3, +4, +2: "holds"
    assert flat.verdict == "does not hold" and "+0.0 (mean of 3)" in flat.evidence
    assert later(["2/9/5", "2/9/6", "2/9/7"]).verdict == "holds"
    assert later(["6/1/5", "7/1/5", "6/1/4"]).verdict == "does not hold"
    # one seed's layer rows, layers 0..11: more experts in layers 6..11, listed out of order
    layers = [{"model": "MoEE", "layer": i, "experts": 1 + (i >= 6) * 5} for i in range(12)]
    rows = sorted(layers, key=lambda r: str(r["layer"]))
    got = mod.claims({"table1": [moee], "experts_per_layer": rows})
    c = next(c for c in got if c.claim.startswith("Later layers"))
    assert "+30.0 (mean of 1)" in c.evidence and c.verdict == "inconclusive"


def test_the_recipe_note_says_which_extraction_and_kd_ran():
    """The note names the KD fine-tune's optimizer and schedule as configured (an SGD run is
    not called AdamW), calls the extraction the paper's recipe only with the paper's minimum
    cluster size and extraction percentage, naming any it changes, and says whether the
    ablations were fine-tuned."""
    from types import SimpleNamespace

    data = SimpleNamespace(substrate="vit_mnist5k", test={"labels": [0] * 4},
                           record_rows=lambda rows: min(rows, 600))
    cfg = make_config("quick")
    note = _recipe_note(cfg, data, {"accuracy": 0.9}, [2, 3])
    assert "cosine routing to cluster mean inputs (the paper's recipe)" in note
    assert "4000 recorded tokens of 600 training rows" in note
    assert "KD: 150 steps of AdamW (weight decay 0.01), lr 0.0005, cosine schedule" in note
    other = cfg.replace(kd=cfg.kd.replace(optimizer="sgd", weight_decay=0.0, schedule="linear"),
                        extract=cfg.extract.replace(p=0.5))
    note = _recipe_note(other, data, {"accuracy": 0.9}, [2, 3])
    assert "KD: 150 steps of SGD, lr 0.0005, linear schedule" in note and "AdamW" not in note
    assert ("(the paper's recipe but for its extraction percentage p 0.5 (the paper's: 0.8))"
            in note)
    # whether the ablations were fine-tuned before the comparison, as Sec. 5 does
    assert note.endswith("The ablations get the same KD before they are compared (Sec. 5).")
    plain = _recipe_note(cfg.replace(finetune_ablations=False), data, {"accuracy": 0.9}, [2])
    assert plain.endswith("The ablations are not fine-tuned (finetune_ablations=false; Sec. 5 "
                          "compares them after the KD).")
    assert "ablations" not in _recipe_note(cfg.replace(ablations=()), data, {"accuracy": 0.9},
                                           [2])
