"""The fused host expert kernel (``moejax.kernels.moe_ffn.host``) against the dispatch oracles: the
dense path (dropless) and the XLA capacity path (same drops), in values and in the gradients
of the input, the combine weights and every expert weight; serial and threaded (split experts)
schedules; activations against ``jax.nn``, their derivatives against the formulas in float64."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax.kernels.moe_ffn.host as hm
from moejax.kernels.moe_ffn.api import dispatch
from moejax.kernels.moe_ffn.host_act import act_into, base_activation
from moejax.kernels.moe_ffn.jnp_paths import dispatch_capacity, dispatch_dense
from moejax.ops.activations import activation_fn, is_gated

TOL = dict(rtol=2e-5, atol=2e-5)


def _case(seed, activation, n=24, d=6, f=10, e=4, k=2, skew=False):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    if skew:  # every token's first choice is expert 0: one expert holds half the rows
        ids = np.stack([[0, 1 + rng.integers(e - 1)] for _ in range(n)])
    else:
        ids = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    mk = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float32)  # noqa: E731
    return (x, jnp.asarray(ids, jnp.int32), w, mk(e, d, f), mk(e, f, d),
            mk(e, d, f) if is_gated(activation) else None)


def _grads(fn, args, ct):
    x, ids, w, wu, wd, wg = args

    def loss(x, w, wu, wd, wg):
        y, n_drop = fn(x, ids, w, wu, wd, wg)
        return jnp.sum(y * ct), (y, n_drop)

    (_, (y, n_drop)), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        x, w, wu, wd, wg)
    return y, n_drop, g


def _assert_same(a, b):
    ya, na, ga = a
    yb, nb, gb = b
    np.testing.assert_allclose(ya, yb, **TOL)
    assert int(na) == int(nb)
    for name, p, q in zip(["x", "weights", "w_up", "w_down", "w_gate"], ga, gb):
        if q is None:
            assert p is None
            continue
        assert float(jnp.max(jnp.abs(q))) > 1e-3, f"{name}: the oracle's gradient is zero"
        np.testing.assert_allclose(p, q, **TOL, err_msg=f"gradient of {name}")


@pytest.fixture(params=["serial", "threaded"])
def schedule(request, monkeypatch):
    """serial: one task per expert on this thread; threaded: 3 worker threads and experts
    split into row chunks of >= 2 rows (the split-expert weight-gradient sums run)."""
    if request.param == "threaded":
        monkeypatch.setattr(hm, "_SERIAL_ROWS", 0)
        monkeypatch.setattr(hm, "_MIN_CHUNK_ROWS", 2)
        monkeypatch.setattr(hm, "host_threads", lambda: 3)
    else:
        monkeypatch.setattr(hm, "host_threads", lambda: 1)
    return request.param


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("skew", [False, True])
def test_dropless_equals_dense_oracle(activation, skew, schedule):
    args = _case(0, activation, skew=skew)
    ct = jax.random.normal(jax.random.key(1), args[0].shape)
    host = lambda *a: hm.host_moe(*a, activation=activation)  # noqa: E731
    dense = lambda *a: dispatch_dense(*a, activation=activation)[:2]  # noqa: E731
    want = _grads(dense, args, ct)
    _assert_same(_grads(jax.jit(host), args, ct), want)
    if activation == "swiglu":  # eager too
        _assert_same(_grads(host, args, ct), want)


@pytest.mark.parametrize("priority", ["choice", "token"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_capacity_equals_xla_capacity_path(priority, activation, schedule):
    args = _case(2, activation, skew=True)
    n = args[0].shape[0]
    valid = jnp.asarray(np.arange(n) % 5 != 3)  # some padding tokens, which yield first
    ct = jax.random.normal(jax.random.key(3), args[0].shape)
    cap = 7
    host = lambda *a: hm.host_moe(*a, activation=activation, capacity=cap,  # noqa: E731
                                  valid_N=valid, priority=priority)
    xla = lambda *a: dispatch_capacity(  # noqa: E731
        *a, activation=activation, capacity_factor=1.0, capacity=cap, valid_N=valid,
        priority=priority)[:2]
    got, want = _grads(jax.jit(host), args, ct), _grads(xla, args, ct)
    assert int(want[1]) > 0, "the case must drop something"
    _assert_same(got, want)


def test_dispatch_names_route_to_the_kernel():
    activation = "swiglu"
    x, ids, w, wu, wd, wg = _case(4, activation, skew=True)
    host_cap = dispatch("host_capacity", x, ids, w, wu, wd, wg, activation=activation,
                        capacity_factor=1.0)
    xla_cap = dispatch("capacity", x, ids, w, wu, wd, wg, activation=activation,
                       capacity_factor=1.0)
    np.testing.assert_allclose(host_cap.y_ND, xla_cap.y_ND, **TOL)
    assert int(host_cap.n_dropped) == int(xla_cap.n_dropped) > 0
    np.testing.assert_allclose(host_cap.dropped_fraction, xla_cap.dropped_fraction, rtol=1e-6)
    for name in ("host",):
        out = dispatch(name, x, ids, w, wu, wd, wg, activation=activation)
        np.testing.assert_allclose(out.y_ND, dispatch_dense(x, ids, w, wu, wd, wg,
                                                            activation=activation).y_ND, **TOL)
        assert int(out.n_dropped) == 0 and float(out.dropped_fraction) == 0.0


def test_threaded_result_is_deterministic(monkeypatch):
    monkeypatch.setattr(hm, "_SERIAL_ROWS", 0)
    monkeypatch.setattr(hm, "_MIN_CHUNK_ROWS", 2)
    monkeypatch.setattr(hm, "host_threads", lambda: 4)
    args = _case(5, "swiglu", n=64, skew=True)
    ct = jax.random.normal(jax.random.key(6), args[0].shape)
    f = jax.jit(lambda *a: hm.host_moe(*a, activation="swiglu"))
    first, second = _grads(f, args, ct), _grads(f, args, ct)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


def test_tasks_cover_every_row_once_and_balance():
    starts = np.array([0, 300, 300, 310, 1000])  # experts of 300, 0, 10 and 690 rows
    tasks = hm._tasks(starts, threads=2)
    rows = sorted((a, b) for _, a, b in tasks)
    assert rows[0][0] == 0 and rows[-1][1] == 1000
    assert all(p[1] == q[0] for p, q in zip(rows, rows[1:]))  # contiguous, no overlap
    for e, a, b in tasks:
        assert starts[e] <= a < b <= starts[e + 1]
    assert max(b - a for _, a, b in tasks) <= 250  # ceil(1000 / (2 * 2)): the big one split
    sizes = [b - a for _, a, b in tasks]
    assert sizes == sorted(sizes, reverse=True)  # largest first
    assert [(e, a, b) for e, a, b in hm._tasks(starts, threads=1)] == [
        (3, 310, 1000), (0, 0, 300), (2, 300, 310)]  # one thread: experts whole


def test_bf16_inputs_and_vmap():
    x, ids, w, wu, wd, wg = _case(7, "swiglu")
    y, _ = hm.host_moe(x.astype(jnp.bfloat16), ids, w, wu, wd, wg, activation="swiglu")
    assert y.dtype == jnp.bfloat16
    want = dispatch_dense(x, ids, w, wu, wd, wg, activation="swiglu").y_ND
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=5e-2, atol=5e-2)
    xs = jnp.stack([x, -x])
    ys, _ = jax.vmap(lambda v: hm.host_moe(v, ids, w, wu, wd, wg, activation="swiglu"))(xs)
    for v, yv in zip(xs, ys):
        np.testing.assert_allclose(yv, dispatch_dense(v, ids, w, wu, wd, wg,
                                                      activation="swiglu").y_ND, **TOL)
    sq = lambda y: jnp.sum(y ** 2)  # noqa: E731
    g = jax.vmap(jax.grad(lambda v: sq(hm.host_moe(v, ids, w, wu, wd, wg,
                                                   activation="swiglu")[0])))(xs)
    want = jax.vmap(jax.grad(lambda v: sq(dispatch_dense(v, ids, w, wu, wd, wg,
                                                         activation="swiglu").y_ND)))(xs)
    np.testing.assert_allclose(g, want, **TOL)


def test_bf16_gradients_match_float32():
    """bf16 inputs take the path where dx cannot be written over dy's buffer (dtypes differ)."""
    args = _case(8, "swiglu")
    ct = jnp.asarray(np.random.default_rng(1).normal(size=args[0].shape), jnp.float32)
    host = lambda *a: hm.host_moe(*a, activation="swiglu")  # noqa: E731
    _, _, g32 = _grads(host, args, ct)
    x, *rest = args
    _, _, g16 = _grads(host, (x.astype(jnp.bfloat16), *rest), ct.astype(jnp.bfloat16))
    for name, p, q in zip(["x", "weights", "w_up", "w_down", "w_gate"], g16, g32):
        assert p.dtype == (jnp.bfloat16 if name == "x" else q.dtype), name
        np.testing.assert_allclose(np.asarray(p, np.float32), q, rtol=5e-2, atol=5e-2,
                                   err_msg=name)


def test_bad_arguments_and_backend_fail_with_the_fix(monkeypatch):
    x, ids, w, wu, wd, wg = _case(8, "swiglu")
    with pytest.raises(ValueError, match="needs w_gate"):
        hm.host_moe(x, ids, w, wu, wd, None, activation="swiglu")
    with pytest.raises(ValueError, match="takes no w_gate"):
        hm.host_moe(x, ids, w, wu, wd, wg, activation="relu")
    with pytest.raises(ValueError, match="not supported"):
        hm.host_moe(x, ids, w, wu, wd, wg, activation="mish")
    with pytest.raises(ValueError, match="priority"):
        hm.host_moe(x, ids, w, wu, wd, wg, activation="swiglu", capacity=3, priority="rank")
    with pytest.raises(ValueError, match="capacity must be"):
        hm.host_moe(x, ids, w, wu, wd, wg, activation="swiglu", capacity=0)
    monkeypatch.setattr(hm.jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="dispatch='grouped'"):
        jax.jit(lambda v: hm.host_moe(v, ids, w, wu, wd, wg, activation="swiglu"))(x)


def _derivative_f64(name: str, g: np.ndarray) -> np.ndarray:
    """The base activation's derivative in float64, from its formula."""
    x = g.astype(np.float64)
    if name == "relu":
        return (x > 0).astype(np.float64)
    if name == "swish":
        s = 1 / (1 + np.exp(-x))
        return s + x * s * (1 - s)
    if name == "gelu":
        cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
        return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    k = math.sqrt(2 / math.pi)  # gelu_tanh
    t = np.tanh(k * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "gelu_tanh", "relu", "swish"])
def test_act_into_matches_jax_values_and_the_exact_derivative(activation):
    g = np.concatenate([np.linspace(-12, 12, 97), [0.0, -100.0, 100.0, 1e-3, -1e-3]])
    g = g.astype(np.float32).reshape(1, -1)
    a, d, t1, t2 = (np.empty_like(g) for _ in range(4))
    name = base_activation(activation)
    act_into(name, g, a, d, t1, t2)
    want_a = np.asarray(activation_fn(activation)(jnp.asarray(g)))
    np.testing.assert_allclose(a[0], want_a[0], rtol=1e-5, atol=1e-6)
    # gelu_tanh near g = -4: 0.5 (1 + t) with t ~ -1 cancels; 2e-6 absolute in float32
    np.testing.assert_allclose(d[0], _derivative_f64(name, g[0]), rtol=1e-5, atol=5e-6)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(d))
    with pytest.raises(ValueError, match="unknown activation"):
        base_activation("mish")


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_expert_widths_skip_each_experts_padding(activation):
    """Experts of widths 10, 0, 7, 1 padded to 10: with ``widths_E`` the kernel computes only
    each expert's own units (garbage past them is never read), equal to the dense oracle on
    the zero-padded weights, and under differentiation (full width) the gradients are the
    oracle's too."""
    x, ids, w, wu, wd, wg = _case(3, activation, f=10)
    widths = np.asarray([10, 0, 7, 1])  # width 0: the expert adds nothing
    keep = (np.arange(10)[None, :] < widths[:, None]).astype(np.float32)  # [E, F]
    zero = lambda a, ax: None if a is None else a * jnp.expand_dims(keep, ax)  # noqa: E731
    wu0, wd0, wg0 = zero(wu, 1), zero(wd, 2), zero(wg, 1)
    want = dispatch_dense(x, ids, w, wu0, wd0, wg0, activation=activation).y_ND
    junk = lambda a, ax: None if a is None else a + 5.0 * (1 - jnp.expand_dims(keep, ax))  # noqa: E731
    got, _ = hm.host_moe(x, ids, w, junk(wu, 1), junk(wd, 2), junk(wg, 1),
                         activation=activation, widths_E=widths)
    np.testing.assert_allclose(got, want, **TOL)
    ignored, _ = hm.host_moe(x, ids, w, junk(wu, 1), junk(wd, 2), junk(wg, 1),
                             activation=activation)
    assert float(jnp.max(jnp.abs(ignored - want))) > 1e-2  # without widths the junk is read
    ct = jnp.asarray(np.random.default_rng(0).normal(size=want.shape), jnp.float32)
    oracle = lambda x, ids, w, a, b, c: (dispatch_dense(  # noqa: E731
        x, ids, w, a, b, c, activation=activation).y_ND, jnp.int32(0))
    with_w = lambda x, ids, w, a, b, c: hm.host_moe(  # noqa: E731
        x, ids, w, a, b, c, activation=activation, widths_E=widths)
    args = (x, ids, w, wu0, wd0, wg0)
    _assert_same(_grads(with_w, args, ct), _grads(oracle, args, ct))
    out = dispatch("auto", x, ids, w, wu0, wd0, wg0, activation=activation,
                   expert_widths_E=widths)
    np.testing.assert_allclose(out.y_ND, want, **TOL)
