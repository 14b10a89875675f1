"""moejax's models under a mesh of explicit axes (jax.make_mesh's default): the decoder's
forward, gradients and cached decoding, generation, batched sampling and speculative decoding,
the BERT encoder and the ViT give the values they give without a mesh, outputs keep the
batch's sharding, and variables a call changes are written back (moejax.nn.auto_axes). On 8
simulated CPU devices, in a subprocess."""

import pytest

from tests.devices import run_on_devices

_SCRIPT = r"""
import warnings
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from moejax.nn.auto_axes import explicit_mesh
from moejax.nn.decoder import DecoderConfig, DecoderLM, keep_layers
from moejax.nn.ders_moe import DeRSFrozen, DeRSMoEConfig
from moejax.nn.encoder import BertEncoder, ViT, bert_encoder_config, vit_config
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_layer import MoELayer
from moejax.nn.sample import sample, sampler
from moejax.nn.slots import layer_pattern
from moejax.nn.speculative import speculative_decoder
from moejax.ops.losses import cross_entropy
from moejax.xla_flags import known_options

def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)

moe = MoEConfig(n_experts=4, top_k=2, d_expert=8)
cfg = DecoderConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4,
                    ffn_slots=layer_pattern(2, DenseFFNConfig(d_hidden=16, activation="swiglu"),
                                            moe, every=2))
lm = DecoderLM(cfg, rngs=nnx.Rngs(0))
tokens = jax.random.randint(jax.random.key(0), (8, 6), 0, 32)

def loss(model, tokens):
    logits, aux = model(tokens[:, :-1], train=True, key=jax.random.key(3))
    return cross_entropy(logits, tokens[:, 1:]) + aux["aux_loss"]

# the values without a mesh, each compiled whole (run op by op, each op compiles on its own)
want_fwd = nnx.jit(lambda m, t: m(t))(lm, tokens)
want_grads = nnx.jit(nnx.grad(loss))(lm, tokens)
want_dec = nnx.jit(lambda m, t, c: m.decode(t, c))(lm, tokens, lm.init_cache(8, 10))
bert = BertEncoder(bert_encoder_config(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                                       d_hidden=24, max_position=8, pooling="mean"),
                   rngs=nnx.Rngs(1))
mask = jnp.ones((8, 6), bool).at[:, 4:].set(False)
want_bert = nnx.jit(lambda m, t, k: m(t, mask_BT=k))(bert, tokens, mask)
vit = ViT(vit_config(image_size=8, patch_size=4, d_model=16, n_layers=1, n_heads=2,
                     d_hidden=24, n_classes=3, n_channels=1), rngs=nnx.Rngs(2))
images = jax.random.normal(jax.random.key(4), (8, 8, 8, 1))
want_vit, want_feat = nnx.jit(lambda m, x: (m(x), m.features(x)))(vit, images)
layer = MoELayer(moe.replace(router="noisy"), 16, rngs=nnx.Rngs(5))
frozen_slot = DeRSMoEConfig(moe=moe, form="lm", lm_rank=2, freeze_shared=True)
frozen_lm = DecoderLM(DecoderConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2,
                                    ffn_slots=(frozen_slot,)), rngs=nnx.Rngs(6))
frozen_before = nnx.state(frozen_lm, DeRSFrozen)
count = int(layer.rngs.count[...])

lens = jnp.array([4, 3, 4, 2, 4, 4, 1, 4])
spec = speculative_decoder(lm, keep_layers(lm, [0]), 5, draft_len=2)
options, _ = known_options({"xla_cpu_enable_fast_math": False})
assert options
draw = sampler(lm, 4, compiler_options=options)
draw(tokens[:, :4], lens, key=jax.random.key(7))  # compiled without a mesh first
want_decoding = (generate(lm, tokens[:, :4], 4),
                 sample(lm, tokens[:, :4], lens, 4, key=jax.random.key(7)), spec(tokens[:1, :4]))

mesh = jax.make_mesh((2, 4), ("data", "model"))
assert not explicit_mesh()
with jax.set_mesh(mesh):
    assert explicit_mesh()
    ts = jax.device_put(tokens, P("data"))
    for run in (lambda m, t: m(t), nnx.jit(lambda m, t: m(t))):  # eager and jitted
        logits, aux = run(lm, ts)
        close((logits, aux["aux_loss"]), (want_fwd[0], want_fwd[1]["aux_loss"]))
        assert logits.sharding.spec == P("data", None, None), logits.sharding
        assert aux["layers"][1]["load"].sharding.spec == P(None), aux["layers"][1]["load"]
    close(nnx.jit(nnx.grad(loss))(lm, ts), want_grads)
    cache = jax.device_put(lm.init_cache(8, 10), P("data"))
    logits, cache = nnx.jit(lambda m, t, c: m.decode(t, c))(lm, ts, cache)
    close((logits, cache), want_dec)
    assert cache[0].k_BSGJ.sharding.spec[0] == "data", cache[0].k_BSGJ.sharding
    print("decoder OK")
    close(bert(ts, mask_BT=jax.device_put(mask, P("data"))), want_bert)
    close(nnx.jit(lambda m, x: m(x))(vit, jax.device_put(images, P("data"))), want_vit)
    close(vit.features(jax.device_put(images, P("data"))), want_feat)
    print("encoders OK")
    x = jax.device_put(jax.random.normal(jax.random.key(6), (8, 4, 16)), P("data"))
    a, b = layer(x), layer(x)  # each call draws new noise from the layer's own stream
    assert int(layer.rngs.count[...]) == count + 2, layer.rngs.count
    assert not np.allclose(np.asarray(a), np.asarray(b))
    # variables the call does not change keep their sharding, even where their first axis
    # has the batch's size (DeRS's frozen shared weights [8, 8] for a batch of 8)
    frozen_lm(ts)
    for v in jax.tree.leaves(nnx.state(frozen_lm, DeRSFrozen)):
        assert jax.typeof(v).sharding.spec == P(None, None), jax.typeof(v).sharding
    close(nnx.state(frozen_lm, DeRSFrozen), frozen_before)
    print("state OK")
    prompts = jax.device_put(tokens[:, :4], P("data"))
    with warnings.catch_warnings(record=True) as said:  # the cache's buffers are donated
        warnings.simplefilter("always")
        generated = generate(lm, prompts, 4)
    assert not [w for w in said if "donated" in str(w.message)], [str(w.message) for w in said]
    got = (generated, sample(lm, prompts, lens, 4, key=jax.random.key(7)),
           spec(tokens[:1, :4]))
    for a, b in zip(got, want_decoding):
        assert all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert got[1].tokens_BS.sharding.spec[0] == "data", got[1].tokens_BS.sharding
    # the sampler compiled with XLA options: its program, not only its call, runs the mesh's
    # axes automatic, compiled again for this mesh
    with_options = draw(prompts, lens, key=jax.random.key(7))
    assert np.array_equal(np.asarray(with_options.tokens_BS), np.asarray(got[1].tokens_BS))
    assert with_options.tokens_BS.sharding.spec[0] == "data", with_options.tokens_BS.sharding
    print("decoding OK")
print("OK")
"""


@pytest.mark.slow
def test_models_under_a_mesh_of_explicit_axes_equal_the_unsharded_call():
    out = run_on_devices(_SCRIPT)
    for stage in ("decoder OK", "encoders OK", "state OK", "decoding OK"):
        assert stage in out, out[-2000:]
