"""moejax.kernels.decode_qkv: the one-token attention input kernel (the norm's factor, the q, k
and v product, RoPE, both cache writes) against the XLA step it replaces, compiled on a GPU
and in Pallas's interpreter elsewhere, and the calls it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels import decode_rows
from moejax.kernels.decode_qkv import fused_qkv, supports
from moejax.nn.attention import _write_cache
from moejax.nn.lean_ops import Residual
from moejax.nn.norms import inv_rms
from moejax.nn.rope import apply_rope

H, G, J, D, S = 4, 2, 16, 64, 8
INTERPRET = jax.default_backend() != "gpu"  # on a GPU (gpu_check's decode_tests) compiled


def _oracle(x_BTD, w_KN, b, k_BSGJ, v_BSGJ, pos_BT, start_B, dt, rope_base):
    """The lean XLA step: the product rounded to ``dt``, times the rounded factor, the bias,
    RoPE in float32, each row's tokens written from its start."""
    r = inv_rms(x_BTD, 1e-5).astype(dt)
    y = jax.lax.dot_general(x_BTD.astype(dt), w_KN.astype(dt), (((2,), (0,)), ((), ()))) * r
    if b is not None:
        y = y + b.astype(dt)
    B, T = x_BTD.shape[:2]
    q, k, v = (y[..., a:z].reshape(B, T, -1, J)
               for a, z in ((0, H * J), (H * J, (H + G) * J), ((H + G) * J, (H + 2 * G) * J)))
    if rope_base is not None:
        q, k = (apply_rope(t, pos_BT, base=rope_base, style="half") for t in (q, k))
    return q, _write_cache(k_BSGJ, k, start_B), _write_cache(v_BSGJ, v, start_B)


def _same_bits(got, want):
    """bfloat16 values rounded as the oracle rounds them: the same bits in the interpreter;
    compiled, the products' float32 sums run in another order, so a value may round one step
    the other way (at most 2% of them)."""
    if INTERPRET:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
        assert np.mean(got == want) >= 0.98


def _operands(dt, bias, T=1):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (2, T, D)).astype(dt)
    w = (jax.random.normal(ks[1], (D, (H + 2 * G) * J)) * 0.2).astype(dt)
    b = (jax.random.normal(ks[2], ((H + 2 * G) * J,)) * 0.2).astype(dt) if bias else None
    k = jax.random.normal(ks[3], (2, S, G, J)).astype(dt)
    v = jax.random.normal(ks[4], (2, S, G, J)).astype(dt)
    return x, w, b, k, v


@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("bias,rope_base,add,T", [
    (False, 10000.0, True, 1), (True, 500.0, False, 1), (False, None, False, 3),
    (True, 10000.0, True, 3)])
def test_the_kernel_equals_the_xla_step(dt, layout, bias, rope_base, add, T):
    """Two cache rows, each with ``T`` new tokens from its own start at positions apart from
    the slots (as packed or offset decoding gives): q, and each cache with its rows' tokens
    written and nothing else changed; with ``y``, the block's input ``x + y`` made in the
    kernel and returned. bfloat16 rounds as the XLA step does, so its values are the same
    bits."""
    x, w, b, k, v = _operands(dt, bias, T)
    y = jax.random.normal(jax.random.key(7), x.shape).astype(dt) if add else None
    start = jnp.array([3, 1])
    pos = jnp.array([[3], [11]]) + jnp.arange(T)[None, :]
    slots = start[:, None] + jnp.arange(T)[None, :]
    flat = lambda a: None if a is None else a.reshape(2 * T, *a.shape[2:])  # noqa: E731
    got = fused_qkv(flat(x), w if layout == "kn" else w.T, b, k, v, flat(pos), flat(slots),
                    n_heads=H, eps=1e-5, rope_base=rope_base, layout=layout, y_ND=flat(y),
                    interpret=INTERPRET)
    x_in = x if y is None else x + y
    want = _oracle(x_in, w, b, k, v, pos, start, dt, rope_base)
    want = (flat(want[0]), *want[1:])
    assert len(got) == 3 + add
    if add:
        np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(flat(x_in)))
        got = got[:3]
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.dtype == e.dtype
        if dt == jnp.bfloat16:
            _same_bits(np.asarray(g, np.float32), np.asarray(e, np.float32))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5, rtol=1e-5)
    # the slots not written are the caches as they came in
    untouched = np.ones((2, S), bool)
    for row in range(2):
        untouched[row, int(start[row]):int(start[row]) + T] = False
    for g, old in zip(got[1:], (k, v)):
        np.testing.assert_array_equal(np.asarray(g)[untouched], np.asarray(old)[untouched])


def test_a_float32_addend_is_added_to_the_stream_rounding_once():
    """A chunk-union expert part's float32 sum as ``y`` (a :class:`Residual` of a bfloat16
    stream): the block's input is ``x + y`` in float32 rounded once, as
    ``Residual.summed`` makes it, not ``y`` rounded first (which differs here in some values),
    and the q/k/v product reads that input."""
    x, w, b, k, v = _operands(jnp.bfloat16, False)
    x = x[:, 0]
    y = jax.random.normal(jax.random.key(8), x.shape) * 0.05
    pos = jnp.array([5, 2])
    got = fused_qkv(x, w, b, k, v, pos, pos, n_heads=H, eps=1e-5, rope_base=None, y_ND=y,
                    interpret=INTERPRET)
    once = Residual(x, y).summed()
    assert once.dtype == jnp.bfloat16
    assert np.any(np.asarray(once) != np.asarray(x + y.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(once))
    want = fused_qkv(once, w, b, k, v, pos, pos, n_heads=H, eps=1e-5, rope_base=None,
                     interpret=INTERPRET)
    for g, e in zip(got[:3], want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_the_rotation_is_applied_to_q_and_k_only():
    """Against the oracle without RoPE, a rotated q and k differ and v does not (a kernel that
    rotates v, or neither, fails here)."""
    x, w, b, k, v = _operands(jnp.float32, False)
    x, pos = x[:, 0], jnp.array([5, 2])
    slot = pos
    kw = dict(n_heads=H, eps=1e-5, interpret=INTERPRET)
    rotated = fused_qkv(x, w, b, k, v, pos, slot, rope_base=10000.0, **kw)
    plain = fused_qkv(x, w, b, k, v, pos, slot, rope_base=None, **kw)
    assert not np.allclose(rotated[0], plain[0]) and not np.allclose(rotated[1], plain[1])
    np.testing.assert_array_equal(np.asarray(rotated[2]), np.asarray(plain[2]))


def test_calls_the_kernel_does_not_take_are_refused_with_the_reason():
    assert supports(D, J, "half", 1, jnp.bfloat16) is None
    assert supports(D, J, "half", 8, jnp.bfloat16) is None
    assert "9 new tokens per row (the kernel takes 1 to 8)" in supports(D, J, "half", 9,
                                                                         jnp.bfloat16)
    assert "head_dim=24" in supports(D, 24, "half", 1, jnp.bfloat16)
    assert "d_model=40" in supports(40, J, "half", 1, jnp.bfloat16)
    assert "'interleaved'" in supports(D, J, "interleaved", 1, jnp.bfloat16)
    assert "float16" in supports(D, J, None, 1, jnp.float16)
    x, w, b, k, v = _operands(jnp.float32, False)
    x = x[:, 0]
    with pytest.raises(ValueError, match="3 token rows for 2 cache rows"):
        fused_qkv(jnp.zeros((3, D)), w, b, k, v, jnp.zeros(3, int), jnp.zeros(3, int),
                  n_heads=H, eps=1e-5, rope_base=None, interpret=True)
    with pytest.raises(ValueError, match="head_dim=6: its halves.*XLA decode step"):
        fused_qkv(x, w[:, :(H + 2 * G) * 6], b, k[..., :6], v[..., :6], jnp.zeros(2, int),
                  jnp.zeros(2, int), n_heads=H, eps=1e-5, rope_base=None, interpret=True)


def test_without_pallas_triton_no_call_is_taken(monkeypatch):
    monkeypatch.setattr(decode_rows, "AVAILABLE", False)
    assert "no Pallas Triton" in supports(D, J, "half", 1, jnp.bfloat16)
