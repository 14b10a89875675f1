"""``host_gmm`` (numpy over exact groups via pure_callback) against the row-by-row oracle and
``jax.lax.ragged_dot``: values, first-order gradients, empty groups, rows past the groups,
bf16, vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.ops.host_gmm import host_gmm, host_gmm_reference


def _case(seed, sizes, m, k=5, n=7, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("sizes, m", [([3, 0, 4, 2], 9), ([0, 0, 6, 0], 8), ([9, 0], 9),
                                      ([1, 2, 3], 10)])
@pytest.mark.parametrize("jit", [False, True])
def test_values_and_gradients_match_oracle(sizes, m, jit):
    x, w, gs = _case(0, sizes, m)
    f = jax.jit(host_gmm) if jit else host_gmm
    y = f(x, w, gs)
    want = host_gmm_reference(x, w, gs)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, jax.lax.ragged_dot(x, w, gs), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(y)[sum(sizes):])  # rows past the groups are zero
    ct = jnp.asarray(np.random.default_rng(1).normal(size=y.shape), jnp.float32)
    loss = lambda fn: lambda a, b: jnp.sum(fn(a, b, gs) * ct)  # noqa: E731
    gx, gw = jax.grad(loss(host_gmm), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(loss(host_gmm_reference), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)
    empty = [g for g, s in enumerate(sizes) if s == 0]
    assert not np.any(np.asarray(gw)[empty])  # an empty group's weights get no gradient


def test_vmap_and_bf16():
    x, w, gs = _case(2, [2, 3, 1], 6)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(host_gmm, in_axes=(0, None, None))(xs, w, gs),
                               jax.vmap(host_gmm_reference, in_axes=(0, None, None))(xs, w, gs),
                               rtol=1e-5, atol=1e-5)
    xb, wb, _ = _case(3, [2, 3, 1], 6, dtype=jnp.bfloat16)
    yb = host_gmm(xb, wb, gs)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yb, np.float32),
                               np.asarray(host_gmm_reference(xb.astype(jnp.float32),
                                                             wb.astype(jnp.float32), gs)),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="expected x"):
        host_gmm(x, w[:, :3], gs)
