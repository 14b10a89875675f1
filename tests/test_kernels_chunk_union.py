"""The chunk-sparse BlockFFN Pallas kernel (moejax.kernels.chunk_union), interpret mode on CPU:
against the dense oracle and the jnp chunk-union reference, edge cases (empty union, full
union, token count not a multiple of the tile, union cap overflow), gated and bf16; and as
BlockFFN's ``path="pallas"`` against ``path="dense"`` in outputs and parameter gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.kernels.chunk_union import chunk_union_pallas
from moejax.nn.blockffn import BlockFFNConfig
from moejax.ops.chunk_union import chunk_union_experts, dense_experts

N, D, E, F = 13, 6, 5, 4


def inputs(seed=0, gated=False, density=0.5):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    a = np.maximum(rng.normal(size=(N, E)) - (1 - density), 0).astype(np.float32)
    a[4:8] = 0.0  # tile 1 (tile = 4): empty union
    w = [jnp.asarray(rng.normal(size=s), jnp.float32) / np.sqrt(s[1])
         for s in ((E, D, F), (E, F, D), (E, D, F))]
    return x, jnp.asarray(a), w[0], w[1], w[2] if gated else None


@pytest.mark.parametrize("tile", [1, 4, 5, 13])
@pytest.mark.parametrize("gated", [False, True])
def test_kernel_equals_dense_oracle(tile, gated):
    x, a, wu, wd, wg = inputs(gated=gated)
    act = "swiglu" if gated else "swish"
    y, overflow = chunk_union_pallas(x, a, a > 0, wu, wd, wg, activation=act, tile=tile,
                                     max_union=E)
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense_experts(x, a, wu, wd, wg, act)),
                               rtol=1e-5, atol=1e-5)
    assert float(overflow) == 0.0
    np.testing.assert_array_equal(np.asarray(y[4:8]), 0)  # rows with no active expert: 0


def test_full_union_and_cap_overflow_match_the_reference():
    x, a, wu, wd, _ = inputs(seed=1, density=2.0)  # (almost) every expert active: full unions
    assert bool(jnp.all(jnp.any(a[:4] > 0, axis=0)))
    for cap in (E, 2, 1):
        y, o = chunk_union_pallas(x, a, a > 0, wu, wd, activation="swish", tile=4, max_union=cap)
        r, ro = chunk_union_experts(x, a, a > 0, wu, wd, None, "swish", tile=4, max_union=cap)
        np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-5, atol=1e-5)
        assert float(o) == float(ro) and (float(o) > 0) == (cap < E)
    with pytest.raises(ValueError, match="max_union"):
        chunk_union_pallas(x, a, a > 0, wu, wd, activation="swish", tile=4, max_union=0)


def test_bf16_inputs_accumulate_in_float32():
    x, a, wu, wd, _ = inputs(seed=2)
    y, _ = chunk_union_pallas(x.astype(jnp.bfloat16), a, a > 0, wu.astype(jnp.bfloat16),
                              wd.astype(jnp.bfloat16), activation="swish", tile=4, max_union=E)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(dense_experts(x, a, wu, wd, None, "swish")),
                               rtol=5e-2, atol=5e-2)


def test_blockffn_pallas_path_equals_dense_with_gradients():
    kw = dict(n_experts=E, d_expert=F, al_coef=0.1, cs_coef=0.3, chunk_len=2)
    dense = BlockFFNConfig(**kw).build(D, rngs=nnx.Rngs(0))
    fast = BlockFFNConfig(path="pallas", union_chunk=3, **kw).build(D, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (2, 7, D))

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(y * jnp.cos(jnp.arange(D))) + aux["aux_loss"]

    (yd, _), (yf, af) = dense(x), fast(x)
    np.testing.assert_allclose(np.asarray(yf), np.asarray(yd), rtol=1e-5, atol=1e-6)
    assert float(af["union_overflow"]) == 0.0
    gd = nnx.grad(loss, argnums=(0, 1))(dense, x)
    gf = nnx.grad(loss, argnums=(0, 1))(fast, x)
    leaves = list(zip(jax.tree.leaves(gd), jax.tree.leaves(gf)))
    assert any(float(jnp.max(jnp.abs(a))) > 1e-3 for a, _ in leaves)
    for a, b in leaves:
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas lowering needs a GPU")
def test_kernel_compiled_on_gpu_matches_reference():
    rng = np.random.default_rng(0)
    n, d, e, f = 512, 256, 32, 64
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    a = jnp.asarray(np.maximum(rng.normal(size=(n, e)) - 1.0, 0), jnp.float32)
    wu = jnp.asarray(rng.normal(size=(e, d, f)) / 16, jnp.float32)
    wd = jnp.asarray(rng.normal(size=(e, f, d)) / 8, jnp.float32)
    y, _ = chunk_union_pallas(x, a, a > 0, wu, wd, activation="swish", tile=32, max_union=e,
                              interpret=False)
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense_experts(x, a, wu, wd, None,
                                                                       "swish")),
                               rtol=2e-2, atol=2e-2)


def test_blockffn_is_a_skeleton_slot_but_not_a_top_k_slot():
    from moejax.nn.moe import MoESkeleton
    from moejax.nn.routing_modes import moe_slots

    layer = BlockFFNConfig(n_experts=E, d_expert=F).build(D, rngs=nnx.Rngs(0))
    assert isinstance(layer, MoESkeleton) and moe_slots(layer) == []
