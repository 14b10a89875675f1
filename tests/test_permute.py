"""The dispatch permutations (moejax.kernels.moe_ffn.permute) against plain indexing, whose
gradients are the scatters they replace: values and gradients, float32 and bfloat16, k = 1..3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.moe_ffn.permute import inverse_permutation, sort_rows, unsort_rows


def _case(seed, n, k, e, d, dtype):
    kx, ki, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, d), jnp.float32).astype(dtype)
    ids = jax.random.randint(ki, (n * k,), 0, e)
    order = jnp.argsort(ids, stable=True)
    ct = jax.random.normal(kc, (n * k, d), jnp.float32).astype(dtype)
    return x, order, inverse_permutation(order), ct


def test_inverse_permutation_inverts():
    order = jax.random.permutation(jax.random.key(0), 37)
    inv = inverse_permutation(order)
    np.testing.assert_array_equal(np.asarray(inv)[np.asarray(order)], np.arange(37))
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(inv)], np.arange(37))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sort_and_unsort_equal_indexing_values_and_gradients(k, dtype):
    x, order, inv, ct = _case(k, 29, k, 5, 6, dtype)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)

    def ours(x):
        return unsort_rows(sort_rows(x, order, inv, k) * 1.5, order, inv)

    def plain(x):
        return (x[order // k] * 1.5)[inv]

    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(plain(x)))
    _, vjp_ours = jax.vjp(ours, x)
    _, vjp_plain = jax.vjp(plain, x)
    g_ours, g_plain = vjp_ours(ct)[0], vjp_plain(ct)[0]
    assert g_ours.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(g_ours, np.float32), np.asarray(g_plain, np.float32),
                               **tol)
    # each piece alone, under jit
    g_sort = jax.jit(jax.grad(lambda x: jnp.sum(sort_rows(x, order, inv, k).astype(
        jnp.float32) * ct.astype(jnp.float32))))(x)
    g_ref = jax.grad(lambda x: jnp.sum(x[order // k].astype(jnp.float32)
                                       * ct.astype(jnp.float32)))(x)
    np.testing.assert_allclose(np.asarray(g_sort, np.float32), np.asarray(g_ref, np.float32),
                               **tol)
    y = ct * 0.5 + 1  # any [N k, D] rows
    g_un = jax.grad(lambda y: jnp.sum(unsort_rows(y, order, inv).astype(jnp.float32)
                                      * ct.astype(jnp.float32)))(y)
    g_un_ref = jax.grad(lambda y: jnp.sum(y[inv].astype(jnp.float32)
                                          * ct.astype(jnp.float32)))(y)
    np.testing.assert_array_equal(np.asarray(g_un), np.asarray(g_un_ref))
