"""moejax.kernels.decode_route: the token-sparse BlockFFN input kernel (the residual add, the
norm's factor, the router's scores with their ReLU and RMSNorm, the experts' input, the expert
part's zeroed target) against the lean XLA step it replaces, compiled on a GPU and in Pallas's
interpreter elsewhere, and the calls it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import decode_route, decode_rows
from moejax.kernels.decode_ffn import Router
from moejax.kernels.decode_route import fused_route, supports
from moejax.nn.norms import inv_rms
from tests.test_decode_qkv import INTERPRET, _same_bits

D, E = 64, 8


def _oracle(x, o, w_DE, router):
    """The lean XLA step (moejax.nn.lean_ffn.LeanBlockFFN._routed after the stream): the
    stream and its factor, the router's float32 product times the factor, ReLU, the router
    norm, the experts' input ``s r``."""
    s = x + o
    r = inv_rms(s, 1e-5)
    s32 = s.astype(jnp.float32)
    a1 = jax.nn.relu(s32 @ w_DE * r)
    a = a1 if router.norm_scale is None else (
        a1 * inv_rms(a1, router.eps) * router.norm_scale).astype(router.norm_dtype)
    return (s32 * r).astype(x.dtype), a, a1, s


def _router(norm: bool, norm_dtype=jnp.float32):
    scale = jax.random.uniform(jax.random.key(3), (E,)) + 0.5 if norm else None
    return Router(E, 1, scale, 1e-6, jnp.dtype(norm_dtype))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("norm", [True, False])
def test_the_kernel_equals_the_xla_step(norm, layout, dt, rows):
    """A decoded token and a verified block of 5: the experts' input, the combine weights, the
    ReLU scores, the stream and the zeroed target. The router's product sums its float32
    terms in another order: its scores agree to float32 rounding."""
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (rows, D)).astype(dt)
    o = jax.random.normal(ks[1], (rows, D)).astype(dt)
    w = jax.random.normal(ks[2], (D, E)) * 0.3
    router = _router(norm)
    got = fused_route(x, o, w if layout == "kn" else w.T, router, eps=1e-5, layout=layout,
                      interpret=INTERPRET)
    want = _oracle(x, o, w, router)
    assert [g.dtype for g in got] == [dt, jnp.float32, jnp.float32, dt, jnp.float32]
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    np.testing.assert_array_equal(np.asarray(got[4]), np.zeros((rows, D), np.float32))
    for g, e in zip(got[1:3], want[1:3]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-6, rtol=1e-5)
    xe, want_xe = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    if dt == jnp.float32:
        np.testing.assert_allclose(xe, want_xe, atol=1e-6, rtol=1e-6)
    else:
        _same_bits(xe, want_xe)
    assert (np.asarray(got[1]) > 0).sum() > 0 and (np.asarray(got[2]) == 0).sum() > 0  # ReLU


def test_the_combine_weights_take_the_norms_dtype_and_a_wide_model_more_steps():
    """A bfloat16 router norm: its weights rounded once, as the module's RMSNorm rounds; a
    width of 512 contracted in steps of 256."""
    ks = jax.random.split(jax.random.key(1), 3)
    x, o = (jax.random.normal(k, (2, 512)).astype(jnp.bfloat16) for k in ks[:2])
    w = jax.random.normal(ks[2], (512, E)) * 0.1
    router = _router(True, jnp.bfloat16)
    got = fused_route(x, o, w, router, eps=1e-5, interpret=INTERPRET)
    want = _oracle(x, o, w, router)
    assert got[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32),
                               rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), atol=1e-6, rtol=1e-5)


def test_calls_the_kernel_does_not_take_are_refused_with_the_reason():
    assert supports(D, 8, 1, jnp.bfloat16) is None
    assert supports(D, 8, decode_route.MAX_TOKENS, jnp.float32) is None
    assert "65 token rows" in supports(D, 8, 65, jnp.bfloat16)
    assert "d_model=40" in supports(40, 8, 1, jnp.bfloat16)
    assert "6 experts" in supports(D, 6, 1, jnp.bfloat16)
    assert "float16" in supports(D, 8, 1, jnp.float16)
    x = jnp.zeros((1, D))
    with pytest.raises(ValueError, match=r"router weights \(64, 4\) for d_model=64, 8 experts"
                                         ".*lean_decoder without fused=True"):
        fused_route(x, x, jnp.zeros((D, 4)), _router(False), eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="6 experts"):
        fused_route(x, x, jnp.zeros((D, 6)), Router(6, 1, None, 1e-6, jnp.dtype(jnp.float32)),
                    eps=1e-5, interpret=True)


def test_without_pallas_triton_no_call_is_taken(monkeypatch):
    monkeypatch.setattr(decode_rows, "AVAILABLE", False)
    assert "no Pallas Triton" in supports(D, 8, 1, jnp.bfloat16)
