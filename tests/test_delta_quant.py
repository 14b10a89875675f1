"""k-bit delta quantisation: error within half a step, code range, block counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import dequantize, dequantize_tree, num_levels, quantize, quantize_tree
from moejax.delta.quant_jnp import fake_quantize, quantize_codes
from moejax.delta.storage import decode, encode, storage_report


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "gran,gs,nblocks", [("tensor", 0, 1), ("channel", 0, 3 * 6), ("group", 4, 3 * 2 * 6)]
)
def test_quant_error_within_half_step(symmetric, gran, gs, nblocks):
    r = np.random.default_rng(0)
    x = (r.standard_t(3, size=(3, 8, 6)) * 0.01).astype(np.float32)
    for bits in range(1, 9):
        q = quantize(x, bits, symmetric=symmetric, granularity=gran, group_size=gs)
        assert q.codes.dtype == np.uint8 and q.codes.shape == x.shape
        assert q.codes.max() < num_levels(bits, symmetric)
        assert q.step.size == nblocks
        y = dequantize(q)
        assert y.dtype == x.dtype and y.shape == x.shape
        # per-entry bound |x - x^| <= step/2 of its block
        step_full = dequantize(
            dataclasses.replace(q, codes=np.ones_like(q.codes), offset=np.zeros_like(q.offset),
                                symmetric=False)
        )
        assert np.all(
            np.abs(y.astype(np.float64) - x) <= step_full.astype(np.float64) / 2 * (1 + 1e-5) + 1e-9
        )
    # 8 bits is close; more bits never hurts
    e = [
        np.abs(
            dequantize(quantize(x, b, symmetric=symmetric, granularity=gran, group_size=gs)) - x
        ).max()
        for b in (2, 4, 8)
    ]
    assert e[0] >= e[1] >= e[2]


def test_quant_special_cases_and_tree():
    x = np.array([[-2.0, 0.0], [1.0, 0.5]], np.float32)
    q = quantize(x, 2, symmetric=True, granularity="tensor")  # levels {-2, 0, 2}
    np.testing.assert_array_equal(dequantize(q), [[-2, 0], [2, 0]])
    assert (
        quantize(x, 1, symmetric=True, granularity="tensor").step.item() == 4.0
    )  # levels {-2, +2}
    z = np.zeros((4, 4), np.float32)
    np.testing.assert_array_equal(dequantize(quantize(z, 3, symmetric=False)), z)
    with pytest.raises(ValueError, match="1..8"):
        quantize(x, 9)
    with pytest.raises(ValueError, match="divide"):
        quantize(np.ones((6, 2), np.float32), 4, granularity="group", group_size=4)
    # a group longer than the column is the column
    np.testing.assert_array_equal(
        dequantize(quantize(x, 4, granularity="group", group_size=3)),
        dequantize(quantize(x, 4, granularity="channel")))
    t = {"w": x, "b": np.ones(2, np.float32)}
    qt = quantize_tree(t, 4, mask={"w": True, "b": False}, granularity="channel")
    back = dequantize_tree(qt)
    assert np.abs(np.asarray(back["w"]) - x).max() <= 0.5 * 4.0 / 14 + 1e-6  # col amax 2, 15 levels
    assert np.asarray(back["w"])[0, 1] == 0.0  # symmetric keeps zero deltas exactly zero
    np.testing.assert_array_equal(back["b"], t["b"])


@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric", "midrise"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_delta_is_refused_not_quantised_to_junk(scheme, bad):
    # one NaN or inf makes its block's step NaN or inf: every code of the block is junk (a
    # tensor-wide scale loses the whole matrix), so it is refused before any code is made
    x = np.array([[1.0, bad], [2.0, 3.0]], np.float32)
    with pytest.raises(ValueError, match="1 NaN or inf values"):
        quantize(x, 4, scheme=scheme, granularity="tensor")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_tree({"w": x}, 8, granularity="channel")


def test_quantized_leaf_is_a_pytree_that_passes_through_jit_and_tree_map():
    tree = {"w": np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32),
            "b": np.zeros((4,), np.float32)}
    q = quantize_tree(tree, 4)
    assert len(jax.tree.leaves(q)) == 2 * 3  # codes, step, offset of each quantised leaf
    same = jax.jit(lambda t: t)(q)
    assert same["w"].bits == 4 and same["w"].granularity == q["w"].granularity
    np.testing.assert_array_equal(np.asarray(same["w"].codes), q["w"].codes)
    doubled = jax.tree.map(lambda x: x * 2, q)
    np.testing.assert_allclose(np.asarray(doubled["w"].step), 2 * np.asarray(q["w"].step))
    np.testing.assert_array_equal(dequantize_tree(jax.tree.map(np.asarray, same))["w"],
                                  dequantize_tree(q)["w"])


def test_midrise_error_falls_with_bits_and_one_bit_beats_dropping_the_delta():
    r = np.random.default_rng(3)
    x = r.normal(size=(128, 16)).astype(np.float32) * 0.02  # Gaussian-like deltas
    rel = []
    for bits in range(1, 9):
        q = quantize(x, bits, scheme="midrise", granularity="group", group_size=64, in_axis=0)
        assert q.codes.max() < 2**bits and q.n_levels == 2**bits and q.step.size == 2 * 16
        rel.append(float(np.linalg.norm(dequantize(q) - x) / np.linalg.norm(x)))
    assert all(a > b for a, b in zip(rel, rel[1:])), rel  # strictly falls as bits grow
    assert rel[0] < 1.0  # 1 bit: better than dropping the delta (relative error 1)
    assert rel[0] == pytest.approx(np.sqrt(1 - 2 / np.pi), abs=0.03)  # sign x mean|x|, Gaussian
    legacy = [float(np.linalg.norm(dequantize(quantize(x, b, granularity="channel",
                                                       in_axis=0)) - x) / np.linalg.norm(x))
              for b in (1, 2)]
    assert legacy[0] > 1.0 and legacy[1] > rel[1]  # what the old default did: {-A, +A}
    # 1 bit: codes are the signs, the scale the group's mean |x|
    q1 = quantize(x, 1, scheme="midrise", granularity="group", group_size=64, in_axis=0)
    np.testing.assert_array_equal(q1.codes, (x >= 0).astype(np.uint8))
    np.testing.assert_allclose(np.abs(dequantize(q1))[:64, 0], np.mean(np.abs(x[:64, 0])),
                               rtol=1e-5)
    # every entry within half a cell at b >= 2
    q3 = quantize(x, 3, scheme="midrise", granularity="channel", in_axis=0)
    assert np.all(np.abs(dequantize(q3) - x) <= q3.step.reshape(1, -1) / 2 * (1 + 1e-5))
    with pytest.raises(ValueError, match="scheme"):
        quantize(x, 2, scheme="lloyd")


def test_midrise_leaves_round_trip_through_storage():
    x = np.random.default_rng(4).normal(size=(64, 8)).astype(np.float32)
    q = quantize_tree({"w": x}, 2, scheme="midrise", granularity="group", group_size=32,
                      in_axis=0)
    stored = encode(q)
    assert "leaf0.offset" not in stored.arrays  # centred: one scale per group, no offset
    back = decode(stored)
    np.testing.assert_array_equal(dequantize(back["w"]), dequantize(q["w"]))
    assert back["w"].n_levels == 4
    rep = storage_report(stored)
    assert rep["array_bytes"] == 64 * 8 * 2 // 8 + 2 * 8 * 4  # codes + float32 scales


@pytest.mark.parametrize("scheme", ["midrise", "symmetric", "asymmetric"])
@pytest.mark.parametrize("gran", ["tensor", "channel"])
def test_an_empty_leaf_quantises_to_no_codes_in_both_implementations(scheme, gran):
    for shape in [(0,), (0, 4), (4, 0)]:
        q = quantize(np.zeros(shape, np.float32), 4, scheme=scheme, granularity=gran)
        assert q.codes.shape == shape and np.all(q.step == 0)
        assert dequantize(q).shape == shape
        codes, step, _ = quantize_codes(jnp.zeros(shape), 4, scheme=scheme, granularity=gran)
        assert codes.shape == shape and step.shape == q.step.shape
        assert fake_quantize(jnp.zeros(shape), 4, scheme=scheme, granularity=gran).shape == shape
