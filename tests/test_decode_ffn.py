"""moejax.kernels.decode_ffn: the one-token FFN input kernel (the residual add, the norm's factor,
the in product with a BlockFFN router's scores and norm, the activation, the experts' weights)
against the XLA step it replaces, compiled on a GPU and in Pallas's interpreter elsewhere, and
the calls it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import decode_ffn, decode_rows
from moejax.kernels.decode_ffn import Router, fused_ffn_in, supports
from moejax.nn.norms import inv_rms
from moejax.ops.activations import activation_fn
from tests.test_decode_qkv import INTERPRET, _same_bits

D = 64


def _oracle(x, o, w_KN, b, F, E, gated, activation, router):
    """The lean XLA step: the stream ``x + o``, its factor, the in product rounded and
    scaled, the activation, and with a router its pieces' scores, ReLU, RMSNorm and each
    expert's weight on its columns."""
    dt = x.dtype
    x2 = x + o
    r = inv_rms(x2, 1e-5)
    h = jax.lax.dot_general(x2, w_KN, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    H = (2 if gated else 1) * E * F
    hh = h[:, :H].astype(dt) * r.astype(dt)
    if b is not None:
        hh = hh + b
    act = activation_fn(activation)  # in float32, rounded once (XLA's GPU fusions)
    hh = hh.astype(jnp.float32)
    g = (act(hh[:, :E * F]) * hh[:, E * F:] if gated else act(hh)).astype(dt)
    if router is not None:
        a = jax.nn.relu(sum(h[:, H + p * E:H + (p + 1) * E] for p in range(router.n_pieces)) * r)
        if router.norm_scale is not None:
            a = (a * inv_rms(a, router.eps) * router.norm_scale).astype(router.norm_dtype)
        g = (g.reshape(-1, E, F) * a.astype(dt)[:, :, None]).reshape(-1, E * F)
    return g, x2


CASES = {  # F, E, gated, activation, bias, router (pieces, norm)
    "dense swiglu": (32, 1, True, "swiglu", False, None),
    "dense gelu, bias": (48, 1, False, "gelu", True, None),
    "blockffn gated, router norm": (16, 4, True, "swiglu", False, (3, True)),
    "blockffn relu, no router norm": (32, 8, False, "relu", False, (1, False)),
}


# two rows (one token per cache row) in every case; a speculative round's verified block of 7
# rows in two
ROWS = [(c, layout, dt, 2) for c in CASES for layout in ("kn", "nk")
        for dt in (jnp.float32, jnp.bfloat16)]
ROWS += [("blockffn gated, router norm", "nk", jnp.bfloat16, 7),
         ("dense gelu, bias", "kn", jnp.bfloat16, 7)]


@pytest.mark.parametrize("case,layout,dt,rows", ROWS)
def test_the_kernel_equals_the_xla_step(case, layout, dt, rows):
    """The hidden activations the down product reads and the residual stream of ``rows``
    token rows, all in each program (its weights read once for them). The activation is
    computed in float32 and rounded once, as XLA's GPU fusions do (its CPU rounds bfloat16
    after each op: one rounding step apart in about half the values)."""
    F, E, gated, activation, bias, rt = CASES[case]
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (rows, D)).astype(dt)
    o = jax.random.normal(ks[1], (rows, D)).astype(dt)
    cols = (2 if gated else 1) * E * F + (rt[0] * E if rt else 0)
    w = (jax.random.normal(ks[2], (D, cols)) * 0.2).astype(dt)
    b = (jax.random.normal(ks[3], ((2 if gated else 1) * F,)) * 0.2).astype(dt) if bias else None
    router = None if rt is None else Router(
        E, rt[0], jax.random.uniform(ks[4], (E,)) + 0.5 if rt[1] else None, 1e-6,
        jnp.dtype(jnp.float32))
    got = fused_ffn_in(x, o, w if layout == "kn" else w.T, b, d_hidden=F, n_experts=E,
                       gated=gated, activation=activation, eps=1e-5, layout=layout,
                       router=router, interpret=INTERPRET)
    want = _oracle(x, o, w, b, F, E, gated, activation, router)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    g, e = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    assert got[0].dtype == dt and g.shape == (rows, E * F)
    if dt == jnp.float32:
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)
    else:  # rounded as the oracle rounds
        _same_bits(g, e)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_a_wide_block_is_summed_in_more_steps(layout):
    """Blocks of 128 hidden columns over a width of 256: the contraction runs in 4 steps of 64
    (a block's weights kept to 8192 values), with the same sums."""
    ks = jax.random.split(jax.random.key(1), 3)
    x, o = (jax.random.normal(k, (1, 256)) for k in ks[:2])
    w = jax.random.normal(ks[2], (256, 512)) * 0.1
    got = fused_ffn_in(x, o, w if layout == "kn" else w.T, None, d_hidden=256, gated=True,
                       activation="swiglu", eps=1e-5, layout=layout, interpret=INTERPRET)
    want = _oracle(x, o, w, None, 256, 1, True, "swiglu", None)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5, rtol=1e-5)


def test_calls_the_kernel_does_not_take_are_refused_with_the_reason():
    assert supports(D, 32, 4, 1, jnp.bfloat16) is None
    assert supports(D, 32, 4, decode_ffn.MAX_ROWS, jnp.bfloat16) is None
    assert "9 token rows" in supports(D, 32, 4, 9, jnp.bfloat16)
    assert "hidden width 8" in supports(D, 8, 4, 1, jnp.bfloat16)
    assert "d_model=40" in supports(40, 32, 4, 1, jnp.bfloat16)
    assert "6 experts" in supports(D, 32, 6, 1, jnp.bfloat16)
    assert "float16" in supports(D, 32, 4, 1, jnp.float16)
    x = jnp.zeros((1, D))
    with pytest.raises(ValueError, match="hidden width 8.*lean_decoder without fused=True"):
        fused_ffn_in(x, x, jnp.zeros((D, 8)), None, d_hidden=8, gated=False,
                     activation="relu", eps=1e-5, interpret=True)


def test_without_pallas_triton_no_call_is_taken(monkeypatch):
    monkeypatch.setattr(decode_rows, "AVAILABLE", False)
    assert "no Pallas Triton" in supports(D, 32, 4, 1, jnp.bfloat16)
