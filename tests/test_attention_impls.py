"""``jax.nn.dot_product_attention`` (the default) against the einsum oracle: values and
gradients with GQA, padding, packed segments, fully masked rows and the KV-cache path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.attention import Attention, dot_product_attention
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from tests.toy_models import jitted


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (6, 1)])
def test_values_and_gradients_match_the_oracle(H, G):
    k0, k1, k2, k3 = jax.random.split(jax.random.key(0), 4)
    B, T, S, J = 2, 5, 7, 8
    q = jax.random.normal(k0, (B, T, H, J))
    k = jax.random.normal(k1, (B, S, G, J))
    v = jax.random.normal(k2, (B, S, G, J))
    mask = jax.random.uniform(k3, (B, T, S)) < 0.6
    mask = mask.at[0, 2].set(False)  # a fully masked query row: uniform, finite

    def f(impl):
        return lambda q, k, v: jnp.sum(jnp.sin(dot_product_attention(q, k, v, mask, impl=impl)))

    a = dot_product_attention(q, k, v, mask, impl="jax")
    b = dot_product_attention(q, k, v, mask, impl="einsum")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a[0, 2]), np.asarray(jnp.mean(
        jnp.repeat(v[0], H // G, axis=1), axis=0)), rtol=1e-5, atol=1e-5)
    ga = jax.jit(jax.grad(f("jax"), argnums=(0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(f("einsum"), argnums=(0, 1, 2)))(q, k, v)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_module_paths_and_decoder_agree():
    layers = {impl: Attention(16, 4, 2, rope_style="half", impl=impl, rngs=nnx.Rngs(1))
              for impl in ("jax", "einsum")}
    x = jax.random.normal(jax.random.key(2), (2, 6, 16))
    mask = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    seg = jnp.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    a, b = (jitted(layers[i])(x, mask_BT=mask, segment_ids_BT=seg) for i in ("jax", "einsum"))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    caches = {i: layers[i].init_cache(2, 8) for i in layers}
    decode = nnx.jit(lambda layer, x, cache: layer.decode(x, cache))
    for t in range(3):  # the KV-cache path: one token at a time
        outs = {}
        for i in layers:
            outs[i], caches[i] = decode(layers[i], x[:, t:t + 1], caches[i])
        np.testing.assert_allclose(np.asarray(outs["jax"]), np.asarray(outs["einsum"]),
                                   rtol=1e-5, atol=1e-5)
    cfg = dense_decoder_config(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                               d_hidden=32)
    ids = jax.random.randint(jax.random.key(3), (2, 9), 0, 32)
    la = jitted(DecoderLM(cfg.replace(attention="jax"), rngs=nnx.Rngs(0)))(ids)[0]
    lb = jitted(DecoderLM(cfg.replace(attention="einsum"), rngs=nnx.Rngs(0)))(ids)[0]
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attention impl='flash'"):
        Attention(16, 4, impl="flash", rngs=nnx.Rngs(0))
    want = "einsum" if jax.default_backend() == "cpu" else "jax"
    assert Attention(16, 4, rngs=nnx.Rngs(0)).impl == want  # "auto"
