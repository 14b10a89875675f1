"""Configs: validation at construction, JSON round trip, key=value overrides that fail fast."""

import dataclasses
import re
from typing import Literal

import jax.numpy as jnp
import numpy as np
import pytest

import experiments.darex.storage as study
from experiments import STUDIES, TOOLS
from experiments.darex import controlled as mod
from experiments.extraction import moee
from experiments.kd import moe_kd
from moejax.config import Config, ConfigError, config, from_json, is_integer, is_real, to_json
from moejax.config_overrides import apply_overrides, unread_reason
from moejax.harness.cli import parse_cli
from moejax.harness.experiment import main
from moejax.optim import dare_updates
from moejax.train.hparams import TrainConfig


@config
class _Inner(Config):
    width: int = 4
    act: Literal["relu", "gelu"] = "relu"
    rate: float = 0.5

    def validate(self):
        self._require(self.width > 0, f"width must be positive, got {self.width}")


@config
class _Outer(Config):
    name: str = "x"
    inner: _Inner = _Inner()
    layers: tuple[int, ...] = (0, 2)
    flag: bool = False
    maybe: int | None = None


@config
class _Checked(Config):  # a rule across sections: the outer config checks its inner one's key
    inner: _Inner = _Inner()
    cap: int = 8

    def validate(self):
        self._require(self.inner.width <= self.cap, f"inner.width exceeds cap={self.cap}")


def test_literal_and_custom_validation_at_construction():
    with pytest.raises(
        ConfigError, match=r"act='tanh' is not allowed; allowed values: 'relu', 'gelu'"
    ):
        _Inner(act="tanh")
    with pytest.raises(ConfigError, match="width must be positive"):
        _Inner(width=0)
    with pytest.raises(ConfigError, match="expected an int"):
        _Inner(width=2.5)
    with pytest.raises(ConfigError, match="expected a bool"):
        _Outer(flag="yes")


def test_frozen():
    cfg = _Inner()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.width = 3  # type: ignore[misc]


def test_json_round_trip_keeps_nested_types():
    cfg = _Outer(name="y", inner=_Inner(width=8, act="gelu"), layers=(1, 3), maybe=5)
    back = from_json(to_json(cfg), extra_prefixes=("tests.",))
    assert back == cfg
    assert isinstance(back.inner, _Inner) and isinstance(back.layers, tuple)


def test_from_json_refuses_foreign_classes():
    with pytest.raises(ConfigError, match="refusing to build"):
        from_json('{"__config__": "os.path.Something"}')


def test_overrides_parse_types_and_nested_keys():
    cfg = apply_overrides(
        _Outer(),
        [
            "inner.width=16",
            "inner.act=gelu",
            "inner.rate=1e-3",
            "flag=true",
            "layers=1,3,5",
            "maybe=none",
            "name=hello",
        ],
    )
    assert cfg.inner == _Inner(width=16, act="gelu", rate=1e-3)
    assert (
        cfg.flag is True and cfg.layers == (1, 3, 5) and cfg.maybe is None and cfg.name == "hello"
    )


def test_unknown_key_names_allowed_keys():
    with pytest.raises(ConfigError) as e:
        apply_overrides(_Outer(), ["inner.depth=3"])
    msg = str(e.value)
    assert "inner.depth" in msg and "inner.width" in msg and "inner.act" in msg


def test_a_misspelt_key_gets_its_nearest_keys_first():
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.widht' \(did you mean "
                                          r"'inner.width'\?\); allowed keys: inner.width, "):
        apply_overrides(_Outer(), ["inner.widht=3"])
    with pytest.raises(ConfigError, match=r"'layer' \(did you mean 'layers'\?\)"):
        apply_overrides(_Outer(), ["layer=(1,)"])
    with pytest.raises(ConfigError) as e:  # nothing near: the list alone
        apply_overrides(_Outer(), ["zzz=1"])
    assert "did you mean" not in str(e.value) and "allowed keys: name, inner.width" in str(e.value)


@config
class _Train(Config):
    lr: float = 1e-3
    steps: int = 10
    seed: int = 0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    warmup: int = 0
    decay: float = 0.0


@config
class _Stage(Config):
    width: int = 4
    train: _Train = _Train()


@config
class _Study(Config):  # 27 keys: past the count an error lists one by one
    dense_lm_chat: _Stage = _Stage()
    dense_lm_prose: _Stage = _Stage()
    sft: _Train = _Train()
    seeds: int = 1


def test_a_key_without_its_section_is_pointed_at_the_sections_that_have_it():
    """``train.lr`` names a setting that lives in sections: the error suggests the keys that
    end in it, then the same setting elsewhere, and folds a long key list into its sections."""
    with pytest.raises(ConfigError) as e:
        apply_overrides(_Study(), ["train.lr=0.1"])
    assert str(e.value) == (
        "unknown config key 'train.lr' (did you mean 'dense_lm_chat.train.lr', "
        "'dense_lm_prose.train.lr' or 'sft.lr'?); allowed keys (27; the command's --help "
        "lists each with its default): dense_lm_chat.* (9 keys), dense_lm_prose.* (9 keys), "
        "sft.* (8 keys), seeds")
    with pytest.raises(ConfigError, match=r"'dense_lm_prse.train.lrr' \(did you mean "
                                          r"'dense_lm_prose.train.lr'\?\)"):
        apply_overrides(_Study(), ["dense_lm_prse.train.lrr=0.1"])
    with pytest.raises(ConfigError) as e:  # inside a section: its keys, listed one by one
        apply_overrides(_Study(), ["sft.lrr=0.1"])
    assert "(did you mean 'sft.lr'?); allowed keys: sft.lr, sft.steps, sft.seed" in str(e.value)
    with pytest.raises(ConfigError, match=r"'sed' \(did you mean 'seeds'\?\)"):
        apply_overrides(_Study(), ["sed=1"])  # its own section's first
    with pytest.raises(ConfigError, match=r"'stpes' \(did you mean 'dense_lm_chat.train.steps', "
                                          r"'dense_lm_prose.train.steps' or 'sft.steps'\?\)"):
        apply_overrides(_Study(), ["stpes=1"])  # then any section's
    with pytest.raises(ConfigError, match=r"'dense_lm_chat' is a config section; set one of its "
                                          r"keys; allowed keys: dense_lm_chat.width, "):
        apply_overrides(_Study(), ["dense_lm_chat=1"])


def test_a_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match=r"inner.width is given twice \(inner.width=3 and "
                                          r"inner.width=4\)"):
        apply_overrides(_Outer(), ["inner.width=3", "inner.width=4"])
    assert apply_overrides(_Outer(), ["inner.width=3"]).inner.width == 3


def test_bad_value_names_allowed_values():
    with pytest.raises(
        ConfigError, match=r"inner.act='swish' is not allowed; allowed values: 'relu', 'gelu'"
    ):
        apply_overrides(_Outer(), ["inner.act=swish"])
    with pytest.raises(ConfigError, match="inner.width='abc': expected an int"):
        apply_overrides(_Outer(), ["inner.width=abc"])
    with pytest.raises(ConfigError, match="width must be positive"):
        apply_overrides(_Outer(), ["inner.width=-1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides(_Outer(), ["inner.width"])
    with pytest.raises(ConfigError, match="is a config section"):
        apply_overrides(_Outer(), ["inner=3"])


def test_a_rule_of_the_outer_config_names_every_nested_override_given():
    """An outer config refusing its sections' values names the overrides given, nested keys
    included (not "overrides rejected ()")."""
    with pytest.raises(ConfigError, match=re.escape(
            "overrides rejected (inner.width='9', inner.act='gelu'): _Checked: inner.width "
            "exceeds cap=8")):
        apply_overrides(_Checked(), ["inner.width=9", "inner.act=gelu"])
    with pytest.raises(ConfigError, match=re.escape("overrides rejected (cap='2', "
                                                    "inner.width='3')")):
        apply_overrides(_Checked(), ["cap=2", "inner.width=3"])


def test_list_valued_keys_are_checked_element_by_element_and_help_lists_every_key(capsys):
    with pytest.raises(ConfigError, match=r"methods='DAREx-q \(qv\)' is not allowed"):
        parse_cli(mod.STUDY.name, mod.make_config, ["methods=(DARE,DAREx-q (qv))"])
    assert main(mod.STUDY.name, mod.make_config, mod.run, ["--help"]) == 0
    out = capsys.readouterr().out
    for key in ("d_hidden = 256", "methods = (", "'WANDA'", "preset"):
        assert key in out
    with pytest.raises(ConfigError, match=r"methods\[0\]='bad' is not allowed"):
        mod.ControlledConfig(methods=("bad",))


@config
class _Shapes(Config):
    shapes: tuple[tuple[int, int, int], ...] = ((1, 2, 3),)
    pair: tuple[int, float] = (1, 0.5)


def test_overrides_parse_nested_and_fixed_length_tuples():
    cfg = apply_overrides(_Shapes(), ["shapes=((64,8,16),(4, 5, 6))", "pair=(3,2.5)"])
    assert cfg.shapes == ((64, 8, 16), (4, 5, 6)) and cfg.pair == (3, 2.5)
    with pytest.raises(ConfigError, match="expected 3 values, got 2"):
        apply_overrides(_Shapes(), ["shapes=((64,8),)"])
    with pytest.raises(ConfigError, match="expected an int"):
        apply_overrides(_Shapes(), ["shapes=((64,8,x),)"])


def test_from_json_takes_study_configs_only_from_imported_modules():
    cfg = study.make_config("quick")
    assert from_json(to_json(cfg)) == cfg  # the study module is imported: its class is taken
    text = to_json(cfg).replace("experiments.darex.storage", "experiments.not_a_study")
    with pytest.raises(ConfigError, match="refusing to build.*import the module"):
        from_json(text)


def test_help_lists_the_studys_variants(capsys):
    assert moee.STUDY.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "[variant=NAME]" in out and "variant minilm: model=minilm seeds=3" in out


def _numeric_keys(cfg, prefix=""):
    """The override keys of ``cfg``'s int and float fields (nested configs too)."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, Config):
            yield from _numeric_keys(v, f"{prefix}{f.name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{prefix}{f.name}"


def test_every_study_refuses_a_negative_number_before_it_runs():
    """No size, count, seed, coefficient or rate of any study takes -1 (only a mesh axis,
    where -1 means "all remaining devices"); each is refused with the key named."""
    import importlib

    checked = 0
    for module in STUDIES.values():
        cfg = importlib.import_module(module).STUDY.make_config("quick")
        for key in _numeric_keys(cfg):
            if key.rsplit(".", 1)[-1] == "mesh_data":
                continue
            with pytest.raises(ConfigError, match=key.rsplit(".", 1)[-1]):
                apply_overrides(cfg, [f"{key}=-1"])
            checked += 1
    assert checked > 500


def test_every_study_refuses_a_seed_a_jax_key_cannot_tell_from_a_smaller_one():
    """A JAX key keeps a seed's low 32 bits: seed 2**32 ran as seed 0, the same run under
    another name (paired seeds would pair a run with itself)."""
    import importlib

    import jax

    assert (jax.random.key_data(jax.random.key(2**32)) == jax.random.key_data(
        jax.random.key(0))).all()  # why: the aliasing this refuses
    checked = 0
    for module in STUDIES.values():
        cfg = importlib.import_module(module).STUDY.make_config("quick")
        for key in _numeric_keys(cfg):
            if "seed" in key.rsplit(".", 1)[-1]:
                with pytest.raises(ConfigError, match=r"2\*\*32"):
                    apply_overrides(cfg, [f"{key}={2**32}"])
                if unread_reason(cfg, key) is None:  # else refused as unread
                    apply_overrides(cfg, [f"{key}={2**32 - 1}"])
                checked += 1
    assert checked > 20
    with pytest.raises(ConfigError, match=r"2\*\*32"):
        TrainConfig(seed=2**32)
    with pytest.raises(ValueError, match=r"2\*\*32"):
        dare_updates(0.5, 2**32)


@pytest.mark.parametrize("override, why", [
    ("n_test=0", "n_test=0: must be >= 1"),                      # moe_kd
    ("seeds=0", "seeds=0: must be >= 1 (the number of seeds)"),  # every paired study
    ("kd.kd_ratio=1.5", "kd_ratio=1.5: must lie in [0, 1]"),
    ("upcycle.sm_rate=2.0", "sm_rate=2.0: must lie in [0, 1]"),
    ("upcycle.lm_rank=0", "lm_rank=0: must be >= 1"),
])
def test_a_count_of_zero_or_a_rate_past_one_is_refused(override, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        apply_overrides(moe_kd.make_config("quick"), [override])


def test_a_count_whose_zero_means_none_takes_zero():
    """``lora_rank=0`` skips the controlled study's LoRA table (and its refusal of an empty
    ``lora_ps`` names it as the fix): the ``_rank`` naming rule (>= 1) gives way to it."""
    cfg = apply_overrides(mod.make_config("quick"), ["lora_rank=0", "lora_ps=()"])
    assert cfg.lora_rank == 0
    with pytest.raises(ConfigError, match=re.escape("lora_rank=-1: must be >= 0")):
        apply_overrides(mod.make_config("quick"), ["lora_rank=-1"])


@pytest.mark.parametrize("module, override, why", [
    ("experiments.extraction.moee", "vit.patch_size=5", "a positive multiple of patch_size=5"),
    ("experiments.extraction.moee", "minilm.seq_len=600", "exceeds MiniLM's 512 positions"),
    ("experiments.darex.encoder", "substrate.n_heads=3", "ByteEncoderTaskConfig"),
    ("experiments.ders.bench", "n_heads=3", "d_model=512 is not divisible by n_heads=3"),
    ("experiments.ders.bench", "lm_rank=1000", "lm_rank=1000 exceeds min(d_in, d_out) = 512"),
    ("experiments.ders.upcycling", "top_k=10", "top_k=10 must be in [1, n_experts=4]"),
    ("experiments.ders.upcycling", "frozen_sm_rate=1.0", "frozen_sm_rate=1.0 must be in [0, 1)"),
    ("experiments.blockffn.speculative", "grow.n_experts=24",
     "grow.n_experts=24 must be a multiple of target.n_experts=16"),
    ("experiments.blockffn.baselines", "model.n_experts=1",
     "model.n_experts=1: the baselines need 2 or more"),
    ("experiments.benchmarks.dispatch", "block_top_k=9", "block_top_k=9 must be <= block_"),
    ("experiments.darex.storage", "delta_std=0", "delta_std=0.0 must be > 0"),
])
def test_a_config_that_would_build_a_bad_model_is_refused(module, override, why):
    import importlib

    cfg = importlib.import_module(module).STUDY.make_config("quick")
    with pytest.raises(ConfigError, match=re.escape(why)):
        apply_overrides(cfg, [override])


@pytest.mark.parametrize("module, override", [
    ("experiments.darex.controlled", "l2_weight=0"),
    ("experiments.darex.controlled", "l1_weight=0"),
    ("experiments.darex.controlled", "l2_sweep=(0.0,)"),
    ("experiments.darex.decoder", "l2_weight=0"),
    ("experiments.darex.encoder", "l2_weight=0"),
    ("experiments.darex.encoder", "l1_weight=0"),
    ("experiments.blockffn.ablations", "model.cs_lam0=0"),
    ("experiments.kd.moe_kd", "kd.kd_ratio=0"),
    ("experiments.blockffn.ablations", "l1_coef=0"),
    ("experiments.blockffn.ablations", "entropy_coef=0"),
    ("experiments.blockffn.baselines", "model.remoe_lam0=0"),
])
def test_an_arm_without_its_regulariser_is_refused(module, override):
    """AdamR at lambda 0 is the Adam(W) run it is compared with, AL+CS or ReMoE from a
    coefficient of 0 never apply their penalty, AL+L1 or AL+Ent at weight 0 are AL, and KD
    at kd_ratio 0 is SFT: judged, a claim about the regulariser (or the teacher) would read
    from an arm without it. Weight 0 beside a positive one stays a sweep's reference
    point."""
    import importlib

    cfg = importlib.import_module(module).STUDY.make_config("quick")
    with pytest.raises(ConfigError, match=r"(must be > 0(:| \().*(Adam|never acts))|"
                                          r"makes AL\+(L1|Ent) the setting AL|"
                                          r"leaves the teacher out of KD's loss"):
        apply_overrides(cfg, [override])
    if module.endswith("controlled"):
        assert apply_overrides(cfg, ["l2_sweep=(0.0,0.1)"]).l2_sweep == (0.0, 0.1)


@pytest.mark.parametrize("module, override", [
    ("experiments.darex.controlled", "ps=(0.9,0.99,0.9)"),
    ("experiments.kd.moe_kd", "methods=(kd,gkd,kd)"),
    ("experiments.blockffn.speculative", "draft_lens=(4,4)"),
    ("experiments.ders.compression", "bits=(2,4,2)"),
])
def test_a_sweep_that_names_a_value_twice_is_refused(module, override):
    import importlib

    cfg = importlib.import_module(module).STUDY.make_config("quick")
    with pytest.raises(ConfigError, match=r"repeats .*: give each value once"):
        apply_overrides(cfg, [override])
    assert _Outer(layers=(0, 2)).layers == (0, 2)
    with pytest.raises(ConfigError, match=r"_Outer.layers=\(2, 2\): repeats 2"):
        _Outer(layers=(2, 2))


BRANCHES = [  # (study, the choice, a key that choice leaves unread, a key it reads)
    ("moee", "model=minilm", "vit.train.lr=0.01", "minilm.train.lr=0.01"),
    ("moee", "model=vit", "minilm.train.lr=0.01", "vit.train.lr=0.01"),
    ("bench_extracted", "model=vit", "minilm.train.lr=0.01", "vit.train.lr=0.01"),
    ("bench_extracted", "model=none", "rows=(8,)", "keep=0.5"),
    ("bench_extracted", "synthetic=false", "keep=0.5", "rows=(8,)"),
    ("moe_kd", "model=dense_lm_chat", "dense_lm_prose.train.lr=0.01",
     "dense_lm_chat.train.lr=0.01"),
    ("moe_kd", "model=smollm2_135m", "dense_lm_chat.train.lr=0.01", "n_train=64"),
    ("darex_decoder", "model=smollm2_135m", "substrate.train.lr=0.01", "q_num=3"),
    ("darex_encoder", "model=minilm", "substrate.train.lr=0.01", "seq_len=16"),
    ("darex_encoder", "model=substrate", "seq_len=16", "substrate.train.lr=0.01"),
    ("darex_storage", "source=smollm2_shapes methods=(DARE,)", "finetune.lr=0.01",
     "delta_std=0.01"),
    ("darex_storage", "source=mlp timing_tree=none", "delta_std=0.01", "finetune.lr=0.01"),
    ("darex_storage", "timing_tree=none", "timing_repeats=2", "ps=(0.5,)"),
    ("bench_speculative", "drafts.distilled=false drafts.self_distilled=false",
     "drafts.distil.prompts=8", "drafts.self_layers=1"),
    ("bench_speculative", "profile=false", "profile_top=3", "n_prompts=2"),
    ("bench_speculative", "grow.extra_layers=0", "grow.d_expert=64", "n_prompts=4"),
    ("bench_dispatch", "block_paths=()", "block_repeats=2", "steps=2"),
    ("bench_dispatch", "profile=false", "profile_top=3", "steps=2"),
    ("blockffn_baselines", "sizes=(small,)", "xl_n_layers=2", "small_d_model=32"),
    ("blockffn_baselines", "models=(TopK,)", "grin_k=two", "sizes=(small,)"),
    ("ders_upcycling", "substrate.source=substrates", "substrate.pretrained.train.lr=0.01",
     "substrate.prefinetuned.train.lr=0.01"),
    ("ders_compression", "substrate.source=substrates scenarios=(finetuned,)",
     "substrate.pretrained.train.lr=0.01", "substrate.prefinetuned.train.lr=0.01"),
    ("ders_compression", "substrate.source=smollm2", "substrate.prefinetuned.train.lr=0.01",
     "substrate.seq_len=128"),
]


@pytest.mark.parametrize("name, choice, unread, read", BRANCHES)
def test_a_key_the_studys_choice_leaves_unread_is_refused(name, choice, unread, read, tmp_path):
    """A section or value only another choice reads (vit.* under model=minilm, seq_len of the
    MiniLM path under model=substrate) was taken and recorded in the run's config while the
    run ignored it. Refused with the overrides, naming the key and the choice that reads it,
    in either order and in each preset that takes the choice; the command line exits 2 before
    writing anything."""
    import importlib

    study = importlib.import_module({**STUDIES, **TOOLS}[name]).STUDY
    choice = choice.split()
    key, _, value = unread.partition("=")
    checked = 0
    for preset in ("quick", "full"):
        cfg = study.make_config(preset)
        try:
            apply_overrides(cfg, choice)
        except ConfigError:  # a choice this preset cannot take (moe_kd's full preset: chat)
            continue
        checked += 1
        for given in ([*choice, unread], [unread, *choice]):
            with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r}: ") + (
                    r"[\w.]+ is read (only with .*\(this config has |by no part of this "
                    r"study).*recorded but not run")):
                apply_overrides(cfg, given)
        apply_overrides(cfg, [*choice, read])
    assert checked
    assert study.main([*choice, unread, f"out={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()


def test_unread_fields_of_a_choice_follow_the_choice():
    @config
    class _Choice(Config):
        kind: Literal["a", "b", "c"] = "a"
        a: _Inner = _Inner()
        b_width: int = 3
        shared: int = 1

        def unread_fields(self):
            return self._read_only_with("kind", {"a": ("a", "c"), "b_width": ("b",)})

    assert _Choice().unread_fields() == {
        "b_width": "read only with kind='b' (this config has kind='a')"}
    assert set(_Choice(kind="b").unread_fields()) == {"a"}
    assert _Choice(kind="c").unread_fields()["b_width"].startswith("read only with kind='b'")
    assert apply_overrides(_Choice(), ["a.width=2", "shared=5"]).a.width == 2
    with pytest.raises(ConfigError, match=re.escape(
            "a.width='2': a is read only with kind='a' or 'c' (this config has kind='b')")):
        apply_overrides(_Choice(), ["kind=b", "a.width=2"])
    assert apply_overrides(_Choice(), ["kind=b", "b_width=4"]).b_width == 4



def test_is_integer_and_is_real_take_numbers_and_refuse_bools_and_containers():
    for v in (0, 3, np.int64(2), 0.5, np.float32(1.5), jnp.asarray(0.1), np.asarray(2)):
        assert is_real(v), v
    for v in (True, np.bool_(True), "1", None, [1.0], np.ones(2), jnp.ones(1),
              jnp.asarray(True), 1 + 2j, {"w": 1.0}):
        assert not is_real(v), v
    assert is_integer(3) and is_integer(np.int32(3))
    assert not any(is_integer(v) for v in (True, 3.0, "3", np.float32(3)))
