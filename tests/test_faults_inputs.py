"""Fault injection on what a run reads besides its checkpoints: token and class ids past the
model, damaged or crafted delta files, corrupted compressed DeRS checkpoints, weight imports,
tokenizer ids, configs and a study's overrides; each named in a clear error before any
compute, nothing decoded into wrong values; and the checksums' properties."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.blockffn import speculative
from experiments.darex import encoder
from experiments.ders import compression as ders_compression
from experiments.ders import upcycling
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.data.batches import ClassificationBatches
from moejax.data.tokenizer import ByteTokenizer
from moejax.delta import storage
from moejax.delta.quant import quantize_tree
from moejax.ders_compress.ckpt import FORMAT, load_compressed, save_compressed
from moejax.ders_compress.compress import CompressedDeRS
from moejax.evaluate import classifier_loss_fn
from moejax.integrity import CorruptDataError, array_checksum, tree_checksums, verify_checksums
from moejax.io import WeightFileError
from moejax.io._common import flat_params
from moejax.io.safetensors_io import export_params, import_params
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.nn.encoder import SequenceClassifier, bert_encoder_config
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from tests.test_faults import ONE_STEP, _invert_file
from tests.toy_models import TinyMoELM, ToySource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_token_ids_past_the_vocabulary_fail_before_compute():
    cfg = dense_decoder_config(vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_hidden=16)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="token id 15 but the model's vocab_size is 8"):
        train(model, ToySource(batch_size=4), ONE_STEP, progress=False)


def test_a_classifiers_token_and_class_ids_are_checked_before_compute():
    """A SequenceClassifier keeps its config on its encoder, so its token ids went unchecked,
    and no model's labels were: labels 0..4 for a head of 3 classes gave a NaN loss, blamed
    on the learning rate."""
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=1, n_heads=2, d_hidden=16,
                              max_position=8)
    rng = np.random.default_rng(0)
    tokens, labels = rng.integers(0, 20, (16, 6)), rng.integers(0, 5, 16)
    for x, y, match in ((tokens, labels, "class id 4 but the model has 3 classes"),
                        (tokens + 20, labels % 3, "token id .* but the model's vocab_size is 20")):
        model = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=match):
            train(model, ClassificationBatches(x, y, batch_size=4), ONE_STEP,
                  loss_fn=classifier_loss_fn, progress=False)


@pytest.fixture
def delta_file(tmp_path):
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(16, 8)).astype(np.float32),
            "b": np.where(rng.random((32,)) < 0.1, 1.0, 0.0).astype(np.float32)}
    path = str(tmp_path / "d.npz")
    storage.save(path, storage.encode(tree))
    return path, tree


def test_delta_file_damage_is_named(delta_file, tmp_path):
    path, tree = delta_file
    raw = open(path, "rb").read()
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0x01
    cases = {"flip.npz": bytes(flipped), "cut.npz": raw[: len(raw) // 2], "zero.npz": b""}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name} is corrupt or not a delta file"):
            storage.load(str(tmp_path / name))
    with pytest.raises(ValueError, match="does not end with '.npz'"):
        storage.load(path[:-4])
    got = storage.decode(storage.load(path), like=tree)
    np.testing.assert_array_equal(np.asarray(got["a"]), tree["a"])


def test_crafted_delta_members_are_named(delta_file, tmp_path):
    import io
    import zipfile

    path, _ = delta_file
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    inner = io.BytesIO()
    np.savez(inner, x=np.zeros(3))
    # a member that is itself an npz; an .npy whose header declares 4 PiB
    huge = io.BytesIO()
    np.lib.format.write_array_header_1_0(huge, {"descr": "<f4", "fortran_order": False,
                                                "shape": (2**50,)})
    for name, extra in (("nested.npz", ("leaf0.values", inner.getvalue())),
                        ("huge.npz", ("leaf0.values.npy", huge.getvalue() + bytes(64)))):
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            for k, v in members.items():
                if k != "leaf0.values":
                    buf = io.BytesIO()
                    np.save(buf, v)
                    zf.writestr(k + ".npy", buf.getvalue())
            zf.writestr(*extra)
        with pytest.raises(ValueError, match=f"{name} is corrupt or not a delta file"):
            storage.load(str(tmp_path / name))


def test_delta_metadata_inconsistencies_are_named(delta_file):
    path, tree = delta_file
    stored = storage.load(path)
    meta = json.loads(json.dumps(stored.meta))
    meta["leaves"][0]["shape"] = [16, 9]
    with pytest.raises(ValueError, match="leaf 0 \\('a'\\): 128 values for shape \\(16, 9\\)"):
        storage.decode(storage.StoredDelta(stored.arrays, meta))
    sparse = next(i for i, m in enumerate(stored.meta["leaves"]) if m["kind"] == "sparse")
    arrays = dict(stored.arrays)
    idx = arrays[f"leaf{sparse}.index"].copy()
    idx[-1] = 200
    arrays[f"leaf{sparse}.index"] = idx
    with pytest.raises(ValueError, match="sparse index 200 out of range"):
        storage.decode(storage.StoredDelta(arrays, stored.meta))
    with pytest.raises(ValueError, match="shapes differ from `like`"):
        storage.decode(stored, like={"a": np.zeros((8, 16)), "b": np.zeros(32)})


def test_quantised_delta_damage_is_named_not_decoded_into_wrong_values():
    """A quantised leaf's block arrays and settings are checked against each other: a step of
    the wrong block shape would broadcast into wrong weights (an error of 0.9 here)."""
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(8, 16)).astype(np.float32)}
    stored = storage.encode(quantize_tree(tree, 4, granularity="channel"))
    asym = storage.encode(quantize_tree(tree, 3, symmetric=False, granularity="group",
                                        group_size=4))

    def refused(st, match, arrays=None, **meta):
        m = json.loads(json.dumps(st.meta))
        m["leaves"][0].update(meta)
        with pytest.raises(ValueError, match=match):
            storage.decode(storage.StoredDelta({**st.arrays, **(arrays or {})}, m))

    step = stored.arrays["leaf0.step"]
    refused(stored, r"leaf 0 \('w'\): step stored as float32 \(1, 1, 1\); the leaf's blocks "
            r"need float32 \(1, 1, 16\)", {"leaf0.step": step[:, :, :1]})
    refused(stored, "step stored as float64", {"leaf0.step": step.astype(np.float64)})
    refused(stored, "granularity='tensor '", granularity="tensor ")
    refused(stored, "group_size=5 must divide d_in=8", granularity="group", group_size=5)
    refused(stored, "in_axis=3 is outside", in_axis=3)
    refused(stored, "levels=3 at 4 bits", levels=3)
    refused(stored, "symmetric must be a bool", symmetric=1)
    codes = stored.arrays["leaf0.codes"].copy()
    codes[0] = 0xFF  # two codes of 15 at 4 bits, symmetric: 15 levels, 0..14
    refused(stored, "a code past the 15 levels of 4-bit codes", {"leaf0.codes": codes})
    refused(stored, "64 code int64 entries, shape \\(8, 16\\) at 4 bits needs 64 uint8 bytes",
            {"leaf0.codes": stored.arrays["leaf0.codes"].astype(np.int64)})
    refused(asym, r"offset stored as float32 \(1, 1, 16\)",
            {"leaf0.offset": asym.arrays["leaf0.offset"][:1]})
    for st in (stored, asym):  # the undamaged ones still decode
        storage.decode(st, like=tree)


@pytest.mark.usefixtures("abandoned_reads_collected")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_compressed_ders_checkpoint_corruption_detected(tmp_path):
    rng = np.random.default_rng(0)
    base = {0: {"w_up": rng.normal(size=(8, 16)).astype(np.float32)}}
    delta = {"e0": rng.normal(size=(8, 16)).astype(np.float32)}
    c = CompressedDeRS(base, {"embed": rng.normal(size=(4, 8)).astype(np.float32)},
                       storage.encode(delta), {"note": "test"})
    path = save_compressed(tmp_path / "c", c)
    got, _ = load_compressed(path)
    np.testing.assert_array_equal(got.base[0]["w_up"], base[0]["w_up"])
    for f in _data_files_any(path):
        _invert_file(f)
    with pytest.raises(CorruptDataError, match="is corrupt"):
        load_compressed(path)
    # a meta record that lost its checksums cannot vouch for the arrays: refused, not loaded
    import orbax.checkpoint as ocp

    bare = str(tmp_path / "bare")
    tree = {"base": {"0": base[0]}, "rest": dict(c.rest), "deltas": dict(c.stored.arrays)}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(bare, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(tree),
            meta=ocp.args.JsonSave({"format": FORMAT, "ders": c.meta, "storage": c.stored.meta,
                                    "model_config": None})))
    with pytest.raises(CorruptDataError, match="no array checksums"):
        load_compressed(bare)
    # its meta record decides how the deltas are put back: an edit to it is caught
    path = save_compressed(tmp_path / "edited", c)
    record = os.path.join(path, "meta", "metadata")
    meta = json.load(open(record))
    assert meta["format"] == FORMAT and meta["ders"] == {"note": "test"}
    json.dump({**meta, "ders": {"note": "edited"}}, open(record, "w"))
    with pytest.raises(CorruptDataError, match="meta record .* was changed"):
        load_compressed(path)
    v1 = str(tmp_path / "v1")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(v1, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(tree),
            meta=ocp.args.JsonSave({"format": "moejax-ders-compressed-v1", "ders": c.meta,
                                    "storage": c.stored.meta, "model_config": None,
                                    "checksums": tree_checksums(tree)})))
    np.testing.assert_array_equal(load_compressed(v1)[0].base[0]["w_up"], base[0]["w_up"])


def _data_files_any(path):
    return [f for f in glob.glob(os.path.join(path, "**", "d", "*"), recursive=True)
            if os.path.isfile(f)]


def test_checksum_properties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    assert array_checksum(x) == array_checksum(x.copy())
    assert array_checksum(x) != array_checksum(x.reshape(7, 5))  # shape is part of it
    assert array_checksum(x) != array_checksum(x.view(np.int32))  # so is dtype
    y = x.copy()
    y.view(np.uint8).reshape(-1)[13] ^= 0x80
    assert array_checksum(x) != array_checksum(y)
    tree = {"p": {"w": x}, "s": np.int32(3)}

    sums = tree_checksums(tree)
    verify_checksums(tree, sums, "t")
    with pytest.raises(CorruptDataError, match="p/w"):
        verify_checksums({"p": {"w": y}, "s": np.int32(3)}, sums, "t")
    # numpy's own dtypes keep the checksums saved files already hold
    assert array_checksum(np.arange(6, dtype=np.float32).reshape(2, 3)) == "ba750485"
    # bfloat16 (a bare 2-byte void to numpy) is named: unlike float16 or uint16 of its bytes
    b = x.astype(jnp.bfloat16)
    assert array_checksum(b) == array_checksum(b.copy())
    assert array_checksum(b) not in {array_checksum(b.view(np.uint16)),
                                      array_checksum(b.view(np.float16))}


def test_safetensors_import_rejects_integers_and_non_finite(tmp_path):
    make = lambda: TinyMoELM(nnx.Rngs(0))  # noqa: E731

    flat = {k: np.asarray(v) for k, v in flat_params(make()).items()}
    ints = dict(flat, **{"head/kernel": np.ones(flat["head/kernel"].shape, np.int32)})
    export_params(ints, tmp_path / "int.safetensors")
    with pytest.raises(WeightFileError, match="'head/kernel' has integer dtype int32"):
        import_params(tmp_path / "int.safetensors", make)
    nans = dict(flat)
    nans["embed/embedding"] = flat["embed/embedding"].copy()
    nans["embed/embedding"][1, 2] = np.nan
    nans["embed/embedding"][3, 0] = np.inf
    export_params(nans, tmp_path / "nan.safetensors")
    with pytest.raises(WeightFileError, match="'embed/embedding' holds 2 NaN/inf values"):
        import_params(tmp_path / "nan.safetensors", make)
    export_params(flat, tmp_path / "ok.safetensors")
    import_params(tmp_path / "ok.safetensors", make)


def test_byte_tokenizer_rejects_out_of_vocabulary_ids():
    tok = ByteTokenizer()
    assert tok.decode([1, 3 + ord("h"), 3 + ord("i"), 2]) == "hi"
    for bad in ([259], [5, 300], [-1]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode(bad)


@pytest.mark.parametrize("build,match", [
    (lambda: TrainConfig(seed=-1), "seed=-1"),
    (lambda: TrainConfig(lr=float("inf")), "lr=inf"),
    (lambda: TrainConfig(lr=float("nan")), "nan"),
    (lambda: __import__("moejax.substrates.lm", fromlist=["x"]).LMSubstrateConfig(seq_len=0),
     "seq_len=0"),
    (lambda: __import__("moejax.substrates.lm", fromlist=["x"]).LMSubstrateConfig(
        eval_batches=0), "eval_batches=0"),
    (lambda: __import__("moejax.nn.moe_lm", fromlist=["x"]).MoELMConfig(d_model=30,
                                                                        n_heads=4),
     "d_model=30 is not divisible"),
    (lambda: __import__("moejax.nn.moe", fromlist=["x"]).MoEConfig(n_experts=2, top_k=3),
     "top_k=3"),
    (lambda: __import__("moejax.nn.moe", fromlist=["x"]).MoEConfig(capacity_factor=0.0),
     "capacity_factor=0.0"),
    (lambda: __import__("moejax.sparse_lm", fromlist=["x"]).SparseLMConfig(d_model=30),
     "not divisible"),
])


def test_configs_fail_at_construction(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_study_overrides_fail_before_compute():
    cfg = ders_compression.make_config("quick")
    for bad, match in (("ckpt_drop=1.0", "ckpt_drop=1.0"), ("eval_batches=0", "eval_batches"),
                       ("train.seed=-1", "seed"),
                       ("substrate.seq_len=2000", "exceeds the substrates' max_seq_len, 1024")):
        with pytest.raises(ConfigError, match=match):
            apply_overrides(cfg, [bad])
    # a training window longer than the model's positions: refused, not trained on
    with pytest.raises(ConfigError, match="exceeds SmolLM2's context, 8192"):
        apply_overrides(upcycling.make_config("quick"),
                        ["substrate.source=smollm2", "substrate.seq_len=9000"])
    with pytest.raises(ConfigError, match=r"seq_len=2000 \(the training window\) exceeds"):
        apply_overrides(speculative.make_config("quick"), ["seq_len=2000"])
    with pytest.raises(ConfigError, match="seq_len=600 exceeds MiniLM's 512 positions"):
        apply_overrides(encoder.make_config("quick"), ["seq_len=600"])
    r = subprocess.run([sys.executable, "-m", "experiments.ders.compression", "ckpt_drop=1.0",
                        "out=" + os.devnull], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 2 and "ckpt_drop=1.0 must be in [0, 1)" in r.stderr
