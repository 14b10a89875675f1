"""Hugging Face Mixtral checkpoints in and out (moejax.io.hf_moe), against transformers' own
logits committed beside tiny checkpoints it made (scripts/make_hf_moe_fixtures.py): the
import equals transformers' forward on every dispatch path, an exported model loads in
transformers with the same logits, a round trip is bit-identical, and what the layers cannot
reproduce is refused in one line naming the key."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.io._common import WeightFileError, flat_params
from moejax.io.hf_moe import load_hf_moe, save_hf_moe
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.slots import layer_pattern

FIXTURES = Path(__file__).parent / "fixtures" / "hf_moe"
MIXTRAL = FIXTURES / "mixtral"
PROMPTS = np.load(MIXTRAL / "prompts.npy")


def _logits(model):
    out, _ = model(jnp.asarray(PROMPTS), train=False)
    return np.asarray(out)


@pytest.mark.parametrize("dispatch", ["auto", "dense", "capacity", "grouped", "ragged",
                                      "bucketed", "host"])
def test_mixtral_import_equals_transformers(dispatch):
    model = load_hf_moe(MIXTRAL, dispatch=dispatch)
    want = np.load(MIXTRAL / "logits.npy")
    np.testing.assert_allclose(_logits(model), want, rtol=0, atol=1e-5)
    assert model.cfg.ffn_slots[0].n_experts == 4 and model.cfg.ffn_slots[0].top_k == 2


def test_an_exported_model_loads_in_transformers_with_the_same_logits():
    """tests/fixtures/hf_moe/exported was written by save_hf_moe from a seed-0 model
    (scripts/export_hf_moe_fixture.py) and read by transformers, whose logits are beside it;
    today's seed-0 model is the one exported (to float rounding: XLA's flags in the suite
    differ from the script's)."""
    import importlib.util

    exported = FIXTURES / "exported"
    model = load_hf_moe(exported)
    want = np.load(exported / "transformers_logits.npy")
    np.testing.assert_allclose(_logits(model), want, rtol=0, atol=1e-5)
    spec = importlib.util.spec_from_file_location(
        "export_fixture", Path(__file__).parents[1] / "scripts" / "export_hf_moe_fixture.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    again = DecoderLM(script.CFG, rngs=nnx.Rngs(0))
    for k, v in flat_params(again).items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(flat_params(model)[k]), atol=1e-6)


def test_round_trip_is_bit_identical(tmp_path):
    model = load_hf_moe(MIXTRAL)
    save_hf_moe(model, tmp_path / "out")
    back = load_hf_moe(tmp_path / "out")
    assert back.cfg == model.cfg
    a, b = flat_params(model), flat_params(back)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4


def _edited(tmp_path, **changes):
    d = tmp_path / "edited"
    shutil.copytree(MIXTRAL, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("change, words", [
    ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe': needs a sigmoid-gated shared"),
    ({"model_type": "olmoe"}, "model_type='olmoe': needs q/k RMSNorms"),
    ({"model_type": "llama"}, "only 'mixtral' is read"),
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"num_local_experts": 8}, "experts"),
])
def test_what_the_layers_cannot_reproduce_is_refused(tmp_path, change, words):
    with pytest.raises(WeightFileError) as e:
        load_hf_moe(_edited(tmp_path, **change))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_models_without_a_mixtral_layout_are_not_exported(tmp_path):
    blockffn = BlockFFNConfig(n_experts=4, d_expert=8)
    cfg = DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
                        ffn_slots=layer_pattern(2, blockffn, blockffn, every=1))
    with pytest.raises(ValueError, match="no Mixtral layout: every block's FFN must be"):
        save_hf_moe(DecoderLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "x")
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_bf16_stays_bf16(tmp_path):
    """A bfloat16 checkpoint (config dtype and BF16 tensors) loads as bfloat16 parameters and
    exports as BF16 again, bit for bit."""
    import ml_dtypes

    from moejax.io.safetensors_io import export_params, read_safetensors

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


def test_a_sharded_checkpoint_reads_the_same(tmp_path):
    """model.safetensors.index.json and its shards (a layer's experts split across two)
    give the same model as the single file."""
    from moejax.io.safetensors_io import export_params, read_safetensors

    tensors, _ = read_safetensors(MIXTRAL / "model.safetensors")
    names = sorted(tensors)
    first = [k for k in names if ".experts.0." in k or ".experts.2." in k or "embed" in k]
    halves = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": [k for k in names if k not in first]}
    d = tmp_path / "sharded"
    d.mkdir()
    for shard, keys in halves.items():
        export_params({k: tensors[k] for k in keys}, d / shard, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    shutil.copy(MIXTRAL / "config.json", d / "config.json")
    a, b = flat_params(load_hf_moe(d)), flat_params(load_hf_moe(MIXTRAL))
    for k in b:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
