"""Hugging Face MoE checkpoints in and out (moejax.io.hf_moe: Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE), against transformers' own logits committed beside tiny checkpoints it made
(scripts/make_hf_moe_fixtures.py): the import equals transformers' forward on every dispatch
path, an exported model loads in transformers with the same logits, a round trip is
bit-identical, and what the layers cannot reproduce is refused in one line naming the key
(checkpoint files, shards and the tokenizer: test_io_hf_moe_files.py)."""

import importlib.util
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moejax.files import UnusableDirError
from moejax.io._common import WeightFileError, flat_params
from moejax.io.hf_moe import hf_moe_config, load_hf_moe
from moejax.io.hf_moe_save import _family_of, save_hf_moe
from moejax.io.safetensors_io import export_params, read_safetensors
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern

FIXTURES = Path(__file__).parent / "fixtures" / "hf_moe"
MIXTRAL = FIXTURES / "mixtral"
PROMPTS = np.load(MIXTRAL / "prompts.npy")


def _assert_same_model(a_model, b_model):
    """The same config and every parameter bit for bit."""
    assert a_model.cfg == b_model.cfg
    a, b = flat_params(a_model), flat_params(b_model)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


def _logits(model):
    out, _ = model(jnp.asarray(PROMPTS), train=False)
    return np.asarray(out)


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
DISPATCHES = ("auto", "dense", "capacity", "grouped", "ragged", "bucketed", "host")


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_import_equals_transformers(family, dispatch):
    d = FIXTURES / family
    model = load_hf_moe(d, dispatch=dispatch)
    out, _ = model(jnp.asarray(np.load(d / "prompts.npy")), train=False)
    np.testing.assert_allclose(np.asarray(out), np.load(d / "logits.npy"), rtol=0, atol=1e-5)
    assert model.cfg.ffn_slots[0].n_experts == 4 and model.cfg.ffn_slots[0].top_k == 2


def test_each_familys_layers_are_read_from_its_config():
    """What the fixtures' configs set: Qwen2-MoE's gated shared expert, q/k/v biases and raw
    top-k weights; Qwen3-MoE's per-head q/k norms, its own head_dim and renormalised
    weights; OLMoE's whole-projection q/k norms and raw weights."""
    cfgs = {f: load_hf_moe(FIXTURES / f).cfg for f in FAMILIES}
    moe = {f: c.ffn_slots[0] for f, c in cfgs.items()}
    assert (moe["qwen2_moe"].n_shared_experts, moe["qwen2_moe"].d_shared,
            moe["qwen2_moe"].shared_gate) == (1, 40, True)
    assert [moe[f].renormalize for f in FAMILIES] == [True, False, True, False]
    assert [cfgs[f].qk_norm for f in FAMILIES] == ["none", "none", "head", "full"]
    assert [cfgs[f].qkv_bias for f in FAMILIES] == [False, True, False, False]
    assert cfgs["qwen3_moe"].head_dim == 12 and moe["qwen3_moe"].d_expert == 24


@pytest.mark.parametrize("family", FAMILIES[1:])
def test_an_exported_family_loads_in_transformers_with_the_same_logits(family, tmp_path):
    """The imported fixture saved again (its family's layout) is what transformers read
    (exported_checks/<family>: the config.json it read and its logits, by the fixture script's
    --check): today's export writes that config, a round trip is bit-identical, and
    transformers' logits of the export equal moejax's."""
    model = load_hf_moe(FIXTURES / family)
    save_hf_moe(model, tmp_path / "out")
    checked = FIXTURES / "exported_checks" / family
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (checked / "config.json").read_text())
    back = load_hf_moe(tmp_path / "out")
    _assert_same_model(back, model)
    out, _ = back(jnp.asarray(np.load(FIXTURES / family / "prompts.npy")), train=False)
    np.testing.assert_allclose(np.asarray(out), np.load(checked / "transformers_logits.npy"),
                               rtol=0, atol=1e-5)


def test_an_exported_model_loads_in_transformers_with_the_same_logits():
    """tests/fixtures/hf_moe/exported was written by save_hf_moe from a seed-0 model
    (scripts/export_hf_moe_fixture.py) and read by transformers, whose logits are beside it;
    today's seed-0 model is the one exported (to float rounding: XLA's flags in the suite
    differ from the script's)."""
    exported = FIXTURES / "exported"
    model = load_hf_moe(exported)
    want = np.load(exported / "transformers_logits.npy")
    np.testing.assert_allclose(_logits(model), want, rtol=0, atol=1e-5)
    spec = importlib.util.spec_from_file_location(
        "export_fixture", Path(__file__).parents[1] / "scripts" / "export_hf_moe_fixture.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    again = DecoderLM(script.CFG, rngs=nnx.Rngs(0))
    for k, v in flat_params(again).items():  # a few float32 ulps: jaxlibs round the init apart
        np.testing.assert_allclose(np.asarray(v), np.asarray(flat_params(model)[k]), rtol=1e-5,
                                   atol=1e-6)


def test_round_trip_is_bit_identical(tmp_path):
    model = load_hf_moe(MIXTRAL)
    save_hf_moe(model, tmp_path / "out")
    back = load_hf_moe(tmp_path / "out")
    _assert_same_model(back, model)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4


def _edited(tmp_path, family="mixtral", **changes):
    d = tmp_path / "edited"
    shutil.copytree(FIXTURES / family, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("change, words", [
    ({"model_type": "llama"}, "model_type='llama': moejax reads mixtral, qwen2_moe"),
    ({"model_type": "qwen2_moe"}, "has no 'num_experts', which a qwen2_moe config needs"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"num_local_experts": 8}, "gate.weight' is float32 (4, 32); the config's is (8, 32)"),
])
def test_what_the_layers_cannot_reproduce_is_refused(tmp_path, change, words):
    with pytest.raises(WeightFileError) as e:
        load_hf_moe(_edited(tmp_path, "mixtral", **change))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("family, change, words", [
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("olmoe", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling="),
])
def test_each_familys_unsupported_options_are_refused(tmp_path, family, change, words):
    with pytest.raises(WeightFileError) as e:
        load_hf_moe(_edited(tmp_path, family, **change))
    assert words in str(e.value) and "\n" not in str(e.value)


def _fixture_config(family="mixtral", drop=(), **changes) -> dict:
    c = json.loads((FIXTURES / family / "config.json").read_text())
    for key in drop:
        del c[key]
    return {**c, **changes}


@pytest.mark.parametrize("changes, base", [
    ({"rope_theta": 5e5}, 5e5),  # transformers 4
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     5e5),  # transformers 5
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     5e5),  # both: transformers 5 takes rope_parameters'
    ({"rope_scaling": {"rope_type": "default", "rope_theta": 3e5}}, 3e5),  # its older name
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default"}}, 1e6),  # Mixtral's
])
def test_the_rope_base_is_read_where_transformers_4_and_5_write_it(changes, base):
    assert hf_moe_config(_fixture_config(**changes)).rope_base == base


def test_a_transformers_5_config_imports_with_transformers_logits(tmp_path):
    """The fixture's RoPE base moved where transformers 5 writes it (a Qwen family's default
    base is the fixture's, so Mixtral, whose default is 1e6, is the case that can fail)."""
    d = _edited(tmp_path, "mixtral", rope_theta=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    np.testing.assert_allclose(_logits(load_hf_moe(d)), np.load(MIXTRAL / "logits.npy"),
                               rtol=0, atol=1e-5)


# transformers' config classes' defaults: (RoPE base, RMSNorm epsilon, max positions, router
# aux loss coefficient, key/value heads; None: as many as the query heads)
_HF_DEFAULTS = {"mixtral": (1e6, 1e-5, 131072, 0.001, 8),
                "qwen2_moe": (1e4, 1e-6, 32768, 0.001, 16),
                "qwen3_moe": (1e4, 1e-6, 32768, 0.001, 4),
                "olmoe": (1e4, 1e-5, 4096, 0.01, None)}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_key_the_config_leaves_out_takes_transformers_default(family):
    keys = ("rope_theta", "rms_norm_eps", "max_position_embeddings", "router_aux_loss_coef",
            "num_key_value_heads")
    cfg = hf_moe_config(_fixture_config(family, drop=keys, num_attention_heads=32, head_dim=4))
    got = (cfg.rope_base, cfg.norm_eps, cfg.max_seq_len, cfg.ffn_slots[0].balance_coef,
           cfg.n_kv_heads)
    theta, eps, positions, coef, kv = _HF_DEFAULTS[family]
    assert got == (theta, eps, positions, coef, kv or 32)


def test_what_a_config_sets_reaches_the_layers():
    """q/k/v biases off in a Qwen2-MoE config, tied embeddings, transformers' default of
    norm_topk_prob (False) where the key is left out, and a capacity path that drops no
    token (capacity for every expert's share of all tokens)."""
    qwen2 = _fixture_config("qwen2_moe", drop=("norm_topk_prob",), qkv_bias=False,
                            tie_word_embeddings=True)
    cfg = hf_moe_config(qwen2)
    assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.ffn_slots[0].renormalize) == (
        False, True, False)
    assert hf_moe_config(_fixture_config(), dispatch="capacity").ffn_slots[0].capacity == 4.0


@pytest.mark.parametrize("changes, words", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu': the experts are SwiGLU"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters={'rope_type': 'yarn'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "one plain RoPE for every layer only"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "RoPE over the whole head only"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear'"),
])
def test_rope_other_than_plain_is_refused(changes, words):
    with pytest.raises(WeightFileError) as e:
        hf_moe_config(_fixture_config(**changes))
    assert words in str(e.value) and "\n" not in str(e.value)


def _moe_decoder(**moe_kw):
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=8, **moe_kw)
    return DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
                         ffn_slots=layer_pattern(2, moe, moe, every=1))


@pytest.mark.parametrize("cfg, words", [
    (DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, ffn_slots=layer_pattern(
        2, BlockFFNConfig(n_experts=4, d_expert=8), BlockFFNConfig(n_experts=4, d_expert=8),
        every=1)), "every block's FFN must be a plain MoE"),
    (_moe_decoder(renormalize=False), "Mixtral renormalises"),
    (_moe_decoder(n_shared_experts=1), "no family has these layers"),
    (_moe_decoder().replace(qk_norm="head", qkv_bias=True), "no family has these layers"),
    (_moe_decoder(universal_ffn=True), "no family has a universal FFN"),
    (_moe_decoder().replace(ffn_slots=(MoEConfig(n_experts=4, top_k=2, d_expert=8),
                                       MoEConfig(n_experts=4, top_k=1, d_expert=8))),
     "every block's MoE must have the same config"),
])
def test_models_without_a_hugging_face_layout_are_not_exported(tmp_path, cfg, words):
    with pytest.raises(ValueError, match=words):
        save_hf_moe(DecoderLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "x")
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_a_plain_moe_exports_as_mixtral_and_qwen_layers_as_their_family(tmp_path):
    assert _family_of(_moe_decoder()) == "mixtral"
    assert _family_of(_moe_decoder(n_shared_experts=1, shared_gate=True)) == "qwen2_moe"
    assert _family_of(_moe_decoder(n_shared_experts=1, shared_gate=True).replace(
        qkv_bias=True)) == "qwen2_moe"
    assert _family_of(_moe_decoder().replace(qk_norm="head")) == "qwen3_moe"
    assert _family_of(_moe_decoder(renormalize=False).replace(qk_norm="full")) == "olmoe"


def test_bf16_stays_bf16(tmp_path):
    """A bfloat16 checkpoint (config dtype and BF16 tensors) loads as bfloat16 parameters and
    exports as BF16 again, bit for bit."""

    d = tmp_path / "bf16"
    d.mkdir()
    tensors, _ = read_safetensors(MIXTRAL / "model.safetensors")
    export_params({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
                  d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((MIXTRAL / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    model = load_hf_moe(d)
    assert {np.asarray(v).dtype for v in flat_params(model).values()} == {
        np.dtype(ml_dtypes.bfloat16)}
    np.testing.assert_allclose(_logits(model).astype(np.float32),
                               np.load(MIXTRAL / "logits.npy"), atol=0.05)
    save_hf_moe(model, tmp_path / "again")
    back, _ = read_safetensors(tmp_path / "again" / "model.safetensors")
    for k, v in back.items():
        assert v.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(v.view(np.uint16), tensors[k].astype(
            ml_dtypes.bfloat16).view(np.uint16))


def test_an_export_into_a_file_is_refused_in_one_line(tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    model = DecoderLM(_moe_decoder(), rngs=nnx.Rngs(0))
    for where, words in ((a_file, "taken is a file, not a directory"),
                         (a_file / "sub", "cannot create .*sub")):
        with pytest.raises(UnusableDirError, match=f"save_hf_moe: .*{words}.*Fix: save into"):
            save_hf_moe(model, where)
    assert a_file.read_text() == "x"
