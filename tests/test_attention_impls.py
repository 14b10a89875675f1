"""``jax.nn.dot_product_attention`` (the default) against the einsum oracle: values and
gradients with GQA, padding, packed segments, fully masked rows and the KV-cache path."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.kernels.flash_attention import flash_kernel
from moejax.kernels.grouped.ragged import cross_compile
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
    with pytest.raises(ValueError, match="attention impl='sparse'"):
        Attention(16, 4, impl="sparse", rngs=nnx.Rngs(0))
    assert Attention(16, 4, rngs=nnx.Rngs(0)).impl == "flash"  # "auto": picked when lowered


def _qkv_mask(B, T, S, H, G, J, seed=0):
    k0, k1, k2, k3 = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k0, (B, T, H, J))
    k = jax.random.normal(k1, (B, S, G, J))
    v = jax.random.normal(k2, (B, S, G, J))
    return q, k, v, k3


# jax 0.11's Pallas interpreters: Mosaic TPU's runs through io callbacks, which tokamax's
# remat-optimised VJP refuses (its values are checked, its gradients from jax 0.12 on), and
# the HLO interpreter does not lower a ``program_id`` inside the kernel's loops, as the Triton
# kernel's decode step has (on a CPU; a GPU compiles it, and the export tests prove its
# lowering for cuda)
OLD_INTERPRETERS = jax.__version_info__ < (0, 12)


@contextlib.contextmanager
def _pallas_interpreted(platform: str):
    """Run ``platform``'s Pallas kernels on the CPU in Pallas's interpreters: Mosaic TPU's
    own (``force_tpu_interpret_mode``) or, for Triton, the generic HLO interpreter (every
    ``pallas_call`` lowered for the CPU is interpreted while inside)."""
    from jax._src.interpreters import mlir
    from jax._src.pallas import pallas_call as pc
    from jax.experimental.pallas import tpu as pltpu

    if platform == "tpu":
        with pltpu.force_tpu_interpret_mode(), cross_compile(None):
            yield
        return
    cpu = mlir._platform_specific_lowerings["cpu"]
    before = cpu.get(pc.pallas_call_p)
    mlir.register_lowering(pc.pallas_call_p, lambda ctx, *a, interpret, **p: (
        pc._pallas_call_lowering(ctx, *a, interpret=True, **p)), platform="cpu")
    try:
        with cross_compile(9.0):
            yield
    finally:
        if before is None:
            cpu.pop(pc.pallas_call_p, None)
        else:
            cpu[pc.pallas_call_p] = before


@pytest.mark.parametrize("platform,case", [("tpu", "train"), ("tpu", "train 130"),
                                           ("cuda", "train"), ("cuda", "decode"),
                                           ("cuda", "decode one")])
def test_the_flash_kernel_equals_the_oracle_in_values_and_gradients(platform, case):
    """tokamax's flash attention, the kernel ``impl="flash"`` runs on a TPU (Mosaic: values
    and gradients) or an NVIDIA GPU (Triton: values; compiled on a GPU, training's
    gradients too), in Pallas's interpreters: causal training attention with GQA, padded
    keys and a fully masked query row (130 long too: the TPU kernel's blocks are 128, so the
    sequence is padded to 256 and cut back; the masked row is uniform over the first block),
    and a decode step's 3 (or 1) new tokens over a cache
    whose rows hold 100 and 37 valid slots, given as the rows' lengths (the kernel's key loop
    ends there; one new token needs no mask beside them) as a GPU decode step runs it (the TPU
    kernel takes query blocks of 128 and declines a decode step, so a TPU decodes on XLA's
    attention)."""
    compiled = platform == "cuda" and jax.default_backend() == "gpu"  # else interpreted
    if OLD_INTERPRETERS and platform == "cuda" and case != "train" and not compiled:
        pytest.skip("jax < 0.12: the HLO interpreter does not lower program_id in a loop")
    # interpreted on the CPU beside a GPU too (Mosaic's interpreter runs on the host)
    with contextlib.nullcontext() if compiled else _on_cpu():
        _flash_against_the_oracle(platform, case, compiled)


def _on_cpu():
    """Arrays made and programs run on the CPU (a GPU machine's default is its GPU)."""
    return jax.default_device(jax.devices("cpu")[0])


def _flash_against_the_oracle(platform: str, case: str, compiled: bool) -> None:
    B, H, G = 2, 4, 2
    if case.startswith("train"):
        T = S = int(case.split()[-1]) if " " in case else 128
        q, k, v, key = _qkv_mask(B, T, S, H, G, 128)
        real = jnp.arange(S)[None, :] < jnp.array([[T], [90]])
        mask = jnp.tril(jnp.ones((T, S), bool))[None] & real[:, None, :]
        # a fully masked query row (padding): finite, the oracle's values (uniform) but on a
        # TPU past one block of keys; the loss leaves it out, as the models' losses do
        mask = mask.at[1, 5].set(False)
    else:
        T, S = (3 if case == "decode" else 1), 256
        q, k, v, key = _qkv_mask(B, T, S, H, G, 64, seed=1)
        slot_BT = jnp.array([[100], [37]]) + jnp.arange(T)[None]
        mask = jnp.arange(S)[None, None, :] <= slot_BT[:, :, None]
    lengths = None if case.startswith("train") else jnp.array([100, 37], jnp.int32) + T

    weight = jnp.any(mask, axis=-1)[:, :, None, None]  # fully masked rows out of the loss

    def loss(q, k, v, flash):
        o = (flash_kernel(q, k, v, mask, platform, lengths) if flash
             else dot_product_attention(q, k, v, mask, impl="einsum"))
        return jnp.sum(o * jnp.cos(o) * weight), o

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                   static_argnums=3)
    (_, want), g_want = grad(q, k, v, False)
    with _pallas_interpreted(platform):
        # Triton's VJP kernels do not run in the HLO interpreter (nor, on jax 0.11, tokamax's
        # TPU VJP in Mosaic's); a GPU compiles them, and training is what takes gradients
        grads = ((compiled and case.startswith("train"))
                 or (platform == "tpu" and not OLD_INTERPRETERS))
        if not grads:
            got, g_got = jax.jit(loss, static_argnums=3)(q, k, v, True)[1], ()
        else:
            (_, got), g_got = grad(q, k, v, True)
    rows = np.ones(mask.shape[:2], bool)
    if platform == "tpu" and T > 128:  # a fully masked row: uniform over the first 128 keys
        rows = np.asarray(weight[:, :, 0, 0])
        np.testing.assert_allclose(np.asarray(got[1, 5]), np.repeat(
            np.asarray(v[1, :128].mean(0)), H // G, axis=0), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=2e-5,
                               rtol=1e-5)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-4)


def test_flash_on_the_cpu_is_xlas_attention():
    """Lowered for the CPU, ``"flash"`` is the einsum (bit for bit): no kernel, no branch
    (on the CPU beside a GPU too)."""
    with _on_cpu():
        q, k, v, key = _qkv_mask(2, 5, 7, 4, 2, 8)
        mask = jax.random.uniform(key, (2, 5, 7)) < 0.6
        a = jax.jit(lambda *x: dot_product_attention(*x, impl="flash"))(q, k, v, mask)
        b = jax.jit(lambda *x: dot_product_attention(*x, impl="einsum"))(q, k, v, mask)
    # lowered for the CPU whatever the default device (a GPU's lowering would hold the kernel)
    text = jax.export.export(jax.jit(lambda *x: dot_product_attention(*x, impl="flash")),
                             platforms=("cpu",))(q, k, v, mask).mlir_module()
    assert a.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "custom_call" not in text and "case" not in text
