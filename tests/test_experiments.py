"""The experiment modules run end to end on tiny settings and write their reports."""

import json

import pytest

import experiments
from experiments import full_smoke, lm_demo, results_doc, study_module
from experiments import main as main_job
from experiments.benchmarks import autotune
from experiments.extraction import bench as bench_extracted
from experiments.extraction import moee
from experiments.lm_demo import _longer_runs
from moejax.config import Config, ConfigError, from_json, to_json
from moejax.config_overrides import apply_overrides
from moejax.extract.start import ExtractionSource
from moejax.harness.cli import parse_cli, parse_runner
from moejax.harness.experiment import run_experiment, seed_offset
from moejax.harness.study import Study
from tests.tiny_substrates import TINY_LM


def test_lm_demo_tiny_writes_report_and_learns(tmp_path):
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
    assert _longer_runs(300) == " (the full preset's 4000 steps go further)"
    assert _longer_runs(4000) == ""


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
    # an empty value is refused, not read as the current directory or the whole suite
    for bad, match in [(["out="], r"out= is empty: give it a value, or leave it out for its "
                                  r"default \(runs/report\)"),
                       (["only="], r"only= is empty"),
                       (["only=lm_demo,,moee"], "holds an empty name"),
                       (["only=moee,lm_demo,moee"], "names moee twice; name each study once")]:
        with pytest.raises(ConfigError, match=match):
            main_job._parse(bad)


@pytest.mark.parametrize("command", ["main", "results_doc", "full_smoke", "autotune"])
@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_every_command_prints_its_usage_on_help_and_writes_nothing(command, word, tmp_path,
                                                                   monkeypatch, capsys):
    """The suite, the results document, the full-preset proofs and the GPU-only autotuner
    answer a help word with their usage and exit 0, as a study does: before any check of the
    arguments or the machine (autotune refuses a CPU otherwise), nothing written."""
    monkeypatch.chdir(tmp_path)
    run = {"main": main_job.main, "results_doc": results_doc.main, "full_smoke": full_smoke.main,
           "autotune": autotune.cli}[command]
    assert run([word, "only=nope"]) == 0
    out = capsys.readouterr().out
    head = ("usage: python -m experiments.benchmarks.autotune" if command == "autotune" else
            {"main": main_job, "results_doc": results_doc, "full_smoke": full_smoke}[
                command].__doc__.splitlines()[0])
    assert out.startswith(head), out[:200]
    assert list(tmp_path.iterdir()) == []
    if command == "autotune":  # without the help word, this CPU is refused
        assert run(["only=nope"]) == 2 and "run it on a GPU" in capsys.readouterr().err


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


def test_a_study_declaration_is_refused_when_it_cannot_run_as_declared():
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
