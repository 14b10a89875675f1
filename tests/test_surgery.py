"""Model surgery through pure variable dicts: a model built from a pure dict holds its own
copies of the arrays, and arrays that disagree with the config are refused by path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.nn.surgery import build_from_pure


def _model():
    cfg = dense_decoder_config(vocab_size=32, d_model=8, n_layers=1, n_heads=2, d_hidden=16,
                               max_seq_len=8)
    return cfg, DecoderLM(cfg, rngs=nnx.Rngs(0))


def test_a_model_built_from_a_pure_dict_computes_the_same_and_owns_its_arrays():
    cfg, model = _model()
    pure = nnx.to_pure_dict(nnx.state(model))
    new = build_from_pure(lambda: DecoderLM(cfg, rngs=nnx.Rngs(1)), pure)
    x = jnp.arange(6)[None]
    np.testing.assert_array_equal(np.asarray(new(x)[0]), np.asarray(model(x)[0]))
    new.blocks[0].ffn.w_up[...] = jnp.zeros_like(new.blocks[0].ffn.w_up[...])
    assert float(jnp.abs(model.blocks[0].ffn.w_up[...]).sum()) > 0  # the source is untouched


@pytest.mark.parametrize("change,message", [
    (lambda a: a[:, :8], r"\['blocks'\]\[0\]\['ffn'\]\['w_up'\] is float32\[8, 8\], the config "
                         r"gives float32\[8, 16\]"),
    (lambda a: a.astype(jnp.float16), r"\['w_up'\] is float16\[8, 16\], the config gives "
                                      r"float32\[8, 16\]"),
])
def test_arrays_that_disagree_with_the_config_are_refused_by_path(change, message):
    cfg, model = _model()
    pure = nnx.to_pure_dict(nnx.state(model))
    pure["blocks"][0]["ffn"]["w_up"] = change(pure["blocks"][0]["ffn"]["w_up"])
    with pytest.raises(ValueError, match=message):
        build_from_pure(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), pure)
    # a float64 host array is what the model's float32 variable takes (jax's default)
    ok = jax.tree.map(lambda a: np.asarray(a, np.float64) if a.dtype == jnp.float32 else a,
                      nnx.to_pure_dict(nnx.state(model)))
    build_from_pure(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), ok)
