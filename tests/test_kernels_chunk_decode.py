"""The decode-speed chunk-union kernels (one chunk of 1 to 64 tokens, two launches) in Pallas
interpret mode: the union kernel finds exactly the chunk's active experts in ascending order;
the expert kernel equals the dense oracle for every activation, chunk length and a union from
one expert to all of them (plain and gated, float32 and bfloat16); its gradient (recomputed
through the pair kernels) equals the oracle's; both launches lower to Mosaic for TPU; bad
inputs are refused before any lowering."""

import jax
import jax.export as je
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.chunk_union.decode import MAX_CHUNK, chunk_union_decode, chunk_union_ids
from moejax.kernels.chunk_union.pallas import decode_chunk
from moejax.kernels.chunk_union.reference import dense_experts
from moejax.kernels.targets import lowering_target
from moejax.ops.activations import ACTIVATIONS, is_gated

E, D, F = 12, 128, 256


def _chunk(n, activation, seed=0, density=0.3, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (n, D)).astype(dtype)
    on = jax.random.uniform(k[1], (n, E)) < density
    a = jnp.where(on, jax.random.uniform(k[2], (n, E), minval=0.1, maxval=1.0), 0.0)
    w = [jax.random.normal(kk, s) / np.sqrt(s[1]) for kk, s in
         ((k[3], (E, D, F)), (k[4], (E, F, D)), (k[0], (E, D, F)))]
    w_gate = w[2] if is_gated(activation) else None
    return x, a.astype(dtype), on, w[0], w[1], w_gate


@pytest.mark.parametrize("n", [1, 2, 7, 8, 33, MAX_CHUNK])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_decode_kernel_equals_the_dense_oracle(n, activation):
    x, a, on, wu, wd, wg = _chunk(n, activation, seed=n)
    y = chunk_union_decode(x, a, on, wu, wd, wg, activation=activation, interpret=True)
    want = jax.jit(dense_experts, static_argnums=5)(x, a, wu, wd, wg, activation)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("members", [(), (5,), (0, 11), tuple(range(E))])
def test_the_union_kernel_finds_exactly_the_active_experts_in_order(members):
    on = np.zeros((8, E), bool)
    for i, e in enumerate(members):
        on[i % 8, e] = True
    ids, count = chunk_union_ids(jnp.asarray(on), interpret=True)
    assert int(count) == len(members)
    np.testing.assert_array_equal(ids, list(members) + [E] * (E - len(members)))
    x, a, _, wu, wd, wg = _chunk(8, "relu")
    a = jnp.where(jnp.asarray(on), jnp.abs(a) + 0.5, 0.0)
    y = chunk_union_decode(x, a, jnp.asarray(on), wu, wd, None, activation="relu",
                           interpret=True)
    np.testing.assert_allclose(y, dense_experts(x, a, wu, wd, None, "relu"), atol=2e-5)
    if not members:
        assert not np.any(np.asarray(y))  # no expert active: nothing added


def test_bfloat16_chunk_accumulates_in_float32():
    x, a, on, wu, wd, wg = _chunk(5, "swiglu", dtype=jnp.bfloat16)
    y = chunk_union_decode(x, a, on, wu, wd, wg, activation="swiglu", interpret=True)
    assert y.dtype == jnp.bfloat16
    ref = dense_experts(x.astype(jnp.float32), a.astype(jnp.float32),
                        *(w.astype(jnp.bfloat16).astype(jnp.float32) for w in (wu, wd, wg)),
                        "swiglu")
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_its_gradient_is_the_oracles(activation):
    x, a, on, wu, wd, wg = _chunk(6, activation, density=0.5)

    r = jax.random.normal(jax.random.key(5), x.shape, x.dtype)  # a decoder's residual

    def loss(fn):
        def f(x, a, wu, wd, wg, r):
            return jnp.sum(fn(x, a, wu, wd, wg, r) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))(x, a, wu, wd, wg, r)

    got = loss(lambda *z: decode_chunk(z[0], z[1], on, *z[2:], activation, True, "tpu"))
    want = loss(lambda x, a, wu, wd, wg, r: r + dense_experts(x, a, wu, wd, wg, activation))
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 8, 32])
@pytest.mark.parametrize("activation", ["relu", "swiglu", "gelu"])
def test_both_launches_lower_to_mosaic_for_tpu_at_the_benchmark_shapes(n, activation):
    """d 2048, 64 experts of width 256, bf16: the union kernel and the expert kernel."""
    e, d, f = 64, 2048, 256
    bf = jnp.bfloat16
    args = [jax.ShapeDtypeStruct((n, d), bf), jax.ShapeDtypeStruct((n, e), bf),
            jax.ShapeDtypeStruct((n, e), jnp.bool_), jax.ShapeDtypeStruct((e, d, f), bf),
            jax.ShapeDtypeStruct((e, f, d), bf)]
    gate = [jax.ShapeDtypeStruct((e, d, f), bf)] if is_gated(activation) else []

    def fn(*z):
        return chunk_union_decode(*z[:5], z[5] if len(z) > 5 else None, activation=activation)

    with lowering_target("tpu"):
        text = je.export(jax.jit(fn), platforms=("tpu",))(*args, *gate).mlir_module()
    assert text.count("tpu_custom_call") == 2  # two launches
    assert "callback" not in text


def test_bad_chunks_are_refused_before_lowering():
    x, a, on, wu, wd, wg = _chunk(4, "relu")
    with pytest.raises(ValueError, match="1 to 64"):
        chunk_union_decode(jnp.zeros((65, D)), jnp.zeros((65, E)), jnp.zeros((65, E), bool),
                           wu, wd, activation="relu")
    with pytest.raises(ValueError, match="w_down"):
        chunk_union_decode(x, a, on, wu, wd[:, :, :64], activation="relu")
    with pytest.raises(ValueError, match="unknown activation"):
        chunk_union_decode(x, a, on, wu, wd, activation="tanh")
