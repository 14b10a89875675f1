"""The experiment modules run end to end on tiny settings and write their reports."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import main as main_job
from experiments import study_module
from moejax.bench.moe_block import TORCH
from moejax.config import Config, ConfigError, from_json, to_json
from moejax.config_overrides import apply_overrides
from moejax.harness.experiment import run_experiment

TINY_LM = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.moe.n_experts=4",
    "model.moe.d_expert=32",
    "model.d_hidden=64",
]


def test_lm_demo_tiny_writes_report_and_learns(tmp_path):
    from experiments import lm_demo

    summary, run = run_experiment(
        "lm_demo",
        lm_demo.make_config,
        lm_demo.run,
        TINY_LM
        + [
            "train.steps=12",
            "train.warmup_steps=2",
            "train.batch_size=4",
            "train.eval_every=6",
            "train.lr=1e-2",
            "seq_len=32",
            "eval_batches=2",
            "sample_tokens=4",
        ],
        out=tmp_path / "lm_demo",
    )
    # 12 steps of a tiny byte LM from uniform init (ln 256 = 5.55) must already help.
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.5
    for f in (
        "summary.md",
        "summary.csv",
        "router.md",
        "loss_curve.png",
        "config.json",
        "train/metrics.csv",
    ):
        assert (run.path / f).exists(), f
    cfg = json.loads((run.path / "config.json").read_text())
    assert cfg["train"]["steps"] == 12
    # the completion comes with what the loss means, measured against a uniform guess
    text = (run.path / "summary.md").read_text()
    assert (f"What 12 steps bought: validation loss {summary['val_loss_before']:.2f} -> "
            f"{summary['val_loss_after']:.2f} nats/byte (a uniform guess over bytes scores "
            "5.55)") in text
    assert text.index("What 12 steps bought") < text.index("```python")
    assert "(the quick preset's 300 and the full preset's 4000 steps go further)" in text


def test_lm_demo_names_only_the_presets_that_train_longer():
    """The note points to longer runs only where they are longer: the quick preset's own run
    is not told that the quick preset's 300 steps go further."""
    from experiments.lm_demo import _longer_runs

    assert _longer_runs(300) == " (the full preset's 4000 steps go further)"
    assert _longer_runs(4000) == ""


def test_bench_dispatch_checks_its_step_against_memory_before_it_runs(tmp_path, monkeypatch,
                                                                     capsys):
    """A benchmark's own timed step is compiled and its estimate compared with the device's
    memory before its first call (here the host is made 10 kB): exit 2 in one line, no row."""
    import moejax.train.budget as budget
    from experiments.benchmarks import dispatch as bench_dispatch
    from moejax.harness.experiment import main

    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**4, "this host's memory"))
    called = []
    monkeypatch.setattr(bench_dispatch, "_block_table", lambda *a: called.append(1))
    code = main("bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
                TINY_LM + ["batch_size=2", "seq_len=16", "warmup=1", "steps=2",
                           "paths=(capacity,)", f"out={tmp_path / 'bench'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not called
    assert "the capacity train step needs about" in err[-1] and "lower batch_size" in err[-1]
    assert not (tmp_path / "bench" / "dispatch.csv").exists()


def test_bench_dispatch_times_the_train_step_alone_on_each_attention(tmp_path):
    """``block_paths=()`` and ``delta_tree=none`` leave the train step alone, and
    ``attentions`` times each path on each attention in the one run (the GPU's comparison of
    the flash kernel with XLA's attention): a row each, the ratio of the steps in the
    headline; a machine that cannot time any path says so in the headline instead of
    failing."""
    import csv

    from experiments.benchmarks import dispatch as bench_dispatch

    tiny = TINY_LM + ["batch_size=2", "seq_len=16", "warmup=1", "steps=1", "block_paths=()",
                      "delta_tree=none", "attentions=(einsum,jax)"]
    summary, run = run_experiment("bench_dispatch", bench_dispatch.make_config,
                                  bench_dispatch.run, [*tiny, "paths=(capacity,)"],
                                  out=tmp_path / "one")
    assert sorted(p.name for p in run.path.glob("*.csv")) == ["dispatch.csv"]
    rows = list(csv.DictReader(open(run.path / "dispatch.csv")))
    assert [(r["path"], r["attention"]) for r in rows] == [("capacity", "einsum"),
                                                           ("capacity", "jax")]
    # the same model and batches on either attention: the same loss
    assert float(rows[0]["final_ce"]) == pytest.approx(float(rows[1]["final_ce"]), rel=1e-4)
    ratio = float(rows[1]["step_s_median"]) / float(rows[0]["step_s_median"])
    assert f"train step on jax / on einsum: capacity {ratio:.2f}" in (
        run.path / "summary.md").read_text()
    assert "matmul_gflops" not in summary and {"capacity_ms", "capacity_jax_ms"} <= set(summary)
    assert ", attention einsum, jax (auto: " in (run.path / "dispatch.md").read_text()
    _, run = run_experiment("bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
                            [*tiny, "paths=(gmm,)"], out=tmp_path / "none")
    if jax.default_backend() == "cpu":
        assert ("no train step timed here: gmm: not measured: needs a GPU (cpu runs Pallas in "
                "interpret mode)") in (run.path / "summary.md").read_text()


@pytest.mark.slow
def test_bench_dispatch_tiny_paths_agree(tmp_path, monkeypatch):
    from experiments.benchmarks import dispatch as bench_dispatch
    from moejax.bench import moe_block

    # the retained-memory columns run, without changing this worker's allocator
    monkeypatch.setattr(moe_block, "retain_freed_memory", lambda: True)

    summary, run = run_experiment(
        "bench_dispatch",
        bench_dispatch.make_config,
        bench_dispatch.run,
        TINY_LM
        + ["model.moe.capacity_factor=8.0", "batch_size=2", "seq_len=16", "warmup=1", "steps=2",
           "paths=(dense,capacity,host,host_capacity,gmm)", "block_tokens=64",
           "block_d=16", "block_f=32",
           "block_repeats=1", "block_paths=(capacity,)", "delta_tree=tiny"],
        out=tmp_path / "bench",
    )
    import csv

    block = {r["impl"]: r for r in csv.DictReader(open(run.path / "block.csv"))}
    assert {"capacity cf=1.25", "capacity cf=2.0"} <= set(block)
    assert "grouped (dropless)" not in block  # block_paths selects
    bound = next(r for k, r in block.items() if k.startswith("FLOP bound"))
    assert float(bound["vs_flop_bound"]) == 1.0
    assert all(float(r["ms"]) > 0 for k, r in block.items() if r["ms"])
    assert all(float(r["ms_retained"]) > 0 for k, r in block.items() if r["ms"])
    assert float(bound["vs_flop_bound_retained"]) == 1.0
    (torch_row,) = [r for k, r in block.items() if k.startswith(TORCH)]
    assert torch_row["ms"] or torch_row["note"].startswith("not installed")
    if torch_row["ms"]:  # the peer runs where jax runs, and its row says so
        assert torch_row["impl"].endswith(", on CPU)" if jax.default_backend() == "cpu"
                                          else ")")
    delta = {r["op"]: r for r in csv.DictReader(open(run.path / "delta_ops.csv"))}
    assert float(delta["jitted x * 2 (reference)"]["vs_x2"]) == 1.0
    assert {"DARE p=0.9 (hash masks)", "numpy copy (reference)",
            "WANDA p=0.9 (threshold select)"} <= set(delta)

    rows = list(csv.DictReader(open(run.path / "dispatch.csv")))
    assert [r["path"] for r in rows] == ["dense", "capacity", "host", "host_capacity", "gmm"]
    if jax.default_backend() == "cpu":  # the kernel is not timed in interpret mode
        assert rows.pop()["note"].startswith("not measured: needs a GPU")
    ce = [float(r["final_ce"]) for r in rows]
    # Same init, same data, no drops at capacity factor 8: the four paths train identically.
    assert max(ce) - min(ce) < 1e-3
    assert all(float(r["dropped_fraction"]) == 0.0 for r in rows)


def test_bench_kernels_tiny_rows_and_bounds(tmp_path):
    from experiments.blockffn import kernels as bench_kernels

    summary, run = run_experiment(
        "bench_kernels", bench_kernels.make_config, bench_kernels.run,
        ["ffn.d_model=16", "ffn.n_experts=8", "ffn.d_expert=8", "chunk_sizes=(1,4)",
         "union_fractions=(0.25,1.0)", "repeats=2", "bandwidth_mb=4"],
        out=tmp_path / "bk")
    import csv

    ffn = list(csv.DictReader(open(run.path / "ffn.csv")))
    assert len(ffn) == 2 * 2 * 8  # chunk sizes x fractions x paths
    floors = []
    for r in ffn:
        if r["path"] in ("pallas", "triton", "decode") and jax.default_backend() == "cpu":
            assert r["note"].startswith("not measured") and not r["ms"]
            continue
        dense = next(d for d in ffn if d["path"] == "dense" and d["n"] == r["n"]
                     and d["union"] == r["union"])
        bound = float(dense["ms"]) * int(r["union"]) / 8
        assert float(r["bound_ms"]) == pytest.approx(bound, rel=1e-6)
        assert float(r["x_bound"]) == pytest.approx(float(r["ms"]) / bound, rel=1e-6)
        read = 2 * int(r["union"]) * 16 * 8 * 4  # the union's up and down weights, f32
        floors.append(read / float(r["floor_ms"]))  # the one measured bandwidth, per row
        assert float(r["x_floor"]) == pytest.approx(float(r["ms"]) / float(r["floor_ms"]))
    assert max(floors) == pytest.approx(min(floors), rel=1e-6)
    assert (run.path / "ffn_n1.png").exists() and (run.path / "ffn_n4.png").exists()
    assert "chunk_union: within 1.3x" in (run.path / "summary.md").read_text()
    parts = list(csv.DictReader(open(run.path / "union_breakdown.csv")))
    assert {(r["n"], r["path"]) for r in parts} == {
        (n, p) for n in ("1", "4") for p in ("chunk_union", "chunk_union_gather")}
    for p in parts:  # the two factors multiply to the distance from the bound
        assert float(p["overhead"]) * float(p["dense_scaling"]) == pytest.approx(
            float(p["x_bound"]), rel=1e-6)
    with pytest.raises(ConfigError, match="union_fractions"):
        run_experiment("bench_kernels", bench_kernels.make_config, bench_kernels.run,
                       ["union_fractions=(0.0,)"], out=tmp_path / "bad")


def test_union_breakdown_splits_the_distance_to_the_bound():
    from experiments.blockffn.kernels import _breakdown_note, union_breakdown

    def row(path, u, ms, bound=None):
        r = {"n": 4, "union": u, "union_fraction": u / 8, "path": path, "ms": ms}
        if bound:
            r.update(bound_ms=bound, x_bound=ms / bound)
        return r

    # bound = dense 8 ms x |U| / 8: 2 ms at |U| = 2, 4 ms at |U| = 4
    rows = [row("dense", 2, 8.0, 2.0), row("dense_union", 2, 2.4, 2.0),
            row("chunk_union", 2, 4.8, 2.0), row("dense", 4, 8.0, 4.0),
            row("dense_union", 4, 5.6, 4.0), row("chunk_union", 4, 6.16, 4.0),
            {"n": 4, "union": 4, "path": "pallas", "note": "not measured"}]
    got = {r["union_fraction"]: r for r in union_breakdown(rows)}
    assert set(got) == {0.25, 0.5}
    assert got[0.25]["overhead"] == pytest.approx(2.0)         # 4.8 / 2.4
    assert got[0.25]["dense_scaling"] == pytest.approx(1.2)    # 2.4 / 2
    assert got[0.5]["overhead"] == pytest.approx(1.1)          # 6.16 / 5.6
    assert got[0.5]["dense_scaling"] == pytest.approx(1.4)
    note = _breakdown_note(list(got.values()))
    assert "in 2 cases" in note and "1 by its own overhead" in note
    assert "n=4 |U|/E=0.25 (2.40x = 2.00 x 1.20)" in note
    # chunk_union not timed (a GPU run of the kernel paths only): no verdict on it
    others = [p for p in got.values() if p["path"] != "chunk_union"]
    assert "no breakdown" in _breakdown_note(others)


def test_main_job_rejects_bad_arguments(capsys):
    assert main_job.main(["only=nope"]) == 2
    assert "not registered" in capsys.readouterr().err
    assert main_job.main(["only=lm_demo,lm_dmo,mo,moe"]) == 2  # misspellings: the near names
    assert ("only=['lm_dmo', 'mo', 'moe'] not registered (did you mean 'lm_demo' for 'lm_dmo', "
            "'moee' for 'moe'?); registered: lm_demo") in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"bad argument 'onl=moee' \(did you mean 'only' for "
                                          r"'onl'\?\); allowed keys"):
        main_job._parse(["onl=moee"])
    assert main_job.main(["preset=medium"]) == 2
    with pytest.raises(ConfigError):
        main_job._parse(["colour=red"])


def test_main_job_refuses_an_unusable_out_before_any_study(tmp_path, capsys):
    """out= naming a file, or a folder under one, is one line and exit 2, not a
    traceback."""
    a_file = tmp_path / "report"
    a_file.write_text("not a folder")
    for out in (a_file, a_file / "sub"):
        assert main_job.main([f"out={out}", "only=moee"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: out={out}: ") and "Fix: choose a writable" in err
        assert err.count("\n") == 1
    assert a_file.read_text() == "not a folder"


def test_registry_modules_expose_the_contract():

    for name in main_job.REGISTRY:
        mod = study_module(name)
        quick, full = mod.make_config("quick"), mod.make_config("full")
        for cfg in (quick, full):  # frozen, validated, and stored / read back exactly
            assert isinstance(cfg, Config) and from_json(to_json(cfg)) == cfg
        assert callable(mod.run)


def test_suites_demo_overrides_are_valid_and_studies_lists_the_registry():

    from moejax.harness.cli import parse_cli

    preset, _, jobs, suite = main_job._parse([])
    assert suite == "demo" and preset == "quick"
    assert [n for n, _ in jobs] == [n for n, _ in main_job.DEMO]
    for name, overrides in jobs:  # every override of the tour parses against its config
        mod = study_module(name)
        parse_cli(name, mod.make_config, ["preset=quick", *overrides])
    _, _, jobs, suite = main_job._parse(["suite=studies"])
    assert suite == "studies" and [n for n, _ in jobs] == list(main_job.REGISTRY)
    for name in main_job.REGISTRY:  # each declared seed key is an int field of its config
        study = study_module(name).STUDY
        keys = study.seed_keys
        assert study.name == name and (study.quick_repeat == 1 or keys), name
        if keys:
            from moejax.harness.experiment import seed_offset

            cfg = study.make_config("quick")
            assert seed_offset(cfg, keys, 2) != cfg
    # a subset of the tour keeps the tour's settings; of the studies, the quick preset's
    assert main_job._parse(["only=moe_kd"])[2] == [("moe_kd", dict(main_job.DEMO)["moe_kd"])]
    assert main_job._parse(["suite=studies", "only=moe_kd"])[2] == [("moe_kd", ())]
    assert main_job.main(["suite=everything"]) == 2


def test_a_key_the_recipe_sets_itself_is_refused_on_the_command_line(capsys):
    """A study's derived keys (a sub-config's seed set from the study's seed, a method set
    from the list it runs) name keys of its config in both presets, and each is refused on
    the command line before anything runs: taken, its value was recorded in the run's config
    but never ran (moe_kd sft.seed=3 trained the seed of seed=0). --help lists them."""
    from moejax.harness.cli import parse_runner

    declared = {}
    for name in main_job.REGISTRY:
        study = study_module(name).STUDY
        for key, _ in study.derived_keys:
            for preset in ("quick", "full"):  # a key of the config: a typo would refuse nothing
                value = study.make_config(preset)
                for part in key.split("."):
                    assert isinstance(value, Config) and hasattr(value, part), (name, key)
                    value = getattr(value, part)
            with pytest.raises(ConfigError, match=f"{key} is set by the study itself "
                                                  r"\(.+\): a value given here would be"):
                parse_runner(name, study.make_config, [f"{key}=1"],
                             derived=dict(study.derived_keys))
            declared.setdefault(name, []).append(key)
    assert {"moe_kd", "darex_controlled", "darex_storage", "darex_decoder", "darex_encoder",
            "moee", "bench_dispatch", "bench_speculative"} <= set(declared)
    assert {"sft.seed", "distill.seed", "kd.method"} <= set(declared["moe_kd"])
    # each method is the paper's (kd.teacher_k=4 ran 'KD' from four experts, then stopped the
    # run at its dense teacher, which has no routing to change)
    assert {"kd.divergence", "kd.teacher_k"} <= set(declared["moe_kd"])
    # darex_controlled gives every fine-tuning run its own optimizer and decay (Adam for the
    # plain and large-delta runs, AdamR-L2 / -L1 with their lambda): finetune.optimizer=adamr_l1
    # left the arm labelled Adam as it was and changed the large-delta runs alone
    assert {"finetune.optimizer", "finetune.weight_decay"} <= set(declared["darex_controlled"])
    # darex_encoder sets each optimizer's decay paths (AdamR's from regularise_head):
    # finetune.decay_paths reached AdamW's runs alone, recorded as every run's
    assert "finetune.decay_paths" in declared["darex_encoder"]
    # moee's MoEE row is the paper's recipe, each ablation's claim set against it:
    # extract.selection=magnitude judged 'variance beats magnitude' on magnitude against itself
    assert {"extract.selection", "extract.router", "extract.cluster.method",
            "extract.cluster.n_clusters"} <= set(declared["moee"])
    for name, overrides in main_job.DEMO:  # the tour sets none of them
        assert not {o.partition("=")[0] for o in overrides} & set(declared.get(name, ())), name
    study = study_module("moe_kd").STUDY
    assert study.main(["sft.seed=3", "out=unused"]) == 2
    assert "sft.seed is set by the study itself (seed + i" in capsys.readouterr().err
    assert study.main(["--help"]) == 0
    assert "  sft.seed: seed + i for teacher draw i" in capsys.readouterr().out
    with pytest.raises(ValueError, match="variant v sets .*sft.seed=1.*sets itself"):
        type(study)("x", study.make_config, study.run, variants=(("v", ("sft.seed=1",)),),
                    derived_keys=study.derived_keys)


UNREAD_TRAINING = [  # (study, key=value): a setting no training run of the study reads
    ("moe_kd", "sft.eval_every=5"), ("moe_kd", "distill.ckpt_every=3"),
    ("moe_kd", "sft.resume=force"), ("moee", "kd.eval_every=2"),
    ("darex_controlled", "finetune.eval_every=1"),
    ("darex_controlled", "lora_finetune.keep_checkpoints=5"),
    ("darex_controlled", "substrate.train.eval_every=1"),
    ("darex_storage", "finetune.tensorboard=true"), ("darex_decoder", "finetune.ckpt_every=2"),
    ("darex_encoder", "finetune.eval_every=1"), ("ders_compression", "train.eval_every=1"),
    ("ders_upcycling", "train.ckpt_every=1"), ("blockffn_baselines", "train.eval_every=1"),
    ("blockffn_ablations", "train.tensorboard=true"),
    ("blockffn_granularity", "train.eval_every=1"), ("bench_speculative", "train.eval_every=1"),
    ("bench_speculative", "drafts.distil.train.eval_every=1"),
    ("substrate_build", "mlp_mnist5k.train.eval_every=1"),
]
READ_TRAINING = [  # the same kind of setting where the run reads it
    ("moe_kd", "distill.eval_every=5"), ("bench_speculative", "train.ckpt_every=3"),
    ("bench_speculative", "drafts.distil.train.resume=force"),
    ("darex_controlled", "substrate.train.ckpt_every=100"),
    ("substrate_build", "dense_lm_prose.train.eval_every=5"),
    ("lm_demo", "train.tensorboard=true"),
    ("moee", "vit.train.eval_every=5"),
]


@pytest.mark.parametrize("name, setting", UNREAD_TRAINING + READ_TRAINING)
def test_a_training_setting_no_run_of_the_study_reads_is_refused(name, setting, tmp_path):
    """A study's training run without an evaluation never read its eval_every, and one without
    a run directory never read its checkpoint, TensorBoard and resume settings: taken, the
    value was recorded in the run's config and ignored (moe_kd sft.eval_every=5 ran the SFT
    without evaluating). Each is refused with the config, before anything runs or is written,
    naming the key and its default; where the run reads the setting it is taken."""
    study = study_module(name).STUDY
    key = setting.partition("=")[0]
    field = ".".join(key.split(".")[-2:])  # a substrate's config names its own train.*
    for preset in ("quick", "full"):
        if (name, setting) in READ_TRAINING:
            apply_overrides(study.make_config(preset), [setting])
            continue
        with pytest.raises(ConfigError, match=f"overrides rejected \\({key}=.*: .*{field}=.*: "
                                              ".* has no (evaluation|run directory)"):
            apply_overrides(study.make_config(preset), [setting])
    if name == "moe_kd" and setting == "sft.eval_every=5":
        assert study.main([setting, f"out={tmp_path / 'run'}"]) == 2
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_bench_parallel_tiny_measures_the_collectives_of_each_path(tmp_path):
    from experiments.benchmarks import parallel as bench_parallel

    _, run = run_experiment(
        "bench_parallel", bench_parallel.make_config, bench_parallel.run,
        ["meshes=(1x8,)", "paths=(expert_parallel,)", "tokens=256", "d_model=32",
         "d_expert=32", "n_experts=8", "repeats=1"],
        out=tmp_path / "bench_parallel")
    import csv

    ep = {r["path"]: r for r in csv.DictReader(open(run.path / "layer.csv"))}["expert_parallel"]
    # the executed rung of the dropless ladder: below the every-row rung (8x on 8 devices)
    assert float(ep["vs_a2a_volume"]) <= 3.1 and float(ep["all_reduce_mb"]) == 0
    assert 0 < float(ep["collective_mb"]) < float(ep["static_hlo_mb"])
    scaling = list(csv.DictReader(open(run.path / "scaling_model.csv")))
    assert len(scaling) == 6 and all(float(r["a2a_ms"]) > 0 for r in scaling)
    with pytest.raises(Exception, match="DATAxEXPERT"):
        bench_parallel.make_config("quick").replace(meshes=("8by1",))



def test_bench_extracted_checks_its_forwards_against_memory_before_they_run(tmp_path,
                                                                           monkeypatch, capsys):
    """Each timed forward is compiled and its estimate compared with the device's memory
    before the first call (the host made 10 kB): exit 2 in one line naming the key, no row."""
    import moejax.train.budget as budget
    from experiments.extraction import bench as bench_extracted
    from moejax.harness.experiment import main

    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**4, "this host's memory"))
    code = main("bench_extracted", bench_extracted.make_config, bench_extracted.run,
                ["model=none", "d_model=16", "d_hidden=40", "experts=4", "keep=0.5",
                 "batches=(2,5)", "seq_len=3", "repeats=1", f"out={tmp_path / 'b'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and " forward needs about " in err[-1], err[-3:]
    assert "this host's memory is 10.0 kB" in err[-1]
    assert "lower batches (now (2, 5))" in err[-1]
    assert not (tmp_path / "b" / "ffn_time.csv").exists()


def test_bench_extracted_tiny_times_every_layout_per_batch(tmp_path):
    from experiments.extraction import bench as bench_extracted

    _, run = run_experiment(
        "bench_extracted", bench_extracted.make_config, bench_extracted.run,
        ["model=none", "d_model=16", "d_hidden=40", "experts=4", "keep=0.5", "batches=(2,5)",
         "seq_len=3", "repeats=1"], out=tmp_path / "bench_extracted")
    import csv

    rows = list(csv.DictReader(open(run.path / "ffn_time.csv")))
    assert [(r["tokens"], r["plan"], r["layout"]) for r in rows[:5]] == [
        ("6", "-", "dense"), ("6", "equal", "masked"), ("6", "equal", "compact"),
        ("6", "skewed", "masked"), ("6", "skewed", "compact")]
    assert {r["tokens"] for r in rows} == {"6", "15"}
    eq = next(r for r in rows if r["plan"] == "equal")
    sk = next(r for r in rows if r["plan"] == "skewed")
    assert float(eq["kept_share"]) == pytest.approx(0.5)  # 20 of 40 neurons per expert
    assert float(eq["padded_share"]) == pytest.approx(0.5)
    assert float(sk["padded_share"]) == pytest.approx(30 / 40)  # the largest: 1.5 x 20
    dense = next(r for r in rows if r["layout"] == "dense")
    assert float(dense["weight_mb"]) == pytest.approx(2 * 16 * 40 * 4 / 1e6)
    for r in (r for r in rows if r["plan"] == "equal" and r["layout"] == "compact"):
        used = int(r["experts_used"])
        assert 1 <= used <= 4  # each used expert's own 20 neurons
        assert float(r["weight_mb"]) == pytest.approx(2 * 16 * 20 * used * 4 / 1e6)
    assert "target (0.8x the MAC saving at 6 tokens)" in (run.path / "summary.md").read_text()
    with pytest.raises(Exception, match="batches"):
        bench_extracted.make_config("quick").replace(batches=())
    with pytest.raises(Exception, match="times nothing"):
        bench_extracted.make_config("quick").replace(model="none", synthetic=False)
    with pytest.raises(Exception, match="grouped_cost"):
        bench_extracted.make_config("quick").replace(grouped_cost=0.5)


@pytest.mark.slow
def test_bench_extracted_times_the_moee_plans_of_a_substrate(tiny_recipes, tmp_path):
    """The MoEE part on the tiny ViT: every extracted layer timed in three layouts on each
    batch (compact outputs checked against the masked layout inside the run), exact MAC
    accounting, the serving layout's shared neurons within the kept ones."""
    import csv

    from experiments.extraction import bench as bench_extracted
    from moejax.extract import ClusterConfig
    from moejax.extract.pipeline import ExtractConfig
    from moejax.substrates.classify import ViTSubstrateConfig
    from tests.tiny_substrates import tiny_train

    cfg = bench_extracted.make_config("quick").replace(
        model="vit", synthetic=False, substrate_cache=str(tiny_recipes), record_rows=40,
        eval_rows=100, rows=(4,), repeats=1,
        vit=ViTSubstrateConfig(d_model=16, n_layers=2, n_heads=2, d_hidden=32,
                               train=tiny_train(3)),
        extract=ExtractConfig(n_tokens=300, cluster=ClusterConfig(min_cluster_frac=0.02)))
    _, run = run_experiment("bench_extracted", lambda preset: cfg, bench_extracted.run, [],
                            out=tmp_path / "bx")
    ffn = list(csv.DictReader(open(run.path / "moee_ffn.csv")))
    assert {r["tokens"] for r in ffn} == {"68"}  # (1 + 16 patches) x 4 images
    per_layer = [r for r in ffn if r["layer"] != "all"]
    assert per_layer and ffn[-1]["layer"] == "all" and len(ffn) == len(per_layer) + 1
    for r in per_layer:
        kept, active, F = float(r["kept"]), float(r["active"]), float(r["neurons"])
        assert 0 < active <= kept <= F
        # MACs per token: router C D + experts 2 D active, against the dense 2 D F (D = 16)
        want = 1 - (int(r["experts"]) * 16 + 2 * 16 * active) / (2 * 16 * F)
        assert float(r["mac_saved"]) == pytest.approx(want, rel=1e-6)
        assert 0 <= int(r["shared"]) <= kept and int(r["routed"]) <= kept - int(r["shared"])
    total = ffn[-1]
    assert float(total["dense_ms"]) == pytest.approx(sum(float(r["dense_ms"]) for r in per_layer))
    enc = list(csv.DictReader(open(run.path / "moee_encoder.csv")))
    assert [r["model"] for r in enc] == ["dense", "masked", "compact", "serving"]
    assert "MoEE plans (vit, 68 tokens)" in (run.path / "summary.md").read_text()


def test_bench_extracted_refuses_a_batch_the_test_split_cannot_fill_before_recording(
        monkeypatch):
    """A timed batch takes glosses at least the mean length long, cut to it (every token
    real), or images; a ``rows`` the test set cannot fill is refused with the fix, before the
    substrate's FFNs are recorded and clustered."""
    from experiments.extraction import bench as bench_extracted

    lengths = np.array([2, 5, 4, 6, 3, 4])  # mean 4: four glosses of at least 4 tokens
    mask = np.arange(8)[None, :] < lengths[:, None]
    data = SimpleNamespace(seq_len=float(lengths.mean()), test={
        "inputs": np.arange(48).reshape(6, 8), "mask": mask})
    batch = bench_extracted._timed_batch(data, 3)
    assert batch["inputs"].shape == (3, 4) and batch["mask"].all()
    np.testing.assert_array_equal(batch["inputs"][:, 0], [8, 16, 24])  # rows 1, 2 and 3

    def record(*args, **kwargs):
        raise AssertionError("recorded before the batch sizes were checked")

    monkeypatch.setattr(bench_extracted, "record_ffn", record)
    cfg = bench_extracted.make_config("quick").replace(rows=(4, 5))
    monkeypatch.setattr(type(cfg), "classifier_data", lambda self, *a: data)
    with pytest.raises(ValueError, match="rows=5: only 4 of the 6 test glosses hold 4 tokens; "
                                         "lower rows or raise eval_rows"):
        bench_extracted.moee_plans_part(cfg, run=None)
    images = SimpleNamespace(seq_len=None, test={"inputs": np.zeros((6, 28, 28, 1))})
    assert bench_extracted._timed_batch(images, 6)["inputs"].shape[0] == 6
    with pytest.raises(ValueError, match="rows=7: the test split holds 6 images"):
        bench_extracted._timed_batch(images, 7)  # not a batch of 6 timed as one of 7


@pytest.mark.slow
def test_bench_ders_tiny_decodes_and_measures_training_memory(tmp_path):
    from experiments.ders import bench as bench_ders

    _, run = run_experiment(
        "bench_ders", bench_ders.make_config, bench_ders.run,
        ["d_model=32", "n_layers=1", "n_heads=2", "d_hidden=64", "n_experts=8", "top_k=2",
         "vocab_size=32", "n_prompts=1", "prompt_len=4", "max_new_tokens=3", "train_batch=4",
         "train_seq=8", "lm_rank=2"], out=tmp_path / "bench_ders")
    import csv

    dec = list(csv.DictReader(open(run.path / "decode.csv")))
    assert [(r["model"], r["synthesis"]) for r in dec] == [
        ("vanilla", "-"), ("DeRS-SM", "all"), ("DeRS-SM", "selected"), ("DeRS-LM", "all"),
        ("DeRS-LM", "selected")]
    mem = {(r["model"], r["synthesis"]): float(r["temp_mb"])
           for r in csv.DictReader(open(run.path / "train_memory.csv"))}
    assert set(mem) == {("vanilla", "-"), ("DeRS-SM", "all"), ("DeRS-SM", "stream"),
                        ("DeRS-LM", "all"), ("DeRS-LM", "stream")}
    copies = 8 * 3 * 32 * 64 * 4 / 1e6  # the synthesised experts "all" keeps
    for form in ("SM", "LM"):
        assert mem[(f"DeRS-{form}", "stream")] < mem[(f"DeRS-{form}", "all")] - 0.5 * copies


def test_bench_grouped_times_each_pass_and_names_the_fastest(tmp_path):
    from experiments.benchmarks import grouped as bench_grouped

    summary, run = run_experiment(
        "bench_grouped", bench_grouped.make_config, bench_grouped.run,
        ["shapes=((64,16,32,4),)", "iters=2", "repeats=1"], out=tmp_path / "bg")
    import csv

    rows = list(csv.DictReader(open(run.path / "passes.csv")))
    timed = {(r["path"], r["pass"]) for r in rows if r["ms"]}
    assert {("dense", p) for p in ("fwd", "dlhs", "drhs")} <= timed
    assert {("train", "fwd+dlhs+drhs"), ("train[dense]", "fwd+dlhs+drhs")} <= timed
    (train,) = [r for r in rows if r["path"] == "train"]  # against the three dense products
    (step,) = [r for r in rows if r["path"] == "train[dense]"]  # and the dense train step
    three = sum(float(r["ms"]) for r in rows if r["path"] == "dense")
    assert float(train["x_dense"]) == pytest.approx(float(train["ms"]) / three)
    assert float(train["x_dense_step"]) == pytest.approx(float(train["ms"]) / float(step["ms"]))
    assert float(step["x_dense_step"]) == 1.0
    for r in rows:
        if r["path"] == "dense" and r["ms"]:
            assert float(r["x_dense"]) == 1.0
        if jax.default_backend() == "cpu" and r["path"] in bench_grouped.ACCELERATOR_PATHS:
            assert r["note"].startswith("not measured") and not r["ms"]
    choice = list(csv.DictReader(open(run.path / "choice.csv")))
    assert [c["pass"] for c in choice] == ["fwd", "dlhs", "drhs"]
    for c in choice:  # the fastest is the minimum over the timed grouped rows of that pass
        got = [float(r["ms"]) for r in rows if r["pass"] == c["pass"] and r["ms"]
               and r["path"] not in ("dense", "train")]
        assert float(c["fastest_ms"]) == pytest.approx(min(got))
    with pytest.raises(ConfigError, match="shapes"):
        run_experiment("bench_grouped", bench_grouped.make_config, bench_grouped.run,
                       ["shapes=((64,0,32,4),)"], out=tmp_path / "bad")


def test_bench_grouped_trains_on_each_own_kernel_where_it_runs(monkeypatch):
    from experiments.benchmarks import grouped as bench_grouped

    cfg = bench_grouped.BenchGroupedConfig()
    # this CPU: no own kernel runs; the dense step is the train rows' reference
    assert bench_grouped._train_paths(cfg) == ("train[dense]", "train")
    monkeypatch.setattr(bench_grouped, "_unavailable", lambda path: None)
    assert bench_grouped._train_paths(cfg) == ("train[dense]", "train", "train[gmm]",
                                               "train[gmm_mgpu]")
    assert bench_grouped._train_paths(cfg.replace(paths=("xla", "gmm"))) == ("train",
                                                                             "train[gmm]")



def test_bench_dispatch_headline_sets_every_dropless_step_against_the_capacity_step():
    """The default dropless path (auto) is compared with the capacity step first, then the
    others measured; a block under a millisecond keeps its digits."""
    from experiments.benchmarks.dispatch import _ratios

    timed = [{"path": p, "step_s_median": s} for p, s in
             (("auto", 0.03702), ("capacity", 0.03634), ("bucketed", 0.08709))]
    blk = {"grouped (dropless)": {"ms": 0.8, "vs_flop_bound": 2.66, "vs_torch": 0.069}}
    assert _ratios(timed, blk) == (
        "; dropless step / capacity step: auto 1.02, bucketed 2.40; MoE block: grouped "
        "(dropless) 0.8 ms = 2.66x the FLOP bound, 0.07x PyTorch's time")

def test_bench_grouped_keeps_the_other_rows_when_a_kernel_fails(monkeypatch):
    """A kernel path that fails to compile or run is a row saying so; the dense product's
    failure still fails the run."""
    from experiments.benchmarks import grouped as bench_grouped

    def broken(*args, **kw):
        raise RuntimeError("Mosaic GPU: failed to compile\nmore")

    monkeypatch.setattr(bench_grouped, "time_device_loop", broken)
    cfg = bench_grouped.BenchGroupedConfig()
    assert bench_grouped._time(None, cfg=cfg, flops=1.0, path="gmm_mgpu") == (
        None, "failed: RuntimeError: Mosaic GPU: failed to compile")
    with pytest.raises(RuntimeError, match="failed to compile"):
        bench_grouped._time(None, cfg=cfg, flops=1.0, path="dense")


def test_bench_grouped_flags_a_wrong_used_kernel_and_a_time_lost_in_the_flush(monkeypatch):
    """A call whose time comes out inside the timing's noise once the L2 flush loop's is
    subtracted, or at a rate above the device's peak, is a row saying so, not a time; a time
    clear of both is kept; the choice table marks the implementation ragged_dot uses as WRONG
    where its output failed the oracle."""
    from experiments.benchmarks import grouped as bench_grouped

    def timed(median_s, noise_s=1e-6):
        monkeypatch.setattr(bench_grouped, "time_device_loop", lambda *a, **kw: {
            "median_s": median_s, "flush_s": 2e-4, "noise_s": noise_s, "output": None})

    cfg = bench_grouped.BenchGroupedConfig()
    x = jnp.ones((4, 4), jnp.bfloat16)
    timed(-1.5e-5)
    assert bench_grouped._time(None, x, cfg=cfg, flops=1.0, path="gmm") == (
        None, "unresolved: -0.0150 ms (± 0.0010 ms) once the L2 flush's 0.2000 ms is "
        "subtracted: inside the timing's noise")
    timed(4e-6, noise_s=5e-6)  # positive, but less than its uncertainty
    assert bench_grouped._time(None, x, cfg=cfg, flops=1.0, path="gmm")[0] is None
    monkeypatch.setattr(bench_grouped.jax, "devices", lambda: [type(
        "D", (), {"device_kind": "NVIDIA H200"})()])
    timed(1.1e-6)  # 1.48 GFLOP in 1.1 us: 1345 TFLOP/s, above an H200's 989
    s, note = bench_grouped._time(None, x, cfg=cfg, flops=1.48e9, path="mosaic_gpu")
    assert s is None and note.endswith("1345 TFLOP/s, above the device's 989"), note
    timed(1.8e-5)  # 82 TFLOP/s: a time
    assert bench_grouped._time(None, x, cfg=cfg, flops=1.48e9, path="gmm") == (1.8e-5, "")
    monkeypatch.setattr(bench_grouped, "target_device", lambda: ("cuda", None))
    shape = {"M": 4096, "K": 256, "N": 704, "G": 8}  # under OWN_FROM_FLOPS: tokamax's fwd
    (fwd,) = bench_grouped.choice([
        {**shape, "path": "gmm", "pass": "fwd", "ms": 1.0},
        {**shape, "path": "mosaic_gpu", "pass": "fwd", "ms": None,
         "note": "wrong: error 0.129 of the oracle's largest value (allowed 0.0156)"}])
    assert (fwd["used"], fwd["used_ms"], fwd["fastest"]) == ("mosaic_gpu WRONG", None, "gmm")


def test_bench_grouped_checks_a_train_rows_gradients_against_the_pass_oracles(monkeypatch):
    """A train row's dX and dW are checked against the dX and dW products' oracles: right
    gradients keep their time, a wrong dW loses it."""
    from experiments.benchmarks import grouped as bench_grouped
    from moejax.bench.oracles import grouped_pass_sample

    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (24, 8)), jax.random.normal(kw, (3, 8, 5))
    dy, gs = jax.random.normal(kd, (24, 5)), jnp.asarray([10, 0, 14], jnp.int32)
    row_w = w[jnp.repeat(jnp.arange(3), gs, total_repeat_length=24)]
    dx = jnp.einsum("mn,mkn->mk", dy, row_w)
    dw = jnp.stack([x[a:b].T @ dy[a:b] for a, b in ((0, 10), (10, 10), (10, 24))])
    checks = [(lambda out, i=i: out[1][i], grouped_pass_sample(
        which, *operands, gs, jax.random.key(i + 1)))
        for i, (which, operands) in enumerate((("dlhs", (dy, w)), ("drhs", (x, dy))))]
    cfg = bench_grouped.BenchGroupedConfig()
    for grads, want in (((dx, dw), ""), ((dx, dw.at[2].multiply(1.5)), "wrong")):
        monkeypatch.setattr(bench_grouped, "time_device_loop", lambda *a, g=grads, **k: {
            "median_s": 1e-3, "flush_s": 0.0, "noise_s": 0.0, "output": (0.0, g)})
        s, note = bench_grouped._time(None, x, cfg=cfg, flops=1.0, path="gmm",
                                      oracles=checks)
        assert note.startswith(want) and (s is None) == bool(want), note


def test_bench_grouped_names_the_own_kernel_where_tokamax_declines_the_call(monkeypatch):
    """float32 on a GPU: Mosaic GPU declines, ragged_pass runs the own gmm, and the choice
    table judges that kernel, not an empty row."""
    from experiments.benchmarks import grouped as bench_grouped

    monkeypatch.setattr(bench_grouped, "target_device", lambda: ("cuda", None))
    shape = {"M": 64, "K": 16, "N": 32, "G": 4}
    rows = [{**shape, "path": "xla", "pass": "fwd", "ms": 2.0},
            {**shape, "path": "gmm", "pass": "fwd", "ms": 1.0},
            {**shape, "path": "mosaic_gpu", "pass": "fwd", "ms": None,
             "note": "not taken: NotImplementedError: Only bfloat16/float16 inputs"},
            {**shape, "path": "xla", "pass": "dlhs", "ms": 1.0},
            {**shape, "path": "gmm", "pass": "dlhs", "ms": 3.0},
            {**shape, "path": "mosaic_gpu", "pass": "dlhs", "ms": 0.5}]
    fwd, dlhs = bench_grouped.choice(rows)
    assert (fwd["used"], fwd["used_ms"], fwd["used_x_fastest"]) == (
        "gmm (mosaic_gpu declines)", 1.0, 1.0)
    assert (dlhs["used"], dlhs["used_ms"], dlhs["fastest"]) == ("mosaic_gpu", 0.5, "mosaic_gpu")
    big = {"M": 65536, "K": 2048, "N": 1408, "G": 64}  # past OWN_FROM_FLOPS: the own kernel
    (fwd,) = bench_grouped.choice([{**big, "path": "gmm", "pass": "fwd", "ms": 0.75},
                                   {**big, "path": "gmm_mgpu", "pass": "fwd", "ms": 0.7},
                                   {**big, "path": "mosaic_gpu", "pass": "fwd", "ms": 1.2}])
    assert (fwd["used"], fwd["used_ms"], fwd["fastest"]) == ("gmm_mgpu", 0.7, "gmm_mgpu")


def test_a_study_declaration_is_refused_when_it_cannot_run_as_declared():
    from moejax.harness.study import Study

    def make(preset):
        return None

    def run(cfg, run_dir):
        return {}

    with pytest.raises(ValueError, match="needs the seed_keys"):
        Study("s", make, run, quick_repeat=5)
    with pytest.raises(ValueError, match="quick_repeat=0"):
        Study("s", make, run, quick_repeat=0)
    with pytest.raises(ValueError, match="key=value"):
        Study("s", make, run, smoke_depth=("n_layers",))
    with pytest.raises(ValueError, match="module-like name"):
        Study("two words", make, run)
    study = Study("s", make, run, smoke=("a=1",), smoke_depth=("model.n_layers=1",))
    assert study.smoke_cuts == ("a=1", "model.n_layers=1")


@pytest.mark.parametrize("preset", ["quick", "full"])
def test_moee_and_the_extraction_benchmark_start_from_the_same_source(preset):
    """The benchmark times the plans the study extracts: same substrates, recording and
    recipe per preset (only which model each defaults to differs)."""
    import dataclasses

    from experiments.extraction import bench as bench_extracted
    from experiments.extraction import moee
    from moejax.extract.start import ExtractionSource

    a, b = moee.make_config(preset), bench_extracted.make_config(preset)
    shared = [f.name for f in dataclasses.fields(ExtractionSource) if f.name != "model"]
    assert {k: getattr(a, k) for k in shared} == {k: getattr(b, k) for k in shared}
    assert (a.extract.n_tokens == 100_000) == (preset == "full")


def test_a_study_runs_from_its_papers_package_and_its_old_flat_name_still_runs():
    """Every registered name loads a Study of that name from its module in a paper package (or
    the op's benchmarks); ``python -m experiments.<paper>.<study>`` runs it with the usage
    naming that command; the last release's flat name is, imported, that same module and,
    run, prints one line naming the new command and runs it."""
    import importlib
    import subprocess
    import sys

    import experiments

    for name, module in {**experiments.STUDIES, **experiments.TOOLS}.items():
        assert experiments.study_module(name) is importlib.import_module(module), name
        assert module.count(".") == 2 or name in ("lm_demo", "substrate_build"), module
        if name in experiments.STUDIES:
            assert experiments.load_study(name).name == name
        flat = importlib.import_module(f"experiments.{name}")
        assert flat is importlib.import_module(module), name
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("experiments.no_such_study")
    # the flat name runs the new module as ``__main__``, as ``python -m`` would
    r = subprocess.run([sys.executable, "-m", "experiments.blockffn_granularity", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "n_experts" in r.stdout, r.stderr[-2000:]
    assert "usage: python -m experiments.blockffn.granularity " in r.stdout
    assert r.stderr.strip().splitlines()[0] == (
        "experiments.blockffn_granularity moved: python -m experiments.blockffn.granularity")


def test_bench_kernels_judges_the_profiled_kernel_time_against_the_floor(tmp_path):
    from experiments.blockffn import kernels as bench_kernels
    from experiments.blockffn.kernels import _ffn_summary, _profile_columns

    timed = {"kernel_s": 12e-6, "kernels_per_call": 3.0,
             "kernels": {"decode_kernel": 10e-6, "fusion": 1.5e-6, "memset": 0.5e-6,
                         "slice": 0.1e-6}}
    cols = _profile_columns(timed, floor_ms=0.010)
    assert cols["kernel_ms"] == pytest.approx(0.012) and cols["kernels_per_call"] == 3.0
    assert cols["x_floor_kernel"] == pytest.approx(1.2)
    assert cols["top_kernels"] == "decode_kernel: 10.0 us; fusion: 1.5 us; memset: 0.5 us"
    rows = [{"n": 1, "union": 16, "union_fraction": 0.25, "path": "decode", "ms": 0.02,
             "x_floor": 2.0, "floor_ms": 0.01, **cols},
            {"n": 8, "union": 64, "union_fraction": 1.0, "path": "decode", "ms": 0.06,
             "x_floor": 1.6, "floor_ms": 0.04,
             **_profile_columns({**timed, "kernel_s": 70e-6}, floor_ms=0.04)}]
    headline, notes = _ffn_summary(rows)
    assert "decode: within 1.5x of the memory floor in 0/2 cases" in notes[-2]
    # only the decode kernel ran: the headline is its target, not "chunk_union: not measured"
    assert notes[0] == "chunk_union: not measured here" and headline == notes[-2]
    assert notes[-1].startswith("decode, its kernels' own device time (profiler: no launch "
                                "gaps; 3.0 kernels a call): within 1.5x of the memory floor "
                                "in 1/2 cases (nearest 1.20x at n=1, |U|/E=0.25)")
    # the pair kernels measured beside it: the headline is still the decode target
    pallas = {"n": 1, "union": 16, "union_fraction": 0.25, "path": "pallas", "ms": 0.05,
              "x_bound": 4.0, "x_floor": 5.0, "floor_ms": 0.01}
    headline, notes = _ffn_summary([pallas, *rows])
    assert notes[1].startswith("pallas: within 1.15x of the bound in 0/1 cases")
    assert headline.startswith("decode: within 1.5x of the memory floor in 0/2 cases")
    assert _ffn_summary([pallas])[0] == notes[1]
    with pytest.raises(ConfigError, match="profile_paths"):
        run_experiment("bench_kernels", bench_kernels.make_config, bench_kernels.run,
                       ["ffn_paths=(dense,)"], out=tmp_path / "bad")


def test_the_benchmarks_time_no_wrong_kernel(monkeypatch):
    """A grouped product or an expert path whose output is not its oracle's is a row saying
    "wrong: ...", with no time; the others are timed."""
    from experiments.benchmarks import grouped as bench_grouped
    from experiments.blockffn import kernels as bench_kernels

    right = bench_grouped._pass_fn
    monkeypatch.setattr(bench_grouped, "_pass_fn", lambda path, which: (
        (lambda a, b, gs: 2 * right("xla", which)(a, b, gs)) if path == "xla" and
        which == "dlhs" else right(path, which)))
    cfg = bench_grouped.BenchGroupedConfig(paths=("dense", "xla"), shapes=((64, 16, 32, 4),),
                                           iters=1, repeats=1)
    rows = bench_grouped.bench(cfg, jax.random.key(0))
    xla = {r["pass"]: r for r in rows if r["path"] == "xla"}
    assert xla["dlhs"]["note"].startswith("wrong: error") and not xla["dlhs"]["ms"]
    assert xla["fwd"]["ms"] and xla["drhs"]["ms"] and not xla["fwd"]["note"]

    right_ffn = bench_kernels._ffn_fn
    monkeypatch.setattr(bench_kernels, "_ffn_fn", lambda path, cfg, u: (
        (lambda *z: 2 * right_ffn(path, cfg, u)(*z)) if path == "chunk_union"
        else right_ffn(path, cfg, u)))
    cfg = bench_kernels.BenchKernelsConfig(
        ffn=bench_kernels.FfnShape(d_model=16, n_experts=8, d_expert=8), chunk_sizes=(2,),
        union_fractions=(0.5,), repeats=1,
        ffn_paths=("dense", "dense_union", "chunk_union", "chunk_union_gather"),
        profile_paths=())
    rows = {r["path"]: r for r in bench_kernels.bench_ffn(cfg, jax.random.key(0), 1.0)}
    assert rows["chunk_union"]["note"].startswith("wrong: error")
    assert "ms" not in rows["chunk_union"]
    assert all(rows[p].get("ms") for p in ("dense", "dense_union", "chunk_union_gather"))


def test_bench_dispatch_profiles_a_step_per_path_where_it_sees_the_device(tmp_path, monkeypatch):
    """With a device trace (stubbed here: a CPU trace has none), each path's row gets its
    kernels per step and the device's busy fraction, and step_kernels its longest kernels and
    the rest together, each with what it fuses."""
    import csv

    from experiments.benchmarks import dispatch as bench_dispatch
    from moejax.bench.profile import KernelTrace, fused_ops

    compiled, real_compile, named = [], bench_dispatch.compile_fitting, []
    monkeypatch.setattr(bench_dispatch, "compile_fitting",
                        lambda *a, **k: compiled.append(real_compile(*a, **k)) or compiled[-1])

    def traced(one_step):
        one_step()  # the step runs (and donates its state) as under the profiler
        # the second kernel named as a profile names one of the step's own fusions
        named.append(next(k for k in fused_ops(compiled[-1].as_text()) if "." not in k))
        return KernelTrace(12, 3e-3, {"gemm": 2e-3, named[-1]: 0.8e-3, "copy": 0.2e-3})

    from moejax.bench import train_steps

    monkeypatch.setattr(train_steps, "sees_device", lambda: True)
    monkeypatch.setattr(train_steps, "trace_kernels", traced)
    _, run = run_experiment(
        "bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
        TINY_LM + ["batch_size=2", "seq_len=16", "warmup=1", "steps=1", "paths=(dense,capacity)",
                   "profile_top=2", "block_tokens=64", "block_d=16", "block_f=32",
                   "block_repeats=1", "block_paths=(capacity,)", "delta_tree=none"],
        out=tmp_path / "bench")
    rows = list(csv.DictReader(open(run.path / "dispatch.csv")))
    for r in rows:
        assert int(r["kernels_per_step"]) == 12
        assert float(r["device_busy"]) == pytest.approx(3e-3 / float(r["step_s_median"]))
    top = list(csv.DictReader(open(run.path / "step_kernels.csv")))
    assert [(t["path"], t["kernel"]) for t in top] == [
        (p, k) for p, name in zip(("dense", "capacity"), named)
        for k in ("gemm", name, "(the other kernels)")]
    assert [float(t["ms"]) for t in top[:3]] == pytest.approx([2.0, 0.8, 0.2])
    assert float(top[0]["share"]) == pytest.approx(2 / 3)
    # what each kernel fuses, read from the step each path compiled and timed
    fuses = [fused_ops(c.as_text()) for c in compiled]
    assert [t["fuses"] for t in top] == [
        x for f, name in zip(fuses, named) for x in ("", f[name], "")]
    assert all(" -> " in f[name] for f, name in zip(fuses, named))
    with pytest.raises(ConfigError, match="profile_top"):
        run_experiment("bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
                       ["profile_top=0"], out=tmp_path / "bad")
