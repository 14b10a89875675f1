"""TransformerBlock (pre-LN RMSNorm, Llama-style) vs numpy, slot aux pass-through, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.block import TransformerBlock, run_blocks
from moejax.nn.ffn import DenseFFNConfig
from tests.test_nn_layers import attention_numpy, params_np, silu_np

RNG = np.random.default_rng(1)


def rms_np(x, g, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * g


def test_pre_rmsnorm_block_matches_numpy():
    D, H, G, K = 8, 4, 2, 2
    blk = TransformerBlock(D, n_heads=H, n_kv_heads=G, head_dim=K,
                           ffn_slot=DenseFFNConfig(d_hidden=12, activation="swiglu"),
                           norm_position="pre", norm_kind="rmsnorm", norm_eps=1e-5,
                           causal=True, rope_style="half", rope_base=10000.0, rngs=nnx.Rngs(0))
    blk.attn_norm.scale[...] = jnp.asarray(RNG.standard_normal(D).astype(np.float32))
    blk.ffn_norm.scale[...] = jnp.asarray(RNG.standard_normal(D).astype(np.float32))
    x = RNG.standard_normal((2, 5, D)).astype(np.float32)
    y, aux = blk(jnp.asarray(x))
    assert aux == {}
    g1, g2 = np.asarray(blk.attn_norm.scale[...]), np.asarray(blk.ffn_norm.scale[...])
    pos = np.broadcast_to(np.arange(5), (2, 5))
    h = x + attention_numpy(rms_np(x, g1, 1e-5), params_np(blk.attn), H, G, K, causal=True,
                            rope="half", pos=pos)
    f = blk.ffn
    n = rms_np(h, g2, 1e-5)
    ffn = (silu_np(n @ np.asarray(f.w_gate[...])) * (n @ np.asarray(f.w_up[...]))) \
        @ np.asarray(f.w_down[...])
    np.testing.assert_allclose(y, h + ffn, rtol=1e-4, atol=1e-4)
    # run_blocks: no slot aux -> aux_loss 0.0 and one {} per block
    y2, aux2 = run_blocks([blk, blk], jnp.asarray(x))
    assert aux2["layers"] == ({}, {}) and float(aux2["aux_loss"]) == 0.0
    np.testing.assert_allclose(y2, blk(blk(jnp.asarray(x))[0])[0], rtol=1e-6)


def test_block_rejects_bad_norm_options():
    slot = DenseFFNConfig(d_hidden=4, activation="gelu")
    with pytest.raises(ValueError, match="norm_position"):
        TransformerBlock(4, n_heads=2, ffn_slot=slot, norm_position="middle", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="norm kind"):
        TransformerBlock(4, n_heads=2, ffn_slot=slot, norm_kind="batchnorm", rngs=nnx.Rngs(0))
