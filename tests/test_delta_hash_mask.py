"""Counter-based DARE masks (moejax.delta.hash_mask): statistical properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import dare
from moejax.delta.dare import dare_keep_mask
from moejax.delta.hash_mask import fmix32, hash_bits


def test_fmix32_is_a_bijection_on_a_block_and_bits_are_uniform():
    x = jnp.arange(1 << 16, dtype=jnp.uint32)
    assert len(np.unique(np.asarray(fmix32(x)))) == 1 << 16
    bits = np.asarray(hash_bits(jax.random.key(3), (200_000,)))
    counts = np.bincount(bits >> 28, minlength=16)  # top 4 bits: 16 equal buckets
    expected = len(bits) / 16
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 15 + 5 * np.sqrt(30), chi2
    low = np.bincount(bits & 15, minlength=16)  # low bits too
    assert float(np.sum((low - expected) ** 2 / expected)) < 15 + 5 * np.sqrt(30)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_keep_rate_independence_and_determinism(p):
    tree = {"a": jnp.ones((300, 400)), "b": jnp.ones((300, 400))}
    m = dare_keep_mask(jax.random.key(0), tree, p, rng="hash")
    n = 300 * 400
    for leaf in m.values():
        rate = float(jnp.mean(leaf))
        assert abs(rate - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    a, b = (np.asarray(m[k], np.float64).ravel() for k in ("a", "b"))
    other = np.asarray(dare_keep_mask(jax.random.key(1), tree, p, rng="hash")["a"],
                       np.float64).ravel()
    for u, v in ((a, b), (a, other)):  # across leaves, across keys: uncorrelated
        assert abs(np.corrcoef(u, v)[0, 1]) < 5 / np.sqrt(n)
    again = dare_keep_mask(jax.random.key(0), tree, p, rng="hash")
    np.testing.assert_array_equal(np.asarray(again["a"]), np.asarray(m["a"]))


def test_hash_dare_is_unbiased_and_unselected_leaves_untouched():
    d = {"w": jax.random.normal(jax.random.key(4), (8, 8)), "b": jnp.arange(3.0)}
    sel = {"w": True, "b": False}
    keys = jax.random.split(jax.random.key(5), 2000)
    draws = jax.vmap(lambda k: dare(k, d, 0.5, mask=sel, rng="hash")["w"])(keys)
    mean = np.asarray(jnp.mean(draws, axis=0))
    np.testing.assert_allclose(mean, np.asarray(d["w"]), atol=0.12)  # ~ 5 sigma of the mean
    out = dare(jax.random.key(0), d, 0.5, mask=sel, rng="hash")
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(d["b"]))
    with pytest.raises(ValueError, match="rng="):
        dare(jax.random.key(0), d, 0.5, rng="philox")


def test_nd_bits_are_the_flat_counters_reshaped():
    """The per-axis iota index equals ``arange(n).reshape(shape)``: a leaf's mask does not
    depend on how its shape is factored (oracle: the 1-D hash of the flat counter)."""
    key = jax.random.key(11)
    for shape in [(), (5,), (3, 4), (2, 3, 5), (4, 1, 7)]:
        n = int(np.prod(shape))
        want = np.asarray(hash_bits(key, (n,))).reshape(shape)
        np.testing.assert_array_equal(np.asarray(hash_bits(key, shape)), want)


def test_every_word_of_the_key_reaches_the_hash():
    # keys alike in one word and different in the other give unrelated counters
    def key(a, b):
        return jax.random.wrap_key_data(jnp.asarray([a, b], jnp.uint32), impl="threefry2x32")

    base = np.asarray(hash_bits(key(7, 11), (4096,)))
    for other in (key(7, 12), key(8, 11)):
        assert np.mean(np.asarray(hash_bits(other, (4096,))) == base) < 0.01
