"""Dispatch paths (moejax.kernels.moe_ffn.jnp_paths) against numpy loops and each other."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf

from moejax.kernels.moe_ffn import api as dp
from moejax.kernels.moe_ffn.api import dispatch
from moejax.kernels.moe_ffn.jnp_paths import (
    bucket_capacities,
    dispatch_bucketed,
    dispatch_capacity,
    dispatch_dense,
    dispatch_grouped,
    dispatch_ragged,
    expert_capacity,
    ffn_apply,
)
from moejax.nn.router import top_k_gates

N, D, F, E, K = 12, 8, 16, 4, 2

NP_ACT = {
    "swiglu": (lambda v: v / (1 + np.exp(-v)), True),
    "gelu": (lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))), False),
    "relu": (lambda v: np.maximum(v, 0), False),
}

# the one-device kernel path compared with the oracles: the host kernel on a CPU, tokamax's
# grouped matmul on a GPU or TPU
ONE_DEVICE = "host" if jax.default_backend() == "cpu" else "tokamax"


def _params(seed, activation, n=N, d=D, f=F, e=E):
    ks = jax.random.split(jax.random.key(seed), 6)
    gated = NP_ACT[activation][1]
    return {
        "x": jax.random.normal(ks[0], (n, d), jnp.float32),
        "w_g": jax.random.normal(ks[1], (d, e), jnp.float32),
        "w_up": jax.random.normal(ks[2], (e, d, f), jnp.float32) / np.sqrt(d),
        "w_down": jax.random.normal(ks[3], (e, f, d), jnp.float32) / np.sqrt(f),
        "w_gate": (jax.random.normal(ks[4], (e, d, f), jnp.float32) / np.sqrt(d)
                   if gated else None),
        "ct": jax.random.normal(ks[5], (n, d), jnp.float32),  # cotangent for grads
    }


def _np_expert(x_D, p, e, activation):
    act, gated = NP_ACT[activation]
    w_up = np.asarray(p["w_up"][e], np.float64)
    up = x_D @ w_up
    h = act(x_D @ np.asarray(p["w_gate"][e], np.float64)) * up if gated else act(up)
    return h @ np.asarray(p["w_down"][e], np.float64)


def _np_moe(x, ids, w, p, activation, kept=None):
    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if kept is None or kept[n, k]:
                y[n] += w[n, k] * _np_expert(x[n], p, ids[n, k], activation)
    return y


def _np_capacity_keep(ids, valid, cap, priority="choice"):
    """Oracle of the documented priority: per expert, real tokens before padding, then (for
    "choice") first choices before second choices, then by token index; the first ``cap``
    are kept."""
    n_tok, k = ids.shape
    kept = np.zeros((n_tok, k), bool)
    for e in range(ids.max() + 1):
        queue = [(n, s) for n in range(n_tok) for s in range(k) if ids[n, s] == e]
        if priority == "choice":
            queue.sort(key=lambda a: (not valid[a[0]], a[1], a[0]))
        else:
            queue.sort(key=lambda a: (not valid[a[0]], a[0]))
        for pos, (n, s) in enumerate(queue):
            kept[n, s] = pos < cap
    return kept


def _loss_fn(method, activation, cf=None, valid=None, jit=False):
    def loss(x, w_g, w_up, w_down, w_gate, ct):
        r = top_k_gates(x @ w_g, K, renormalize=True)
        kw = {"activation": activation, "valid_N": valid}
        if method == "capacity":
            kw["capacity_factor"] = cf
        out = dispatch(method, x, r.ids_NK, r.weights_NK, w_up, w_down, w_gate, **kw)
        return jnp.sum(out.y_ND * ct), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    return jax.jit(grad) if jit else grad


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_dense_matches_numpy_loop(activation):
    p = _params(0, activation)
    r = top_k_gates(p["x"] @ p["w_g"], K, renormalize=False)
    out = dispatch_dense(p["x"], r.ids_NK, r.weights_NK, p["w_up"], p["w_down"], p["w_gate"],
                         activation=activation)
    want = _np_moe(p["x"], np.asarray(r.ids_NK), np.asarray(r.weights_NK), p, activation)
    np.testing.assert_allclose(np.asarray(out.y_ND), want, rtol=1e-5, atol=1e-5)
    assert int(out.n_dropped) == 0 and float(out.dropped_fraction) == 0.0


@pytest.mark.parametrize("priority", ["choice", "token"])
def test_capacity_keeps_first_choices_before_second_choices(priority):
    activation = "relu"
    p = _params(3, activation)
    # Expert 0 is every token's second choice for tokens 0-5 and the first choice of tokens
    # 6-11: with capacity 5, GShard's priority keeps 5 of the later first choices, token
    # order keeps the early second choices.
    ids = np.array([[1, 0], [2, 0], [3, 0], [1, 0], [2, 0], [3, 0],
                    [0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]], np.int32)
    w = np.full((N, K), 0.5, np.float32)
    cap = expert_capacity(N, K, E, 0.75)
    out = dispatch_capacity(p["x"], jnp.asarray(ids), jnp.asarray(w), p["w_up"], p["w_down"],
                            None, activation=activation, capacity_factor=0.75,
                            priority=priority)
    kept = _np_capacity_keep(ids, np.ones(N, bool), cap, priority)
    if priority == "choice":
        assert kept[6:11, 0].all() and not kept[:6, 1].any()
    else:
        assert kept[:5, 1].all() and not kept[6:, 0].any()
    np.testing.assert_allclose(np.asarray(out.y_ND),
                               _np_moe(p["x"], ids, w, p, activation, kept=kept),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="priority"):
        dispatch_capacity(p["x"], jnp.asarray(ids), jnp.asarray(w), p["w_up"], p["w_down"],
                          None, activation=activation, capacity_factor=0.75, priority="rank")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_paths_agree_forward_and_gradients(activation, jit):
    p = _params(1, activation)
    args = (p["x"], p["w_g"], p["w_up"], p["w_down"], p["w_gate"], p["ct"])
    cf_no_drop = E / K  # C = N: nothing can be dropped
    assert expert_capacity(N, K, E, cf_no_drop) == N
    (l_d, o_d), g_d = _loss_fn("dense", activation, jit=jit)(*args)
    (l_c, o_c), g_c = _loss_fn("capacity", activation, cf=cf_no_drop, jit=jit)(*args)
    (l_r, o_r), g_r = _loss_fn("ragged", activation, jit=jit)(*args)
    (l_b, o_b), g_b = _loss_fn("bucketed", activation, jit=jit)(*args)
    (l_h, o_h), g_h = _loss_fn(ONE_DEVICE, activation, jit=jit)(*args)
    for o in (o_c, o_r, o_b, o_h):
        np.testing.assert_allclose(np.asarray(o.y_ND), np.asarray(o_d.y_ND), rtol=1e-5, atol=1e-5)
        assert int(o.n_dropped) == 0
    np.testing.assert_allclose(float(l_c), float(l_d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l_r), float(l_d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l_b), float(l_d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l_h), float(l_d), rtol=1e-5, atol=1e-5)
    names = ["x", "w_g", "w_up", "w_down", "w_gate"]
    for name, gd, gc, gr, gb, gh in zip(names, g_d, g_c, g_r, g_b, g_h):
        if gd is None:
            assert gc is None and gr is None and gb is None and gh is None
            continue
        assert float(jnp.max(jnp.abs(gd))) > 1e-3, f"grad of {name} is trivially zero"
        np.testing.assert_allclose(np.asarray(gc), np.asarray(gd), rtol=1e-5, atol=1e-5,
                                   err_msg=f"capacity grad {name}")
        np.testing.assert_allclose(np.asarray(gr), np.asarray(gd), rtol=1e-5, atol=1e-5,
                                   err_msg=f"ragged grad {name}")
        np.testing.assert_allclose(np.asarray(gb), np.asarray(gd), rtol=1e-5, atol=1e-5,
                                   err_msg=f"bucketed grad {name}")
        np.testing.assert_allclose(np.asarray(gh), np.asarray(gd), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{ONE_DEVICE} grad {name}")


def test_capacity_drops_match_numpy_oracle():
    activation = "swiglu"
    p = _params(2, activation)
    # Skewed routing: most tokens prefer expert 0 and 1, so a small capacity drops some.
    ids = np.array([[0, 1], [0, 2], [1, 0], [0, 3], [2, 0], [0, 1],
                    [1, 2], [0, 1], [3, 0], [0, 2], [1, 0], [2, 1]], np.int32)
    w = np.asarray(jax.random.uniform(jax.random.key(7), (N, K)), np.float32)
    valid = np.ones(N, bool)
    valid[[1, 5]] = False  # padding tokens lose priority to later real tokens
    cf = 0.75
    cap = expert_capacity(N, K, E, cf)
    assert cap == math.ceil(cf * N * K / E) == 5
    out = dispatch_capacity(p["x"], jnp.asarray(ids), jnp.asarray(w), p["w_up"], p["w_down"],
                            p["w_gate"], activation=activation, capacity_factor=cf,
                            valid_N=jnp.asarray(valid))
    kept = _np_capacity_keep(ids, valid, cap)
    # Expert 0 has 10 assignments (2 padding): 5 kept; the two padding ones are dropped
    # although they come early, and 3 real ones are dropped.
    assert not kept[1, 0] and not kept[5, 0]
    want_y = _np_moe(p["x"], ids, w, p, activation, kept=kept)
    np.testing.assert_allclose(np.asarray(out.y_ND), want_y, rtol=1e-5, atol=1e-5)
    want_drop = int(np.sum(~kept & valid[:, None]))
    assert want_drop > 0
    assert int(out.n_dropped) == want_drop
    np.testing.assert_allclose(float(out.dropped_fraction), want_drop / (valid.sum() * K),
                               rtol=1e-6)

    # Without a mask: plain token order.
    out2 = dispatch_capacity(p["x"], jnp.asarray(ids), jnp.asarray(w), p["w_up"], p["w_down"],
                             p["w_gate"], activation=activation, capacity_factor=cf)
    kept2 = _np_capacity_keep(ids, np.ones(N, bool), cap)
    np.testing.assert_allclose(np.asarray(out2.y_ND),
                               _np_moe(p["x"], ids, w, p, activation, kept=kept2),
                               rtol=1e-5, atol=1e-5)
    assert int(out2.n_dropped) == int(np.sum(~kept2))
    # token priority keeps real tokens before padding too
    out3 = dispatch_capacity(p["x"], jnp.asarray(ids), jnp.asarray(w), p["w_up"], p["w_down"],
                             p["w_gate"], activation=activation, capacity_factor=cf,
                             valid_N=jnp.asarray(valid), priority="token")
    kept3 = _np_capacity_keep(ids, valid, cap, "token")
    assert not kept3[1, 0] and not kept3[5, 0]
    np.testing.assert_allclose(np.asarray(out3.y_ND),
                               _np_moe(p["x"], ids, w, p, activation, kept=kept3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_capacity_with_drops_gradients_equal_dense_with_dropped_weights_zeroed(jit):
    activation = "gelu"
    p = _params(3, activation)
    cf = 0.5
    r = top_k_gates(p["x"] @ p["w_g"], K, renormalize=True)
    kept = _np_capacity_keep(np.asarray(r.ids_NK), np.ones(N, bool), expert_capacity(N, K, E, cf))
    assert (~kept).sum() > 0
    kept = jnp.asarray(kept, jnp.float32)

    def loss(method, x, w_g, w_up, w_down):
        rr = top_k_gates(x @ w_g, K, renormalize=True)
        if method == "capacity":
            out = dispatch_capacity(x, rr.ids_NK, rr.weights_NK, w_up, w_down,
                                    activation=activation, capacity_factor=cf)
        else:
            out = dispatch_dense(x, rr.ids_NK, rr.weights_NK * kept, w_up, w_down,
                                 activation=activation)
        return jnp.sum(out.y_ND * p["ct"])

    args = (p["x"], p["w_g"], p["w_up"], p["w_down"])
    gfn = jax.grad(loss, argnums=(1, 2, 3, 4))
    if jit:
        gfn = jax.jit(gfn, static_argnums=0)
    for gc, gd in zip(gfn("capacity", *args), gfn("dense", *args)):
        np.testing.assert_allclose(np.asarray(gc), np.asarray(gd), rtol=1e-5, atol=1e-5)


def test_ragged_handles_empty_experts_and_k1():
    activation = "relu"
    p = _params(4, activation)
    ids = np.full((N, 1), 2, np.int32)  # every token to expert 2; experts 0, 1, 3 empty
    w = np.ones((N, 1), np.float32)
    y_r = dispatch_ragged(p["x"], jnp.asarray(ids), jnp.asarray(w), p["w_up"], p["w_down"],
                          activation=activation).y_ND
    np.testing.assert_allclose(np.asarray(y_r), _np_moe(p["x"], ids, w, p, activation),
                               rtol=1e-5, atol=1e-5)


def test_expert_capacity_formula_and_clipping():
    assert expert_capacity(10, 2, 4, 1.25) == math.ceil(1.25 * 10 * 2 / 4) == 7
    assert expert_capacity(10, 2, 4, 100.0) == 10  # clipped to N
    assert expert_capacity(1, 1, 64, 0.01) == 1  # at least one slot
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 2, 4, 0.0)


def test_ffn_apply_and_weight_errors():
    p = _params(5, "swiglu")
    y = ffn_apply(p["x"], p["w_up"][0], p["w_down"][0], p["w_gate"][0], activation="swiglu")
    want = np.stack([_np_expert(np.asarray(xn, np.float64), p, 0, "swiglu") for xn in p["x"]])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    ids = jnp.zeros((N, K), jnp.int32)
    w = jnp.ones((N, K))
    with pytest.raises(ValueError, match="needs w_gate"):
        dispatch_dense(p["x"], ids, w, p["w_up"], p["w_down"], None, activation="swiglu")
    with pytest.raises(ValueError, match="not gated"):
        dispatch_ragged(p["x"], ids, w, p["w_up"], p["w_down"], p["w_gate"], activation="relu")
    with pytest.raises(ValueError, match="allowed"):
        dispatch("sparse", p["x"], ids, w, p["w_up"], p["w_down"], p["w_gate"], activation="swiglu")


@pytest.mark.parametrize("tile", [None, 4, 3])
def test_grouped_dispatch_equals_dense_oracle_with_gradients(tile):
    activation = "swiglu"
    p = _params(4, activation)
    # expert 0: 10 assignments (several tiles), expert 3: none, 24 rows not a tile multiple
    ids = jnp.asarray([[0, 1], [0, 2], [1, 0], [0, 2], [2, 0], [0, 1],
                       [1, 2], [0, 1], [2, 0], [0, 2], [1, 0], [2, 1]], jnp.int32)
    w = jax.random.uniform(jax.random.key(8), (N, K))

    def loss(fn, x, w_up, w_down, w_gate):
        out = fn(x, ids, w, w_up, w_down, w_gate, activation=activation)
        return jnp.sum(out.y_ND * p["ct"]), out

    grouped = (lambda *a, **kw: dispatch_grouped(*a, tile=tile, **kw))
    args = (p["x"], p["w_up"], p["w_down"], p["w_gate"])
    (l_g, o_g), g_g = jax.value_and_grad(lambda *a: loss(grouped, *a), argnums=(0, 1, 2, 3),
                                         has_aux=True)(*args)
    (l_d, o_d), g_d = jax.value_and_grad(lambda *a: loss(dispatch_dense, *a),
                                         argnums=(0, 1, 2, 3), has_aux=True)(*args)
    np.testing.assert_allclose(np.asarray(o_g.y_ND), np.asarray(o_d.y_ND), rtol=1e-5, atol=1e-5)
    assert int(o_g.n_dropped) == 0
    for a, b in zip(g_g, g_d):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(g_g[1])[3])  # the expert nobody chose gets no gradient


@pytest.mark.parametrize("load", ["balanced", "skewed", "all_one_expert"])
def test_bucketed_dispatch_is_dropless_and_equals_dense_oracle(load):
    """The bucketed path picks the smallest capacity rung that holds the fullest expert and
    then equals the dense oracle in values and gradients (nothing dropped), from a balanced
    load (first rung) to every token on one expert (the last rung, C = N)."""
    activation = "swiglu"
    p = _params(5, activation)
    ids = {"balanced": [[t % E, (t + 1) % E] for t in range(N)],
           "skewed": [[0, 1 + t % 3] if t < 9 else [1 + t % 3, 1 + (t + 1) % 3]
                      for t in range(N)],  # expert 0: 9 of 12 tokens, the middle rung
           "all_one_expert": [[0, 1 + t % 3] for t in range(N)]}[load]
    ids = jnp.asarray(ids, jnp.int32)
    w = jax.random.uniform(jax.random.key(3), (N, K))
    caps = bucket_capacities(N, K, E)
    assert caps[-1] == N and list(caps) == sorted(caps)
    need = int(np.bincount(np.asarray(ids).ravel(), minlength=E).max())
    want_cap = min(c for c in caps if c >= need)
    assert want_cap == {"balanced": caps[0], "skewed": 9, "all_one_expert": N}[load]
    # the rung in use: the capacity path at that capacity drops nothing, one rung lower does
    lower = [c for c in caps if c < want_cap]
    if lower:
        assert int(dispatch_capacity(p["x"], ids, w, p["w_up"], p["w_down"], p["w_gate"],
                                     activation=activation, capacity_factor=1.0,
                                     capacity=lower[-1]).n_dropped) > 0

    def loss(fn, x, w_up, w_down, w_gate):
        out = fn(x, ids, w, w_up, w_down, w_gate, activation=activation)
        return jnp.sum(out.y_ND * p["ct"]), out

    args = (p["x"], p["w_up"], p["w_down"], p["w_gate"])
    (_, o_b), g_b = jax.jit(jax.value_and_grad(
        lambda *a: loss(dispatch_bucketed, *a), argnums=(0, 1, 2, 3), has_aux=True))(*args)
    (_, o_d), g_d = jax.value_and_grad(lambda *a: loss(dispatch_dense, *a),
                                       argnums=(0, 1, 2, 3), has_aux=True)(*args)
    assert int(o_b.n_dropped) == 0
    np.testing.assert_allclose(np.asarray(o_b.y_ND), np.asarray(o_d.y_ND), rtol=1e-5, atol=1e-5)
    for a, b in zip(g_b, g_d):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs the CPU's host kernel")
def test_auto_is_host_on_one_cpu_device_tokamax_on_accelerators_else_grouped(monkeypatch):
    assert dp.resolve_dispatch("capacity") == "capacity"
    assert dp.resolve_dispatch("grouped") == "grouped"
    assert jax.default_backend() == "cpu" and jax.device_count() == 1  # this test process
    assert dp.resolve_dispatch("auto") == "host"
    # "auto" under jit on one CPU device runs the host kernel: same values as "host"
    p = _params(3, "swiglu")
    r = top_k_gates(p["x"] @ p["w_g"], K, renormalize=True)
    ids, w = r.ids_NK, r.weights_NK
    args = (p["x"], ids, w, p["w_up"], p["w_down"], p["w_gate"])
    got = jax.jit(lambda *a: dispatch("auto", *a, activation="swiglu").y_ND)(*args)
    want = dispatch("host", *args, activation="swiglu").y_ND
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    monkeypatch.setattr(dp.jax, "default_backend", lambda: "gpu")
    assert dp.resolve_dispatch("auto") == ("tokamax" if dp.RAGGED_DOT_AVAILABLE else "gmm")
    monkeypatch.setattr(dp.jax, "device_count", lambda: 8)
    assert dp.resolve_dispatch("auto") == "grouped"


@pytest.mark.parametrize("method", ["auto", "grouped", "ragged", "bucketed", "host"])
def test_every_expert_active_runs_the_dense_sum_without_sorting_token_copies(method):
    """k = E (a teacher under ALL or SAR): the dropless paths give the numpy oracle's mixture
    through the dense path: no sort of the N E token copies in the program."""
    activation = "swiglu"
    p = _params(5, activation)
    ids = jnp.tile(jnp.arange(E, dtype=jnp.int32), (N, 1))[:, ::-1]
    w = jax.nn.softmax(jax.random.normal(jax.random.key(2), (N, E)), axis=-1)

    def run(x):
        return dispatch(method, x, ids, w, p["w_up"], p["w_down"], p["w_gate"],
                        activation=activation).y_ND

    y = run(p["x"])
    np.testing.assert_allclose(np.asarray(y), _np_moe(p["x"], ids, w, p, activation),
                               rtol=1e-5, atol=1e-5)
    assert " sort(" not in jax.jit(run).lower(p["x"]).as_text(dialect="hlo")
    # fewer than every expert: the path's own program (grouped sorts its token copies)
    part = jax.jit(lambda x: dispatch("grouped", x, ids[:, :K], w[:, :K], p["w_up"],
                                      p["w_down"], p["w_gate"], activation=activation).y_ND)
    assert " sort(" in part.lower(p["x"]).as_text(dialect="hlo")
