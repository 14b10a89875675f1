"""Smoke runs of the full presets (``smoke=true``): every training run and evaluation cut,
model sizes and the study's data kept; every registered study's full preset parses as one;
the training loop reports each run's size for the smoke table."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import study_module
from experiments.ders import upcycling as study
from experiments.extraction import moee
from experiments.main import REGISTRY
from moejax.config import Config, ConfigError, find_configs
from moejax.harness.cli import expand_variant, parse_runner
from moejax.harness.smoke import SMOKE_ROWS, SMOKE_STEPS, smoke_config
from moejax.substrates.registry import substrate_config
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from tests.toy_models import TinyMoELM, ToySource


def _trains(cfg: Config):
    return [c for _, c in find_configs(cfg, TrainConfig)]


def _strip_trains(cfg: Config):
    """The config with every TrainConfig and the counts the smoke cuts blanked out."""
    if isinstance(cfg, TrainConfig):
        return None
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("eval_batches", "eval_examples", "max_train_examples", "init_preset"):
            continue
        out[f.name] = _strip_trains(value) if isinstance(value, Config) else value
    return out


@pytest.mark.parametrize("name", REGISTRY)
def test_every_full_preset_parses_as_a_smoke_run_with_its_sizes_kept(name):
    study = study_module(name).STUDY
    full = study.make_config("full")
    cuts = study.smoke_cuts
    # a depth cut drops layers and keeps every layer's shape
    assert all(c.split("=", 1)[0].endswith("layers") for c in study.smoke_depth)
    cfg, _, repeat = parse_runner(name, study.make_config, ["preset=full", "smoke=true"],
                                  study.quick_repeat, cuts)
    assert repeat == 1
    for t, t_full in zip(_trains(cfg), _trains(full), strict=True):
        assert t.steps == min(t_full.steps, SMOKE_STEPS) and t.warmup_steps == 0
        assert t.batch_size == min(t_full.batch_size, SMOKE_ROWS) and t.log_every == 1
        assert t.lr == t_full.lr and t.optimizer == t_full.optimizer  # the recipe is kept
    # everything else is the full preset's, but for the study's declared cuts
    cut_keys = {c.split("=", 1)[0].split(".")[0] for c in cuts}
    a, b = _strip_trains(cfg), _strip_trains(full)
    assert {k: v for k, v in a.items() if k not in cut_keys} == {
        k: v for k, v in b.items() if k not in cut_keys}


def test_smoke_cuts_nested_runs_and_counts_and_the_command_line_wins():
    cfg = smoke_config(study.make_config("full"))
    assert cfg.train.steps == 2 and cfg.substrate.pretrained.train.steps == 2
    assert cfg.eval_batches == 2 and cfg.substrate.pretrained.eval_batches == 2
    assert cfg.substrate.seq_len == 512  # sizes kept
    cfg, _, _ = parse_runner("ders_upcycling", study.make_config,
                             ["preset=full", "smoke=true", "train.steps=3", "eval_batches=5"])
    assert cfg.train.steps == 3 and cfg.eval_batches == 5
    cfg, _, _ = parse_runner("ders_upcycling", study.make_config, ["preset=full", "smoke=false"])
    assert cfg.train.steps == 2000
    with pytest.raises(ConfigError, match="smoke='yes'"):
        parse_runner("ders_upcycling", study.make_config, ["smoke=yes"])
    # a 0 ("all examples") becomes a cap, a smaller count stays

    sub = smoke_config(substrate_config("minilm_wordnet_pos", "full"))
    assert sub.eval_examples == 64 and sub.max_train_examples == 256
    # a substrate that starts from another starts from that one's smoke run
    code = smoke_config(substrate_config("dense_lm_code", "full"))
    assert code.init_preset == "full_smoke"
    dep = substrate_config("dense_lm_prose", code.init_preset)
    assert dep == smoke_config(substrate_config("dense_lm_prose", "full"))
    assert dep.train.steps == SMOKE_STEPS and dep.train.batch_size == SMOKE_ROWS
    assert smoke_config(code).init_preset == "full_smoke"  # idempotent


def test_the_loop_reports_each_runs_parameters_tokens_per_step_and_steps():
    seen = []

    def listen(event, value, **_):
        if event.startswith("/moejax/train/"):
            seen.append((event, value))

    jax.monitoring.register_scalar_listener(listen)
    try:
        model = TinyMoELM(nnx.Rngs(0))
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        train(model, ToySource(batch_size=4), TrainConfig(steps=2, batch_size=4, log_every=1))
    finally:
        jax.monitoring.unregister_scalar_listener(listen)
    source = ToySource(batch_size=4)
    assert seen == [("/moejax/train/params", float(n_params)),
                    ("/moejax/train/tokens_per_step", float(source.batch(0)["mask"].size)),
                    ("/moejax/train/steps", 2.0)]


def test_a_smoke_run_cuts_each_training_run_to_at_most_its_own_steps():
    """Every training run of a smoke run takes at most SMOKE_STEPS steps of SMOKE_ROWS rows,
    no more than its own, with its periodic evaluation and checkpoint due within them (a
    cadence of 0, never, stays 0); a proof's cut (cut_training=False) leaves the runs, and
    the presets the substrates start from, whole."""
    full = TrainConfig(steps=1000, batch_size=64, warmup_steps=50, eval_every=250,
                       ckpt_every=500, log_every=20)
    cut = smoke_config(full)
    assert (cut.steps, cut.batch_size, cut.warmup_steps, cut.log_every) == (
        SMOKE_STEPS, SMOKE_ROWS, 0, 1)
    assert (cut.eval_every, cut.ckpt_every) == (SMOKE_STEPS, SMOKE_STEPS)
    one = smoke_config(full.replace(steps=1, warmup_steps=0, eval_every=0, ckpt_every=0,
                                    batch_size=2))
    assert (one.steps, one.batch_size, one.eval_every, one.ckpt_every) == (1, 2, 0, 0)
    assert smoke_config(full, cut_training=False) == full

    code = substrate_config("dense_lm_code", "full")
    kept = smoke_config(code, cut_training=False)
    assert kept.init_preset == "full" and kept.train == code.train


def test_a_repeat_that_is_not_a_count_is_refused():
    for bad in ("abc", "0", "-1", "1.5"):
        with pytest.raises(ConfigError, match=f"repeat='{bad}': expected an int >= 1"):
            parse_runner("ders_upcycling", study.make_config, [f"repeat={bad}"])


def test_a_smoke_run_of_a_variant_cuts_the_variants_training_too():
    """A variant is part of the preset it runs: ``variant=minilm smoke=true`` cuts moee's KD
    fine-tune to the smoke steps (the variant's kd.steps=60 used to win over the cut, so the
    smoke run trained 60 steps under a summary saying every training run was cut); the
    command line's own keys still win, and the run's kind is the variant's preset."""
    variants = dict(moee.STUDY.variants)
    argv, name = expand_variant("moee", ["variant=minilm", "smoke=true"], variants)
    assert (argv, name) == (["smoke=true"], "minilm")

    def parse(*argv):
        return parse_runner("moee", moee.make_config, list(argv), 1, moee.STUDY.smoke,
                            variant_overrides=variants["minilm"])[0]

    cfg = parse("smoke=true")
    assert cfg.model == "minilm" and cfg.kd.steps == SMOKE_STEPS and cfg.seeds == 1
    assert parse("smoke=true", "kd.steps=5").kd.steps == 5
    assert parse().kd.steps == 60 and parse().seeds == 3  # a real run: the variant's


def test_a_smoke_run_is_one_run_with_the_studys_own_cuts_under_the_command_line():
    def parse(*argv):
        return parse_runner("ders_upcycling", study.make_config, list(argv), quick_repeat=5,
                            smoke_overrides=("eval_batches=1", "train.steps=1"))

    cfg, _, repeat = parse("smoke=true")
    assert repeat == 1 and cfg.eval_batches == 1 and cfg.train.steps == 1
    cfg, _, repeat = parse("smoke=true", "train.steps=3")
    assert cfg.train.steps == 3 and cfg.eval_batches == 1
    cfg, _, repeat = parse()
    assert repeat == 5 and cfg == study.make_config("quick")
    assert parse("preset=full")[2] == 1 and parse("smoke=true", "repeat=2")[2] == 2
