"""Hugging Face MoE checkpoints as files (moejax.io.hf_moe): a sharded checkpoint reads as the
single file, a directory holding a file and shards reads as transformers does, bad
checkpoints are refused in one line naming file and tensor, tensors stream into their sharded
places, the tokenizer travels with an export, and a missing or unreadable config is refused
with its fix."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from moejax.io._common import WeightFileError, flat_params
from moejax.io.hf_moe import load_hf_moe
from moejax.io.hf_moe_save import save_hf_moe
from moejax.io.hf_tokenizer import tokenizer_from_hf_dir
from moejax.io.safetensors_io import export_params, read_safetensors
from tests.devices import run_on_devices

FIXTURES = Path(__file__).parent / "fixtures" / "hf_moe"
MIXTRAL = FIXTURES / "mixtral"


def test_a_sharded_checkpoint_reads_the_same(tmp_path):
    """model.safetensors.index.json and its shards (a layer's experts split across two)
    give the same model as the single file."""
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


def _sharded(tmp_path, family="qwen3_moe", edit=None):
    """``family``'s fixture as two shards and an index; ``edit(tensors_by_shard, index)``
    changes them before they are written."""
    tensors, _ = read_safetensors(FIXTURES / family / "model.safetensors")
    names = sorted(tensors)
    first = [k for k in names if ".experts.1." in k or "embed" in k]
    shards = {"a.safetensors": {k: tensors[k] for k in first},
              "b.safetensors": {k: tensors[k] for k in names if k not in first}}
    index = {"weight_map": {k: shard for shard, ts in shards.items() for k in ts}}
    if edit is not None:
        edit(shards, index)
    d = tmp_path / "sharded"
    d.mkdir()
    for shard, ts in shards.items():
        export_params(ts, d / shard, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(FIXTURES / family / "config.json", d / "config.json")
    return d


def test_a_directory_with_one_file_and_shards_reads_as_transformers_does(tmp_path):
    """transformers reads model.safetensors before a shard index; so does load_hf_moe (it
    read the index: saved over an imported sharded checkpoint, it gave the old weights).
    save_hf_moe refuses such a directory before writing anything."""
    d = _sharded(tmp_path)
    model = load_hf_moe(d)
    nnx.update(model, jax.tree.map(lambda x: 2 * x, nnx.state(model, nnx.Param)))
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(ValueError, match="holds a sharded checkpoint.*new directory"):
        save_hf_moe(model, d)
    assert sorted(p.name for p in d.iterdir()) == before
    save_hf_moe(model, tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", d / "model.safetensors")
    want, got = flat_params(model), flat_params(load_hf_moe(d))
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def _dup(shards, index):
    k = next(iter(shards["b.safetensors"]))
    shards["a.safetensors"][k] = shards["b.safetensors"][k]


def _outside(shards, index):
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"


def _missing(shards, index):
    index["weight_map"]["model.norm.weight"] = "c.safetensors"


def _shape(shards, index):
    k = next(k for k in shards["a.safetensors"] if ".experts.1.up_proj" in k)
    shards["a.safetensors"][k] = shards["a.safetensors"][k][:, :-1]


def _int(shards, index):
    k = next(k for k in shards["a.safetensors"] if ".experts.1.up_proj" in k)
    shards["a.safetensors"][k] = shards["a.safetensors"][k].astype(np.int32)


def _foreign_prefix(shards, index):
    k = next(k for k in shards["b.safetensors"] if k.startswith("model.layers.0.input_"))
    new = k.replace("model.layers", "decoder.layers")
    shards["b.safetensors"][new] = shards["b.safetensors"].pop(k)
    index["weight_map"][new] = index["weight_map"].pop(k)


def _expert_past_the_count(shards, index):
    k = next(k for k in shards["a.safetensors"] if ".experts.1.up_proj" in k)
    new = k.replace(".experts.1.", ".experts.4.")  # of 4 experts: 0..3
    shards["a.safetensors"][new] = shards["a.safetensors"].pop(k)
    index["weight_map"][new] = index["weight_map"].pop(k)


def _drop_norm(shards, index):
    k = next(k for k in shards["b.safetensors"] if "q_norm" in k)
    del shards["b.safetensors"][k]
    del index["weight_map"][k]


@pytest.mark.parametrize("edit, words", [
    (None, None),
    (_dup, "appears twice (also in"),
    (_outside, "names shard '../elsewhere.safetensors', outside its directory"),
    (_missing, "names shard 'c.safetensors', which is missing"),
    (_shape, "up_proj.weight' is float32 (24, 31); the config's is (24, 32) floats"),
    (_int, "is int32"),
    (_drop_norm, "missing tensors"),
    (_foreign_prefix, "unexpected tensor 'decoder.layers.0.input_layernorm.weight'"),
    (_expert_past_the_count, "names expert 4 of 4"),
])
def test_bad_checkpoints_are_refused_in_one_line_naming_file_and_tensor(tmp_path, edit, words):
    """A sharded Qwen3-MoE checkpoint reads as the single file; each fault (duplicate tensor,
    a shard outside the directory or missing, an expert of the wrong shape or dtype, a tensor
    the config needs but the files lack) is refused in one line and returns no model."""
    d = _sharded(tmp_path, edit=edit)
    if words is None:
        a, b = flat_params(load_hf_moe(d)), flat_params(load_hf_moe(FIXTURES / "qwen3_moe"))
        for k in b:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        return
    with pytest.raises(WeightFileError) as e:
        load_hf_moe(d)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


_SHARDED_SCRIPT = """
root = ROOT
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from moejax.io.hf_moe import hf_moe_config, load_hf_moe
from moejax.io._common import flat_params

d = Path(root) / "tests" / "fixtures" / "hf_moe" / "qwen3_moe"
from moejax.train.mesh import make_mesh
mesh = make_mesh(data=1, expert=2)  # the training loop's mesh
asked = []

def shardings(name, shape):
    asked.append((name, shape))
    return NamedSharding(mesh, P("expert") if "/experts/" in name else P())

model = load_hf_moe(d, dispatch="dense", shardings=shardings)
params = flat_params(model)
up = params["blocks/0/ffn/experts/w_up"]
assert up.sharding.spec == P("expert") and len(up.sharding.device_set) == 2, up.sharding
assert {s.data.shape for s in up.addressable_shards} == {(2, 32, 24)}
assert params["embed"].sharding.spec == P() and len(params["embed"].sharding.device_set) == 2
assert len(asked) == len(params) and ("blocks/1/ffn/experts/w_down", (4, 24, 32)) in asked
out, _ = model(jnp.asarray(np.load(d / "prompts.npy")), train=False)
np.testing.assert_allclose(np.asarray(out), np.load(d / "logits.npy"), rtol=0, atol=1e-5)
print("expert shards", sorted({s.data.shape for s in up.addressable_shards}),
      "on", len(up.sharding.device_set), "devices")
print("OK")
"""


@pytest.mark.slow
def test_tensors_stream_into_their_sharded_places():
    """On 2 devices, ``shardings`` puts each expert stack split over an expert axis and every
    other tensor replicated as it is read; the model equals transformers' forward."""
    out = run_on_devices(_SHARDED_SCRIPT, n_devices=2, timeout=300)
    assert "expert shards [(2, 32, 24)] on 2 devices" in out, out[-2000:]


def test_the_tokenizer_travels_with_the_export(tmp_path):
    """The directory's tokenizer.json and the ids its config names come back from an export
    that is given the tokenizer."""
    tok = tokenizer_from_hf_dir(FIXTURES / "olmoe")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 96)  # pad: eos
    assert tok.decode(tok.encode("Hi there!")) == "Hi there!"
    for bad in (tok.encode("Hi") + 0.7, np.array([-1])):  # decoded as "Hi"; an OverflowError
        with pytest.raises(ValueError, match="give integer token ids >= 0"):
            tok.decode(bad)
    with pytest.raises(ValueError, match="no texts"):
        tok.encode_padded([])
    save_hf_moe(load_hf_moe(FIXTURES / "olmoe"), tmp_path / "out", tokenizer=tok)
    back = tokenizer_from_hf_dir(tmp_path / "out")
    assert back.fingerprint == tok.fingerprint and (back.bos_id, back.eos_id) == (1, 2)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    big = type("Tok", (), {"vocab_size": 97})()  # one token past the model's 96
    with pytest.raises(ValueError, match="the tokenizer has 97 tokens, more than"):
        save_hf_moe(load_hf_moe(FIXTURES / "olmoe"), tmp_path / "big", tokenizer=big)
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "olmoe", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 50279}))
    (bad / "generation_config.json").unlink()
    with pytest.raises(WeightFileError, match="eos_token_id=50279 is outside the tokenizer's"):
        tokenizer_from_hf_dir(bad)


def test_a_directory_holding_another_tokenizer_is_refused_before_anything_is_written(tmp_path):
    """A save that would leave another model's tokenizer files beside this model is refused
    (it left OLMoE's tokenizer.json beside a Qwen3-MoE saved without one, and
    tokenizer_from_hf_dir read the pair back as one model); a save with the tokenizer
    rewrites its own tokenizer.json and generation_config.json."""
    tok = tokenizer_from_hf_dir(FIXTURES / "olmoe")
    d = tmp_path / "out"
    save_hf_moe(load_hf_moe(FIXTURES / "olmoe"), d, tokenizer=tok)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

    def files(path):
        return {p.name: p.read_bytes() for p in path.iterdir()}

    before = files(d)
    qwen = load_hf_moe(FIXTURES / "qwen3_moe")
    with pytest.raises(ValueError, match=r"holds tokenizer.json, generation_config.json of "
                                         r"another tokenizer.*pass the model's tokenizer"):
        save_hf_moe(qwen, d)
    assert files(d) == before
    save_hf_moe(load_hf_moe(FIXTURES / "olmoe"), d, tokenizer=tok)  # its own files again
    assert files(d) == before
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURES / "qwen3_moe", copy)
    (copy / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    before = files(copy)
    with pytest.raises(ValueError, match=r"holds tokenizer_config.json of another tokenizer"
                                         r".*AutoTokenizer.*Fix: save into a new directory$"):
        save_hf_moe(load_hf_moe(FIXTURES / "olmoe"), copy, tokenizer=tok)
    assert files(copy) == before
    save_hf_moe(qwen, tmp_path / "bare")  # a new directory: no tokenizer files at all
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == [
        "config.json", "model.safetensors"]


def test_a_missing_or_unreadable_config_is_refused_with_its_fix(tmp_path):
    with pytest.raises(WeightFileError, match=r"config.json: no such file. Fix: give the "
                                              r"directory of a Hugging Face checkpoint"):
        load_hf_moe(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(WeightFileError, match=r"unreadable config.json \(JSONDecodeError: .*"
                                              r"Fix: copy the checkpoint's config.json again"):
        load_hf_moe(tmp_path)
    with pytest.raises(WeightFileError, match=r"config.json: a file, not a checkpoint "
                                              r"directory. Fix: give the directory"):
        load_hf_moe(tmp_path / "config.json")  # the file given for its directory
