"""BlockFFN experiment modules: presets build and validate, overrides work, and the active-set
extraction used for the baselines' metrics (TopK / DSMoE expert ids -> [B, T, N])."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import study_module
from experiments.blockffn import ablations, granularity
from experiments.blockffn import baselines as mod
from experiments.blockffn.baselines import paired_gaps
from experiments.blockffn.common import blockffn_changes
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.evaluate import SparsityEvaluator
from moejax.harness.claims import SEED_TABLES
from moejax.harness.experiment import run_experiment
from moejax.nn.decoder import DecoderLM
from moejax.nn.grin import GRINConfig
from moejax.ops.losses import cross_entropy
from moejax.pytree import count_params
from moejax.sparse_lm import SparseLMConfig, active_sets, decoder_of

MODULES = ["blockffn_baselines", "blockffn_ablations", "blockffn_granularity"]


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("preset", ["quick", "full"])
def test_presets_build(name, preset):
    mod = study_module(name)
    cfg = mod.make_config(preset)
    cfg2 = apply_overrides(cfg, ["train.steps=3", "train.warmup_steps=1", "model.al_coef=0.001"])
    assert cfg2.train.steps == 3 and cfg2.model.al_coef == 0.001
    with pytest.raises(ConfigError, match="model.arch"):
        apply_overrides(cfg, ["model.arch=gshard"])


@pytest.mark.parametrize("name,override,words", [
    ("blockffn_baselines", "model.top_k=4", "it sets k = round"),
    ("blockffn_baselines", "model.n_shared=2", "DSMoE has one shared expert"),
    ("blockffn_baselines", "model.d_model=96", "it takes small_d_model"),
    ("blockffn_granularity", "model.n_experts=32", "it takes N from its own n_experts"),
    ("blockffn_granularity", "model.d_expert=8", "d_expert = ffn_width / N"),
    ("blockffn_ablations", "model.top_k=3", r"no model it trains \(blockffn\) reads it"),
    ("blockffn_ablations", "model.remoe_lam0=0.01", "leave it at its default, 0.0001"),
    # each ablation setting sets its own objective: model.use_cs=false ran AL and labelled
    # it AL+CS; model.l1_coef added L1 to every setting
    ("blockffn_ablations", "model.use_cs=false", "each setting turns CS on or off"),
    ("blockffn_ablations", "model.rmsnorm=false", r"but 'AL\+CS, no RMSNorm'"),
    ("blockffn_ablations", "model.l1_coef=0.1", r"AL\+L1 alone takes the study's own"),
    ("blockffn_ablations", "model.entropy_coef=0.1", r"AL\+Ent alone takes the study's own"),
    ("blockffn_ablations", "model.al_coef=0", "leaves AL out of every setting"),
    ("bench_speculative", "target.grin_eps=0.1", "=0.1 is not read by a blockffn model"),
    ("bench_speculative", "draft.n_shared=2", "=2 is not read by a dense model"),
])
def test_a_model_setting_no_model_of_the_study_reads_is_refused(name, override, words):
    """A model field the study never reads, or sets itself, is refused: it was taken, and
    the run's recorded config named a setting that did not run (blockffn_baselines'
    model.top_k=4 trained TopK at its TLS-matched k). What its models read is taken."""
    cfg = study_module(name).make_config("quick")
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}.*{words}"):
        apply_overrides(cfg, [override])
    read = {"blockffn_baselines": ["model.remoe_lam0=0.01", "model.grin_eps=0.1"],
            "blockffn_granularity": ["model.alpha=3.0"], "blockffn_ablations": ["model.n_st=7"],
            "bench_speculative": ["draft.arch=topk", "draft.top_k=3"]}[name]
    apply_overrides(cfg, read)


def test_active_sets_topk_and_dsmoe():
    ids = jnp.array([[[0, 2], [1, 2]]])  # [B=1, T=2, k=2] routed ids
    act, a = active_sets(SparseLMConfig(arch="topk", n_experts=4, top_k=2),
                         {"expert_ids": ids})
    np.testing.assert_array_equal(np.asarray(act), [[[1, 0, 1, 0], [0, 1, 1, 0]]])
    assert a is None
    act, _ = active_sets(SparseLMConfig(arch="dsmoe", n_experts=4, top_k=3, n_shared=1),
                         {"expert_ids": ids})
    # shared expert first (always on), then the 3 routed experts
    np.testing.assert_array_equal(np.asarray(act), [[[1, 1, 0, 1], [1, 0, 1, 1]]])
    act, _ = active_sets(SparseLMConfig(arch="grin", n_experts=4), {"expert_ids": ids})
    np.testing.assert_array_equal(np.asarray(act), [[[1, 0, 1, 0], [0, 1, 1, 0]]])
    assert active_sets(SparseLMConfig(arch="dense"), {}) == (None, None)


@pytest.mark.parametrize("arch", ["blockffn", "remoe", "topk", "dense"])
def test_every_architecture_decodes_as_its_decoder(arch):
    """decoder_of gives the DecoderLM of a built model of any architecture: BlockFFN and
    ReMoE train wrapped in their coefficient schedule, the others are their decoder."""
    spec = SparseLMConfig(arch=arch, d_model=16, n_experts=4, d_expert=8, max_seq_len=16)
    model = spec.build(0)
    lm = decoder_of(model)
    assert isinstance(lm, DecoderLM) and (lm is model) == (arch in ("topk", "dense"))
    assert lm.cfg.vocab_size == 256


def test_grin_slot():
    slot = SparseLMConfig(arch="grin", n_experts=8, d_expert=4, grin_eps=0.1).slot()
    assert isinstance(slot, GRINConfig)
    m = slot.moe
    assert (m.n_experts, m.top_k, m.d_expert, slot.jitter_eps) == (8, 2, 4, 0.1)
    assert m.activation == "swish" and m.dispatch == "dense" and not m.renormalize


def test_sparsity_evaluator_matches_direct_computation():
    """val_ce is the mean cross-entropy over the scored tokens and TLS the fraction of
    inactive (token, expert) pairs over the real tokens (a padded tail left out), pooled over
    the batches per layer and averaged over the layers, both recomputed here from the model's
    own outputs; a dense FFN reports no sparsity metrics."""
    import functools

    rng = np.random.default_rng(0)
    batches = [{"inputs": rng.integers(0, 256, (2, 16)).astype(np.int32),
                "targets": rng.integers(0, 256, (2, 16)).astype(np.int32),
                "mask": np.ones((2, 16), np.float32)} for _ in range(2)]
    batches[1]["mask"][1, 11:] = 0.0  # a padded tail: scored nowhere
    for arch in ("topk", "blockffn", "dense"):
        spec = SparseLMConfig(arch=arch, d_model=16, n_layers=2, n_heads=2, n_experts=4,
                              d_expert=8, chunk_len=8, max_seq_len=32)
        model = spec.build(0)
        ev = SparsityEvaluator(batches, chunk_lens=(2, 8),
                               active_fn=functools.partial(active_sets, spec))(model)
        nll = scored = 0.0
        inactive = np.zeros(spec.n_layers)  # per layer: inactive pairs, real tokens
        real = 0.0
        forward = nnx.jit(lambda m, x: m(x, train=False))  # whole, not op by op
        for b in batches:
            logits, aux = forward(model, jnp.asarray(b["inputs"]))
            n = b["mask"].sum()
            nll += float(cross_entropy(logits, b["targets"], b["mask"])) * n
            scored += n
            real += n
            for i, la in enumerate(aux["layers"]):
                act, _ = active_sets(spec, la)
                if act is not None:
                    act = np.asarray(act)[b["mask"] > 0]
                    inactive[i] += (1.0 - act.mean(-1)).sum()
        np.testing.assert_allclose(ev["val_ce"], nll / scored, rtol=1e-5)
        np.testing.assert_allclose(ev["val_ppl"], np.exp(nll / scored), rtol=1e-5)
        if arch == "dense":
            assert "tls" not in ev and ev["layers"] == {}
        else:
            np.testing.assert_allclose(ev["tls"], np.mean(inactive / real), rtol=1e-5)
            if arch == "topk":
                np.testing.assert_allclose(ev["tls"], 1 - 2 / 4, rtol=1e-6)
            assert set(ev["layers"]) == {0, 1} and "cls_8" in ev


def test_baselines_match_blockffn_active_experts():
    """Every baseline keeps BlockFFN's experts (count and width) and attention; the top-k
    models activate round(N (1 - TLS)) experts, ReMoE targets the same TLS; the sizes build
    the parameter counts they claim (xl >= 5M)."""
    cfg = apply_overrides(mod.make_config("quick"), ["sizes=(small,xl)"])
    base = cfg.size_spec("small")
    specs = mod.baselines(base, tls=0.82)
    N = base.n_experts
    assert specs["TopK"][0].top_k == round(N * 0.18) == specs["TopK"][1] == 3
    assert specs["DSMoE"][0].top_k == 3 and specs["DSMoE"][0].n_always_on == 1
    assert specs["ReMoE"][0].target_tls == 0.82
    np.testing.assert_allclose(specs["ReMoE"][1], N * 0.18)
    assert specs["GRIN"][1] == 3 == specs["GRIN"][0].top_k and specs["Dense"][1] == N
    assert mod.baselines(base, tls=0.82, grin_k="two")["GRIN"][0].top_k == 2
    assert specs["GRIN"][0].slot().moe.top_k == 3  # the slot really routes to 3 experts
    for spec, _ in specs.values():
        assert (spec.d_model, spec.d_expert, spec.n_experts, spec.n_layers, spec.n_heads) == (
            base.d_model, base.d_expert, N, base.n_layers, base.n_heads)
    assert mod.baselines(base, tls=0.99)["TopK"][1] == 2  # never fewer than two
    xl = cfg.size_spec("xl")
    assert count_params(xl.replace(arch="topk").build(0)) > 5_000_000
    with pytest.raises(ConfigError, match="sizes"):
        apply_overrides(cfg, ["sizes=(small,small)"])
    with pytest.raises(ConfigError, match="sizes"):
        apply_overrides(cfg, ["sizes=(huge,)"])


def test_paired_gaps():
    rows = [{"size": "s", "seed": s, "model": m, "val_ppl": v}
            for s, (bf, tk) in enumerate([(10.0, 11.0), (12.0, 11.5), (9.0, 10.0)])
            for m, v in (("BlockFFN", bf), ("TopK", tk))]
    (g,) = paired_gaps(rows, ["s"])
    assert g["model"] == "TopK" and g["BlockFFN wins"] == 2 and g["n_seeds"] == 3
    d = np.array([-1.0, 0.5, -1.0])
    np.testing.assert_allclose([g["dPPL"], g["dPPL std"]], [d.mean(), d.std(ddof=1)])


def test_baselines_run_with_a_subset_of_models(tmp_path):
    """``models`` picks the baselines trained beside BlockFFN; without Dense the PPL bars have
    no dense line and every table is still written."""
    import csv

    summary, run = run_experiment(
        mod.STUDY.name, mod.make_config, mod.run,
        ["sizes=(small,)", "small_d_model=16", "small_d_expert=8", "model.n_experts=4",
         "model.n_heads=2", "model.n_layers=1", "train.steps=2", "train.warmup_steps=1",
         "train.batch_size=2",
         "seq_len=16", "eval_batches=1", "seeds=1", "models=(TopK,)", "model.use_cs=false"],
        claims=mod.claims, out=tmp_path / "b")
    # the summary says which BlockFFN ran beside its verdicts
    assert "the CS loss False (the paper's: True)" in (run.path / "summary.md").read_text()
    rows = list(csv.DictReader(open(run.path / "baselines_per_seed.csv")))
    assert [r["model"] for r in rows] == ["BlockFFN", "TopK"]
    gaps = list(csv.DictReader(open(run.path / "blockffn_minus_baseline.csv")))
    assert [g["model"] for g in gaps] == ["TopK"]
    assert (run.path / "ppl_small.png").exists()
    with pytest.raises(ConfigError, match="models"):
        apply_overrides(mod.make_config("quick"), ["models=(TopK,TopK)"])


def test_a_blockffn_study_names_each_setting_changed_from_the_papers():
    """A BlockFFN without CS, or with another AL sharpness, is named as such in the summary
    (each was labelled BlockFFN, its objective unstated); the paper's is named by nothing, and
    an ablation's own switches are left to its settings."""
    assert blockffn_changes(SparseLMConfig()) == ""
    note = blockffn_changes(SparseLMConfig(use_cs=False, alpha=10.0))
    assert note == ("BlockFFN here differs from the paper's in AL's sharpness alpha 10.0 (the "
                    "paper's: 100.0); the CS loss False (the paper's: True).")
    quick = mod.make_config("quick").model  # the CPU scale's shorter chunks and schedule
    assert "CS's chunk length 16 (the paper's: 64)" in blockffn_changes(quick)
    cfg = ablations.make_config("quick")
    assert "router RMSNorm" not in blockffn_changes(cfg.model.replace(rmsnorm=False),
                                                    cfg.MODEL_SET_HERE)


def test_baselines_claims_pair_blockffn_with_every_other_moe_per_seed():
    def rows(ppl_other_offset, cls_other_offset, remoe_tls_gap=0.0):
        out = []
        for seed in range(5):
            noise = 0.05 * ((seed * 7) % 5 - 2)
            # N = 16 experts, 3.2 active: close TLS is within half an expert, 1/32
            out.append({"seed": seed, "size": "S", "model": "BlockFFN", "val_ppl": 10 + noise,
                        "CLS_8": 0.5 + noise / 10, "TLS": 0.8, "active_experts": 3.2,
                        "TLS - TLS_BlockFFN": 0.0})
            for i, m in enumerate(("TopK", "ReMoE")):
                remoe = (remoe_tls_gap[seed] if isinstance(remoe_tls_gap, tuple)
                         else remoe_tls_gap)  # a gap per seed, or one for all
                gap = (0.0, remoe)[i]
                out.append({"seed": seed, "size": "S", "model": m,
                            "val_ppl": 10 + noise + ppl_other_offset * (i + 1),
                            "CLS_8": 0.5 + noise / 10 + cls_other_offset * (i + 1),
                            "TLS": 0.8 + gap, "TLS - TLS_BlockFFN": gap})
            out.append({"seed": seed, "size": "S", "model": "Dense", "val_ppl": 1.0,
                        "CLS_8": 0.0})  # the dense model is not an MoE: not compared
        return {"baselines_per_seed": out}

    ppl, cls = mod.claims(rows(0.5, -0.1))[:2]
    assert ppl.holds is True and cls.holds is True and "wins 5/5" in ppl.evidence
    ppl, cls = mod.claims(rows(-0.5, 0.1))[:2]           # every other MoE is better
    assert ppl.holds is False and cls.holds is False
    ppl, _ = mod.claims(rows(0.0, -0.1))[:2]             # tied with both in every seed
    assert ppl.verdict == "does not hold" and "equal in every seed" in ppl.evidence

    # close TLS (Table 2): a gap over half an expert voids a verdict it could explain
    ppl, cls = mod.claims(rows(0.5, -0.1, remoe_tls_gap=0.03))[:2]  # within 1/32: stands
    assert ppl.holds is True and cls.holds is True
    # the gap is the mean over the seeds: 0.1 in one of five is 0.02 on average, close
    ppl, _ = mod.claims(rows(0.5, -0.1, remoe_tls_gap=(0.0, 0.0, 0.0, 0.0, 0.1)))[:2]
    assert ppl.holds is True
    ppl, cls = mod.claims(rows(0.5, -0.1, remoe_tls_gap=0.05))[:2]  # ReMoE sparser, BlockFFN wins
    assert ppl.verdict == "inconclusive" and "not close" in ppl.evidence
    assert cls.holds is True  # a sparser ReMoE with the lower CLS: the gap runs against it
    ppl, cls = mod.claims(rows(0.5, -0.1, remoe_tls_gap=-0.05))[:2]  # ReMoE denser, BlockFFN wins
    assert ppl.holds is True and cls.verdict == "inconclusive"
    ppl, cls = mod.claims(rows(-0.5, 0.1, remoe_tls_gap=-0.05))[:2]  # a denser ReMoE has lower PPL
    assert ppl.holds is False  # TopK, at the same TLS, beats BlockFFN too
    remoe_only = rows(-0.5, 0.1, remoe_tls_gap=-0.05)
    remoe_only["baselines_per_seed"] = [r for r in remoe_only["baselines_per_seed"]
                                        if r["model"] != "TopK"]
    ppl, cls = mod.claims(remoe_only)[:2]  # only a denser ReMoE beats it: on PPL, says nothing
    assert ppl.verdict == "inconclusive" and cls.holds is False
    no_tls = rows(0.5, -0.1)
    for r in no_tls["baselines_per_seed"]:
        r.pop("TLS - TLS_BlockFFN", None)
    assert [c.verdict for c in mod.claims(no_tls)[:2]] == ["inconclusive"] * 2


def test_baselines_judge_blockffns_own_sparsity_against_the_papers_levels():
    """Over 80% TLS and over 70% CLS_8 (the abstract), both over the seed runs: holds when
    both intervals lie above, does not hold when one lies below, else inconclusive."""
    def verdict(tls, cls, spread=0.005):
        rows = [{"seed": s, "size": "S", "model": m, "val_ppl": 10.0, "TLS": tls + e,
                 "CLS_8": cls + e, "active_experts": 3.2, "TLS - TLS_BlockFFN": 0.0}
                for s, e in enumerate((0.0, spread, -spread, spread / 2, 0.0))
                for m in ("BlockFFN", "TopK")]
        return mod.claims({"baselines_per_seed": rows})[2]

    c = verdict(0.85, 0.75)
    assert c.verdict == "holds" and c.claim.startswith("BlockFFN reaches over 80% TLS")
    assert "TLS 0.850" in c.evidence and "CLS_8 0.750" in c.evidence
    assert verdict(0.85, 0.6).verdict == "does not hold"   # CLS_8 well under 70%
    assert verdict(0.7, 0.75).verdict == "does not hold"   # TLS well under 80%
    assert verdict(0.85, 0.705, spread=0.05).verdict == "inconclusive"


def test_baselines_judge_blockffns_expert_reuse_against_the_papers_level():
    """Sec. 4.1.2 (Table 4): BlockFFN's reuse ratio over 85%, over the seed runs: holds when
    its interval lies above, does not hold when below, inconclusive when it spans 0.85, and
    not measured where a seed run did not record it."""
    def verdict(reuse, spread=0.005, missing=False):
        rows = [{"seed": s, "size": "S", "model": m, "val_ppl": 10.0, "TLS": 0.85,
                 "CLS_8": 0.75, "reuse": reuse + e, "active_experts": 3.2,
                 "TLS - TLS_BlockFFN": 0.0}
                for s, e in enumerate((0.0, spread, -spread, spread / 2, 0.0))
                for m in ("BlockFFN", "TopK")]
        if missing:
            rows[0].pop("reuse")
        return mod.claims({"baselines_per_seed": rows})[3]

    c = verdict(0.9)
    assert c.verdict == "holds" and "Table 4" in c.claim and "(S;" in c.claim
    assert c.evidence.startswith("reuse ratio 0.901 (mean of 5) vs 0.85")
    assert verdict(0.8).verdict == "does not hold"
    assert verdict(0.86, spread=0.05).verdict == "inconclusive"
    assert verdict(0.9, missing=True).verdict == "not measured"


def test_ablation_claims_count_only_at_close_tls():
    """Table 5 sets two objectives apart only at close TLS (half an expert, 1/32 at N = 16):
    AL+L1 far sparser than AL+CS leaves AL+CS's lower PPL unexplained by the objective
    (inconclusive), while a sparser AL+L1 that still wins PPL, or a denser one that loses,
    stands; CLS the other way round (a denser AL+L1 explains AL+CS's higher CLS); no TLS
    recorded: unchecked. AL+CS against AL alone needs no such check; against CS alone (AL
    removed) it does."""
    def verdicts(d_ppl, l1_tls, n_experts=16, tls=True, l1_cls=0.5, ent_cls=0.5,
                 drop_tls_at=None):
        def row(model, ppl, t, cls=0.5):
            r = {"model": model, "val_ppl": ppl, "CLS_8": cls}
            return {**r, "TLS": t, "n_experts": n_experts} if tls else r

        runs = [{"objectives": [row("AL+CS", 10.0, 0.80, 0.7),
                                row("AL+L1", 10 + d_ppl + i / 100, l1_tls, l1_cls - i / 100),
                                row("AL+Ent", 10.0 + d_ppl + i / 100, 0.80, ent_cls - i / 100),
                                row("AL", 10.0, 0.5, 0.3),
                                row("CS", 10.0 + d_ppl + i / 100, 0.80, 0.5 - i / 100)],
                 "rmsnorm": [{**row("AL+CS", 10.0, 0.80), "act_magnitude": 4.0},
                             {**row("AL+CS, no RMSNorm", 10.0 + d_ppl + i / 100, 0.80),
                              "act_magnitude": 4.0 + d_ppl + i / 100}]}
                for i in range(5)]
        if drop_tls_at is not None:  # one seed run did not record its TLS
            for r in runs[drop_tls_at]["objectives"]:
                r.pop("TLS")
        got = ablations.claims({**runs[0], SEED_TABLES: runs})
        return [c.verdict for c in got], got

    assert verdicts(1.0, 0.81)[0] == ["holds"] * 8  # AL+L1 0.01 sparser: close
    assert verdicts(-1.0, 0.81)[0][5] == "does not hold"  # CS alone has the lower PPL
    assert verdicts(-1.0, 0.81)[0][7] == "does not hold"  # no RMSNorm: magnitudes fall
    v, got = verdicts(1.0, 0.90)  # AL+L1 0.10 sparser: its higher PPL may be its sparsity
    assert v == ["inconclusive"] + ["holds"] * 7
    assert "not close" in got[0].evidence and "AL+CS's" in got[0].evidence
    assert verdicts(-1.0, 0.90)[0][0] == "does not hold"  # sparser and still better: stands
    assert verdicts(1.0, 0.70)[0][0] == "holds"  # denser and worse: stands
    v, got = verdicts(-1.0, 0.70)  # denser and better PPL: explained; and so is its lower CLS
    assert v[:3] == ["inconclusive", "does not hold", "inconclusive"]
    assert verdicts(1.0, 0.70, l1_cls=0.9)[0][2] == "does not hold"  # denser, higher CLS
    assert verdicts(1.0, 0.90, n_experts=4)[0][0] == "holds"  # half an expert of 4: 0.125
    assert verdicts(1.0, 0.85)[0][0] == "inconclusive"  # 0.05: over half an expert of 16
    assert verdicts(1.0, 0.70, ent_cls=0.9)[0][2] == "does not hold"  # AL+Ent: higher CLS
    v, got = verdicts(1.0, 0.81, drop_tls_at=3)  # a seed run's TLS missing: unchecked
    assert v[0] == "inconclusive" and "close TLS unchecked" in got[0].evidence
    v, got = verdicts(1.0, 0.81, tls=False)  # no TLS recorded: the comparisons unchecked
    assert v == ["inconclusive"] * 3 + ["holds"] + ["inconclusive"] * 3 + ["holds"]
    assert "close TLS unchecked" in got[4].evidence and "close TLS unchecked" in got[6].evidence


def test_granularity_judges_where_sparsity_peaks():
    """App. F's non-monotonic sparsity: the middle N of the highest mean TLS must beat the
    coarsest and the finest N on TLS and CLS_8 in the paired seeds, at an interval widened for
    the best of the middle settings; sparsity rising to the finest N does not hold, and two
    sizes have no middle."""
    def peak(tls, cls=None, wobble=0.002):  # N=16's per-seed wobble
        runs = [{"granularity": [{"n_experts": n, "val_ppl": 10.0,
                                  "TLS": t + wobble * (-1) ** i * (n == 16), "CLS_8": c}
                                 for n, t, c in zip((4, 8, 16, 32), tls, cls or tls)]}
                for i in range(5)]
        got = granularity.claims({**runs[0], SEED_TABLES: runs})
        assert got[-1].claim == granularity.PEAK_CLAIM
        return got[-1]

    c = peak((0.70, 0.80, 0.83, 0.78))  # the quick preset's shape: N=16 peaks
    assert c.verdict == "holds", c.evidence
    assert c.evidence.startswith("N=16 (the best of 2 middle settings: Bonferroni)")
    assert "97.5% CI" in c.evidence  # 1 - 0.05 / 2
    assert peak((0.70, 0.75, 0.80, 0.85)).verdict == "does not hold"  # densest to sparsest
    # TLS peaks in the middle, CLS_8 falls all the way: not both
    assert peak((0.70, 0.80, 0.83, 0.78), (0.8, 0.7, 0.6, 0.5)).verdict == "does not hold"
    assert peak((0.70, 0.80, 0.83, 0.829), wobble=0.01).verdict == "inconclusive"
    two = granularity.claims({"granularity": [
        {"n_experts": n, "val_ppl": 10.0, "TLS": 0.8, "CLS_8": 0.6} for n in (8, 32)]})
    assert two[-1].verdict == "not measured" and "no setting between" in two[-1].evidence
