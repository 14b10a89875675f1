"""DARE on optimiser updates: unbiasedness, drop rate, reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax.optim import dare_updates


@pytest.mark.parametrize("rng", ["hash", "threefry"])
def test_dare_updates_unbiased_and_rate(rng):
    p, n_steps = 0.8, 3000
    u = {"a": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.full((5,), 0.5)}
    tx = dare_updates(p, 0, rng=rng)
    state = tx.init(u)

    def body(state, _):
        out, state = tx.update(u, state)
        return state, out

    _, outs = jax.lax.scan(body, state, None, length=n_steps)
    for k in u:
        mean = np.asarray(outs[k]).mean(0)
        sd = np.abs(np.asarray(u[k])) * np.sqrt(p / (1 - p)) / np.sqrt(n_steps)
        assert np.all(np.abs(mean - np.asarray(u[k])) <= 5 * sd + 1e-7)
        frac_kept = np.mean(np.asarray(outs[k]) != 0)
        assert abs(frac_kept - (1 - p)) < 0.02
        nz = np.asarray(outs[k])[np.asarray(outs[k]) != 0]
        np.testing.assert_allclose(
            np.unique(np.abs(nz)),
            np.unique(np.abs(np.asarray(u[k])[np.asarray(u[k]) != 0]) / (1 - p)),
            rtol=1e-5,
        )


def test_dare_updates_reproducible_and_composes():
    u = {"w": jnp.ones((6, 6))}
    tx = optax.chain(optax.sgd(0.1), dare_updates(0.5, jax.random.PRNGKey(7), q=0.8))
    s1, s2 = tx.init(u), tx.init(u)
    a1, s1 = tx.update(u, s1, u)
    b1, s1 = tx.update(u, s1, u)
    a2, _ = tx.update(u, s2, u)
    np.testing.assert_array_equal(a1["w"], a2["w"])  # same seed -> same mask
    assert not np.array_equal(a1["w"], b1["w"])  # key advances each step
    assert set(np.unique(np.asarray(a1["w"])).round(6)) <= {0.0, round(-0.1 / 0.8, 6)}
    # a seed given as an integer of any kind (a config's numpy int) is the same seed
    for seed in (7, np.int64(7), np.int32(7)):
        tx = optax.chain(optax.sgd(0.1), dare_updates(0.5, seed, q=0.8))
        np.testing.assert_array_equal(tx.update(u, tx.init(u), u)[0]["w"], a1["w"])


def test_dare_updates_hash_masks_with_traced_rate():
    """p scheduled through optax.inject_hyperparams (traced) gives the rate it was set to,
    independent masks per leaf, and steps whose masks differ."""
    u = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
    tx = optax.inject_hyperparams(dare_updates, static_args=("key", "rng"))(p=0.9, key=3)
    state = tx.init(u)
    out, state = jax.jit(tx.update)(u, state)
    out2, _ = jax.jit(tx.update)(u, state)
    for k in u:
        kept = np.asarray(out[k]) != 0
        assert abs(kept.mean() - 0.1) < 0.015
        np.testing.assert_allclose(np.asarray(out[k])[kept], 10.0, rtol=1e-5)
    assert not np.array_equal(np.asarray(out["a"]) != 0, np.asarray(out["b"]) != 0)
    assert not np.array_equal(np.asarray(out["a"]) != 0, np.asarray(out2["a"]) != 0)
    with pytest.raises(ValueError, match="rng="):
        dare_updates(0.5, 0, rng="philox")
