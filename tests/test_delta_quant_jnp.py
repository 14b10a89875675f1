"""The jnp quantiser against the numpy float64 oracle of moejax.delta.quant."""

import jax
import numpy as np
import pytest

from moejax.delta.quant import dequantize, quantize
from moejax.delta.quant_jnp import fake_quantize, fake_quantize_tree, quantize_codes

_SHAPES = [("group", (128, 24), -2), ("channel", (64, 40), -2), ("tensor", (33, 7), -2),
           ("group", (3, 64, 16), -2), ("group", (24, 128), -1)]
_CASES = ([(s, g, sh, ax, b) for s in ("midrise", "symmetric", "asymmetric")
           for g, sh, ax in _SHAPES for b in (1, 3)]
          + [(s, g, sh, -2, b) for b in (2, 4, 8)
             for s, g, sh in (("midrise", "group", (128, 24)),
                              ("asymmetric", "channel", (64, 40)))])


@pytest.mark.parametrize("scheme,granularity,shape,in_axis,bits", _CASES)
def test_matches_numpy_oracle(scheme, granularity, shape, in_axis, bits):
    x = (np.random.default_rng(bits).standard_t(4, size=shape) * 0.01).astype(np.float32)
    kw = dict(scheme=scheme, granularity=granularity, group_size=32, in_axis=in_axis)
    ref = quantize(x, bits, **kw)
    codes, step, offset = quantize_codes(x, bits, **kw)
    assert codes.shape == ref.codes.shape and codes.dtype == np.uint8
    # float32 vs float64 arithmetic: codes may differ only at cell boundaries
    assert np.mean(np.asarray(codes) != ref.codes) < 1e-3
    np.testing.assert_allclose(np.asarray(step).reshape(-1), ref.step.reshape(-1), rtol=1e-5)
    got = np.asarray(fake_quantize(x, bits, **kw))
    want = dequantize(ref)
    agree = np.asarray(codes) == ref.codes
    np.testing.assert_allclose(got[agree], want[agree], rtol=1e-5,
                               atol=1e-4 * float(np.max(ref.step)))  # cancellation near 0
    assert np.abs(got - want).max() <= float(np.max(ref.step)) * 1.0001  # one cell at most


def test_jits_over_trees_and_error_falls_with_bits():
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(128, 32)).astype(np.float32),
            "b": rng.normal(size=(32,)).astype(np.float32)}
    errs = []
    for bits in (1, 2, 4, 8):
        q = jax.jit(lambda t, b=bits: fake_quantize_tree(
            t, b, mask={"w": True, "b": False}))(tree)
        np.testing.assert_array_equal(np.asarray(q["b"]), tree["b"])
        errs.append(float(np.linalg.norm(np.asarray(q["w"]) - tree["w"])
                          / np.linalg.norm(tree["w"])))
    assert errs == sorted(errs, reverse=True) and errs[0] < 1.0  # 1 bit beats dropping
    with pytest.raises(ValueError, match="group_size=48 must divide"):
        fake_quantize(tree["w"], 4, group_size=48)
