"""k-bit delta quantisation: error within half a step, code range, block counts."""

import dataclasses

import jax
import numpy as np
import pytest

from moejax.delta import dequantize, dequantize_tree, num_levels, quantize, quantize_tree


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
        quantize(x, 4, granularity="group", group_size=3)
    t = {"w": x, "b": np.ones(2, np.float32)}
    qt = quantize_tree(t, 4, mask={"w": True, "b": False}, granularity="channel")
    back = dequantize_tree(qt)
    assert np.abs(np.asarray(back["w"]) - x).max() <= 0.5 * 4.0 / 14 + 1e-6  # col amax 2, 15 levels
    assert np.asarray(back["w"])[0, 1] == 0.0  # symmetric keeps zero deltas exactly zero
    np.testing.assert_array_equal(back["b"], t["b"])


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
