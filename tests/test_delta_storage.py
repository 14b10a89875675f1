"""Compact storage: exact counts and bytes; store -> save -> load -> identical tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import (
    dare,
    decode,
    dense_bytes,
    dequantize,
    encode,
    index_dtype_for,
    load,
    pack_bits,
    quantize,
    quantize_tree,
    save,
    storage,
    storage_report,
    unpack_bits,
)
from moejax.delta.pruned_codec import decode_pruned, encode_pruned
from moejax.delta.quant import block_shape
from moejax.delta.storage import StoredDelta


def test_index_dtype_and_bit_packing():
    assert index_dtype_for(256) == np.uint8 and index_dtype_for(257) == np.uint16
    assert index_dtype_for(65536) == np.uint16 and index_dtype_for(65537) == np.uint32
    r = np.random.default_rng(0)
    for bits in range(1, 9):
        codes = r.integers(0, 2**bits, size=37).astype(np.uint8)
        packed = pack_bits(codes, bits)
        assert packed.nbytes == -(-37 * bits // 8)
        np.testing.assert_array_equal(unpack_bits(packed, bits, 37), codes)


def _same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_sparse_roundtrip_exact_accounting(tmp_path):
    r = np.random.default_rng(1)
    d = {
        "layers": [
            {"w": jnp.asarray(r.normal(size=(20, 30)), jnp.float32)},
            {"w": jnp.asarray(r.normal(size=(300, 4)), jnp.bfloat16)},
        ],
        "norm": jnp.asarray(r.normal(size=(30,)), jnp.float32),
    }
    pruned = dare(
        jax.random.PRNGKey(0), d, 0.9, mask={"layers": [{"w": True}, {"w": True}], "norm": False}
    )
    st = encode(pruned)  # auto: sparse for pruned matrices, dense for the norm
    kinds = [m["kind"] for m in st.meta["leaves"]]
    assert kinds == ["sparse", "sparse", "dense"]
    nnz0, nnz1 = (
        int(np.count_nonzero(np.asarray(pruned["layers"][i]["w"], np.float32))) for i in (0, 1)
    )
    rep = storage_report(st)
    assert rep["params"] == 600 + 1200 + 30
    assert rep["stored"] == nnz0 + nnz1 + 30
    assert rep["leaves"][0]["bytes"] == nnz0 * (4 + 2)  # float32 value + uint16 index (600 > 256)
    assert rep["leaves"][1]["bytes"] == nnz1 * (2 + 2)  # bfloat16 value + uint16 index
    assert rep["array_bytes"] == rep["leaves"][0]["bytes"] + rep["leaves"][1]["bytes"] + 30 * 4
    assert rep["array_bytes"] < dense_bytes(pruned)
    _same(decode(st, like=pruned), pruned)
    save(str(tmp_path / "delta.npz"), st)
    loaded = load(str(tmp_path / "delta.npz"))
    with np.load(tmp_path / "delta.npz", allow_pickle=False) as z:  # no object arrays inside
        assert all(z[k].dtype != object for k in z.files)
    _same(decode(loaded, like=pruned), pruned)
    nested = decode(loaded)  # without a template: nested dict by path
    np.testing.assert_array_equal(
        np.asarray(nested["layers"]["0"]["w"]), np.asarray(pruned["layers"][0]["w"])
    )
    with pytest.raises(ValueError, match="leaf paths"):
        decode(loaded, like={"x": jnp.zeros(3)})


def test_quant_roundtrip_packed_bytes(tmp_path):
    r = np.random.default_rng(2)
    d = {
        "w": r.normal(size=(16, 6)).astype(np.float32),
        "b": r.normal(size=(6,)).astype(np.float32),
    }
    qt = quantize_tree(
        d, 3, mask={"w": True, "b": False}, symmetric=False, granularity="group", group_size=8
    )
    st = encode(qt, formats="dense")
    rep = storage_report(st)
    assert [x["path"] for x in rep["leaves"]] == ["b", "w"]
    assert (
        rep["leaves"][1]["bytes"] == -(-96 * 3 // 8) + 2 * (2 * 6) * 4
    )  # packed codes + step/offset per group
    assert rep["leaves"][0]["bytes"] == 6 * 4
    save(str(tmp_path / "q.npz"), st)
    back = decode(load(str(tmp_path / "q.npz")), like=d)
    ql = quantize(d["w"], 3, symmetric=False, granularity="group", group_size=8)
    np.testing.assert_array_equal(back["w"].codes, ql.codes)
    np.testing.assert_array_equal(back["w"].step, ql.step)
    np.testing.assert_array_equal(np.asarray(back["b"]), d["b"])
    # symmetric: no offsets stored, decoded values identical
    qs = quantize_tree(d, 4, mask={"w": True, "b": False}, symmetric=True, granularity="channel")
    sts = encode(qs)
    assert storage_report(sts)["leaves"][1]["bytes"] == 96 * 4 // 8 + 6 * 4

    np.testing.assert_array_equal(dequantize(decode(sts, like=d)["w"]), dequantize(qs["w"]))


def test_save_is_atomic_and_names_a_bad_suffix(tmp_path, monkeypatch):
    good = storage.encode({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "dense")
    path = tmp_path / "delta.npz"
    storage.save(str(path), good)
    before = path.read_bytes()

    def broken_savez(f, **arrays):
        f.write(b"partial")  # some bytes reach the temporary file, then the write fails
        raise OSError("disk full")

    monkeypatch.setattr(storage.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        storage.save(str(path), good)
    monkeypatch.undo()
    assert path.read_bytes() == before  # the previous file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["delta.npz"]  # no temporary left
    np.testing.assert_array_equal(np.asarray(storage.decode(storage.load(str(path)))["w"]),
                                  np.arange(6).reshape(2, 3))
    with pytest.raises(ValueError, match=r"\.npz"):
        storage.save(str(tmp_path / "delta.bin"), good)


def test_a_pruned_delta_round_trips_sparse_and_quantised():
    d = {"w": jax.random.normal(jax.random.key(0), (40, 30)), "b": np.ones(30, np.float32)}
    mask = {"w": True, "b": False}
    pruned = dare(jax.random.key(1), d, 0.9, mask=mask)
    back = decode_pruned(encode_pruned(pruned, mask, 0.9, 32), {k: v.shape for k, v in d.items()})
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(pruned["w"]))
    np.testing.assert_array_equal(np.asarray(back["b"]), d["b"])
    q8 = decode_pruned(encode_pruned(pruned, mask, 0.9, 8), {k: v.shape for k, v in d.items()})
    # dropped entries stay exactly zero (tiny survivors may round to zero too)
    assert np.all(np.asarray(q8["w"])[np.asarray(pruned["w"]) == 0] == 0)
    assert np.max(np.abs(np.asarray(q8["w"]) - np.asarray(pruned["w"]))) < 0.05 * np.max(
        np.abs(np.asarray(pruned["w"])))


def test_a_pruned_delta_reads_back_in_the_shapes_it_was_stored_in(tmp_path):
    # the survivors are flat positions: read back in another shape of equal or larger size they
    # would make another matrix, so the shapes travel with the delta and others are refused
    d = {"a/w": np.arange(1.0, 21.0, dtype=np.float32).reshape(4, 5),
         "b": np.ones(3, np.float32)}
    mask = {"a/w": True, "b": False}
    save(str(tmp_path / "d.npz"), encode_pruned(d, mask, 0.5, 32))
    stored = load(str(tmp_path / "d.npz"))
    back = decode_pruned(stored)  # no shapes needed
    np.testing.assert_array_equal(np.asarray(back["a/w"]), d["a/w"])
    assert back["b"].shape == (3,)
    for wrong in ({"a/w": (5, 4), "b": (3,)}, {"a/w": (4, 6), "b": (3,)},
                  {"a/w": (4, 5), "b": (1, 3)}, {"a/w": (4, 5)}):
        with pytest.raises(ValueError, match="differ from the stored delta"):
            decode_pruned(stored, wrong)
    # a delta stored without its shapes needs them, and fitting ones only
    legacy = StoredDelta(stored.arrays, {k: v for k, v in stored.meta.items() if k != "shapes"})
    with pytest.raises(ValueError, match="records no shapes"):
        decode_pruned(legacy)
    with pytest.raises(ValueError, match="past the 15 entries"):
        decode_pruned(legacy, {"a/w": (3, 5), "b": (3,)})
    with pytest.raises(ValueError, match="stored as"):
        decode_pruned(legacy, {"a/w": (4, 5), "b": (1, 3)})
    with pytest.raises(ValueError, match="one flag per path"):
        encode_pruned(d, {"a/w": True}, 0.5, 32)
    for p in (-0.1, 1.0, True, "0.5"):
        with pytest.raises(ValueError, match="drop rate"):
            encode_pruned(d, mask, p, 32)


@pytest.mark.parametrize("bits", [1, 2, 8, 16, 32])
def test_a_matrix_with_no_survivors_stores_and_reads_back_as_zeros(tmp_path, bits):
    # at a high drop rate a small matrix can lose every entry: it stores as an empty survivor
    # list (no scale to take from no values) and reads back as zeros
    d = {"w": np.zeros((3, 4), np.float32), "v": np.arange(1.0, 7.0, dtype=np.float32)}
    mask = {"w": True, "v": True}
    stored = encode_pruned(d, mask, 0.99, bits)
    save(str(tmp_path / "d.npz"), stored)
    back = decode_pruned(load(str(tmp_path / "d.npz")), {"w": (3, 4), "v": (6,)})
    np.testing.assert_array_equal(np.asarray(back["w"]), 0.0)
    assert back["w"].shape == (3, 4)
    half_step = {1: 5.0, 2: 3.0, 8: 6.0 / 254, 16: 6.0 / 256, 32: 0.0}[bits]
    assert np.max(np.abs(np.asarray(back["v"]) - d["v"])) <= half_step


@pytest.mark.parametrize("shape,granularity,in_axis", [
    ((8, 16), "tensor", -2), ((8, 16), "channel", -2), ((8, 16), "group", -2),
    ((8, 16), "channel", -1), ((8, 16), "group", 0), ((3, 8, 12), "group", -2),
    ((3, 8, 12), "channel", 0), ((5,), "channel", -2), ((0, 6), "channel", -2)])
def test_block_shape_is_the_shape_of_the_quantisers_steps(shape, granularity, in_axis):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    for symmetric in (True, False):
        q = quantize(x, 3, symmetric=symmetric, granularity=granularity, group_size=4,
                     in_axis=in_axis)
        assert block_shape(shape, granularity, 4, in_axis) == q.step.shape == q.offset.shape


def test_block_shape_refuses_what_quantize_refuses():
    for args, match in ((((8, 16), "row", 4, -2), "granularity='row'"),
                        (((8, 16), "group", 3, -2), "must divide d_in=8"),
                        (((5,), "group", 4, -2), "needs a matrix leaf"),
                        (((8, 16), "channel", 4, 2), "in_axis=2 is outside")):
        with pytest.raises(ValueError, match=match):
            block_shape(*args)
