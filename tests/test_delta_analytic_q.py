"""Per-layer analytic q (Eq. 5) vs a numpy oracle; eta search."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import (
    analytic_q_leaf,
    analytic_q_tree,
    coefficient_sums,
    eq5_objective,
    eta_grid,
    phi,
    psi,
    q_grid,
    search_eta_e,
    search_eta_v,
)
from moejax.delta.analytic_q import fill_other_leaves


def test_phi_psi_values():
    assert phi(0.5) == 0.5 and phi(0.0) == 0.0 and phi(1.0) == 0.0
    assert phi(0.5 + 1e-6) == pytest.approx(0.5, abs=1e-5)
    ps = np.linspace(0.01, 0.99, 99)
    assert all(0 < phi(p) <= 0.5 for p in ps)
    assert phi(0.9) == pytest.approx(-0.8 / np.log(1 / 9))
    assert psi(0.9) == pytest.approx(np.sqrt(2 * 0.9 * 0.1)) and psi(0.3) == phi(0.3)


def _oracle_q(delta_io, xbar, p, eta, gamma, grid):
    """Eq. 5 per output unit i (paper layout W[i, j]), mean |.| over i, argmin over grid."""
    W = np.abs(np.asarray(delta_io, np.float64)).T  # [out, in]
    best, best_val = None, np.inf
    for q in grid:
        vals = []
        for i in range(W.shape[0]):
            c = W[i] * xbar
            vals.append(
                abs(
                    np.log(2 / gamma)
                    + eta * (1 - (1 - p) / q) * c.sum()
                    + eta**2 * phi(p) * (c**2).sum() / (4 * q**2)
                )
            )
        if np.mean(vals) < best_val:
            best, best_val = q, np.mean(vals)
    return best


def test_analytic_q_matches_oracle_and_closed_form():
    r = np.random.default_rng(0)
    d = r.normal(0, 0.01, (12, 5)).astype(np.float32)  # [d_in, d_out]
    xbar = np.abs(r.normal(size=12))
    p, gamma = 0.9, 0.05
    grid = q_grid(p, 60, include_max=False)
    for eta in (1.0, 30.0, 300.0):
        assert analytic_q_leaf(d, xbar, p, eta, gamma=gamma, grid=grid,
                               form="pooled") == pytest.approx(
            _oracle_q(d, xbar, p, eta, gamma, grid)
        )
    s1, s2 = coefficient_sums(d, xbar)
    np.testing.assert_allclose(s1, (np.abs(d) * xbar[:, None]).sum(0), rtol=1e-6)
    # single output unit: objective is minimised at q* = eta Phi S2 / (2 (1-p) S1)
    one = d[:, :1]
    s1, s2 = coefficient_sums(one, xbar)
    eta = 2 * (1 - p) * s1[0] * 0.5 / (phi(p) * s2[0])  # puts q* = 0.5
    fine = np.linspace(1 - p, 1, 2001)[:-1]
    assert analytic_q_leaf(one, xbar, p, eta, grid=fine, form="pooled") == pytest.approx(
        0.5, abs=1e-3)
    # torch layout [d_out, d_in] with in_axis=-1 gives the same q
    for form in ("pooled", "official_signed", "two_sided"):
        assert analytic_q_leaf(d.T, xbar, p, 30.0, in_axis=-1, form=form) == analytic_q_leaf(
            d, xbar, p, 30.0, form=form)
    with pytest.raises(ValueError, match="d_in"):
        analytic_q_leaf(d, xbar[:5], p, 1.0)


def test_analytic_q_tree_stacked_and_eta_search():
    r = np.random.default_rng(1)
    pre = {
        "l1": jnp.asarray(r.normal(size=(3, 8, 6)), jnp.float32),
        "l2": jnp.asarray(r.normal(size=(6, 4)), jnp.float32),
        "b": jnp.zeros(4),
    }
    d = {
        "l1": jnp.asarray(r.normal(0, 0.3, (3, 8, 6)), jnp.float32),
        "l2": jnp.asarray(r.normal(0, 0.3, (6, 4)), jnp.float32),
        "b": jnp.zeros(4),
    }
    mask = {"l1": True, "l2": True, "b": False}
    x = np.abs(r.normal(size=(3, 8)))  # per-expert input statistics
    xs = {"l1": x, "l2": np.abs(r.normal(size=6))}
    qs = analytic_q_tree(d, xs, 0.8, 50.0, mask=mask, form="pooled")
    assert set(qs) == {"l1", "l2", "b"} and qs["b"] == pytest.approx(0.2)
    per_expert_rows = np.concatenate(
        [(np.abs(np.asarray(d["l1"][e])) * x[e][:, None]).sum(0) for e in range(3)]
    )
    np.testing.assert_allclose(coefficient_sums(d["l1"], x)[0], per_expert_rows, rtol=1e-6)
    xin = jnp.asarray(r.normal(size=(10, 8)), jnp.float32)
    fn = lambda prm: jnp.tanh(jnp.einsum("bi,eio->beo", xin, prm["l1"])).mean(1) @ prm["l2"]
    res = search_eta_e(
        jax.random.PRNGKey(0), pre, d, xs, 0.8, fn, etas=[1.0, 10.0, 100.0, 1000.0], mask=mask
    )
    assert res.eta == res.search.best and res.q == analytic_q_tree(d, xs, 0.8, res.eta, mask=mask)
    assert res.q != analytic_q_tree(d, xs, 0.8, res.eta, mask=mask, form="pooled")
    assert res.search.best_score == pytest.approx(min(res.search.scores))


def _official_oracle(delta_oi, xmean, p, eta, prob=0.95, stop_iter=0.8):
    """The official per-unit scan written out plainly: W[out, in] * mean x, q from 1-p up in
    steps of 0.001, each unit keeps its best (<=), stop when stop_iter of the units have had
    a non-decreasing step; the layer's q is the mean over units."""
    c = np.asarray(delta_oi, np.float64) * np.asarray(xmean, np.float64)[None, :]
    n = c.shape[0]
    q_o, best, stop = np.full(n, 1 - p), np.full(n, 1e4), np.zeros(n)
    for k in range(int(round((1 - p) * 1000)), 999):
        q = k * 0.001
        res = np.abs(eta * (1 - (1 - p) / q) * c.sum(1)
                     + eta**2 * phi(p) * (c**2).sum(1) / (4 * q**2) + np.log(2 / (1 - prob)))
        small, large = res <= best, res >= best
        best[small], q_o[small] = res[small], q
        stop[large] = 1
        if stop.mean() >= stop_iter:
            break
    return q_o.mean()


@pytest.mark.parametrize("p,eta", [(0.9, 3.0), (0.9, 40.0), (0.99, 200.0), (0.5, 10.0)])
def test_official_form_matches_the_official_scan(p, eta):
    r = np.random.default_rng(2)
    d = r.normal(0.002, 0.01, (24, 16))  # [d_in, d_out], signed, nonzero mean
    xmean = r.normal(0.3, 1.0, 24)  # signed mean inputs
    got = analytic_q_leaf(d, xmean, p, eta, form="official_signed")
    assert got == pytest.approx(_official_oracle(d.T, xmean, p, eta), rel=1e-9)
    assert 1 - p - 1e-12 <= got < 1


def test_official_and_pooled_forms_differ_on_one_layer():
    """The two aggregations on the same layer and eta: per-unit argmin then mean vs one argmin
    of the mean, signed vs absolute coefficients."""
    r = np.random.default_rng(3)
    d = r.normal(0.0, 0.02, (64, 32))
    x = r.normal(0.5, 1.0, (256, 64))
    p, eta = 0.9, 20.0
    q_off = analytic_q_leaf(d, x.mean(0), p, eta, form="official_signed")
    q_pool = analytic_q_leaf(d, np.abs(x).mean(0), p, eta, form="pooled")
    assert abs(q_off - q_pool) > 0.05, (q_off, q_pool)
    with pytest.raises(ValueError, match="form="):
        analytic_q_leaf(d, x.mean(0), p, eta, form="median")


# ---- the two-sided bound (default): |h_diff| does not see the sign of a unit's delta ----

def _layer(seed=0, d_in=384, d_out=1536, scale=1e-3):
    """A MiniLM-shaped FFN delta [d_in, d_out] and a signed mean input."""
    r = np.random.default_rng(seed)
    return r.normal(0, scale, (d_in, d_out)), r.normal(0.0, 0.5, d_in)


def _library_etas(d, x, p, num=12):
    return eta_grid({"w": d}, {"w": True}, {"w": x}, p, num)


def test_two_sided_q_ignores_the_delta_sign():
    """Flipping one unit's delta row, half the rows, or the whole delta leaves the layer's q
    (within 0.02) where it was, at every eta of the library's grid; the signed form moves."""
    d, x = _layer(d_out=512)
    p = 0.99
    r = np.random.default_rng(1)
    one = d.copy()
    one[:, 7] *= -1
    half = d * np.where(r.random(d.shape[1]) < 0.5, -1.0, 1.0)[None, :]
    pos = d * np.sign(coefficient_sums(d, x, signed=True)[0])[None, :]  # every S1 > 0
    signed_moved = 0.0
    for eta in _library_etas(d, x, p):
        q = analytic_q_leaf(d, x, p, eta)
        for flipped in (one, half, -d, pos, -pos):
            assert abs(analytic_q_leaf(flipped, x, p, eta) - q) <= 0.02, eta
        signed_moved = max(signed_moved, abs(
            analytic_q_leaf(-pos, x, p, eta, form="official_signed")
            - analytic_q_leaf(pos, x, p, eta, form="official_signed")))
    assert signed_moved > 0.02  # the official signed form does follow the sign


def test_two_sided_q_is_dare_at_the_smallest_eta_and_grows_with_eta():
    d, x = _layer(d_out=512)
    p = 0.99
    etas = _library_etas(d, x, p)
    qs = [analytic_q_leaf(d, x, p, eta) for eta in etas]
    assert qs[0] <= (1 - p) + 0.005, qs[0]
    assert all(b >= a - 1e-12 for a, b in zip(qs, qs[1:])), qs  # monotone in eta
    assert qs[-1] > 0.5  # the grid reaches large q too
    # the signed form at the smallest eta: about half the units (S1 < 0) at 0.998
    assert analytic_q_leaf(d, x, p, etas[0], form="official_signed") > 0.4


@pytest.mark.parametrize("share", [0.15, 0.5, 0.85])
def test_two_sided_q_does_not_follow_the_share_of_negative_units(share):
    """Rows flipped so that a given share of units has S1 < 0: the two-sided layer q stays
    put while the signed one tracks the share."""
    d, x = _layer(d_out=512)
    p = 0.99
    s1, _ = coefficient_sums(d, x, signed=True)
    pos = d * np.sign(s1)[None, :]  # every unit's S1 > 0
    neg = np.random.default_rng(2).permutation(d.shape[1]) < share * d.shape[1]
    mixed = pos * np.where(neg, -1.0, 1.0)[None, :]
    eta = _library_etas(d, x, p)[4]
    base = analytic_q_leaf(pos, x, p, eta)
    assert abs(analytic_q_leaf(mixed, x, p, eta) - base) <= 0.02
    signed = analytic_q_leaf(mixed, x, p, eta, form="official_signed")
    assert signed == pytest.approx(share, abs=0.1), signed


def test_two_sided_closed_form_per_unit():
    """One unit: the scan's argmin is q* = eta Phi S2 / (2 (1-p) |S1|), for either sign."""
    r = np.random.default_rng(4)
    w = r.normal(0.01, 0.01, (64, 1))
    x = np.abs(r.normal(1.0, 0.2, 64))
    p = 0.9
    s1, s2 = coefficient_sums(w, x, signed=True)
    eta = 2 * (1 - p) * abs(s1[0]) * 0.5 / (phi(p) * s2[0])  # q* = 0.5
    for sign in (1.0, -1.0):
        assert analytic_q_leaf(sign * w, x, p, eta) == pytest.approx(0.5, abs=1.5e-3)


def _official_float16(delta_io, xmean, p, eta, prob=0.95, stop_iter=0.8):
    """The official ``analytical_resolve_new`` as it runs: c = W * mean x cast to float16,
    sums accumulated in float32 and stored in float16, every op of the objective rounded to
    float16, best values held in float16 (consecutive values tie, and ``>=`` counts a tie as
    a stop)."""
    f16, f32 = np.float16, np.float32
    c = (np.asarray(delta_io, np.float64).T * np.asarray(xmean)[None, :]).astype(f16)
    s1 = c.astype(f32).sum(1).astype(f16).astype(f32)
    s2 = (c * c).astype(f32).sum(1).astype(f16).astype(f32)
    n = c.shape[0]
    q_o, best, stop = np.full(n, 1 - p), np.full(n, 1e4, f16), np.zeros(n)
    for k in range(int((1 - p) * 1000), 999):
        q = k * 0.001
        t1 = f16(f32(1 - (1 - p) / q) * s1).astype(f32)
        t2 = f16(f16(f32(eta**2 * phi(p)) * s2).astype(f32) / f32(4 * q**2)).astype(f32)
        t2 = f16(t2 + f32(np.log(2 / (1 - prob)))).astype(f32)
        res = np.abs(f16(f16(f32(eta) * t1).astype(f32) + t2))
        small, large = res <= best, res >= best
        best, q_o = np.where(small, res, best), np.where(small, q, q_o)
        stop[large] = 1
        if stop.mean() >= stop_iter:
            break
    return float(q_o.mean())


def test_two_sided_agrees_with_the_official_float16_scan():
    """On a fixed layer whose units all have S1 > 0 (where the two bounds are one), the
    two-sided q agrees with the official code's float16 scan within 0.003 wherever
    q <= 0.03 (1/q >= 33, the paper's optima 1/q = 30..55); it does so after any sign flips
    of the rows too. Beyond that the float16 objective is flat to its precision (log(2/gamma)
    = 3.69 dominates, spacing 0.002), ties count as stops, and the official scan ends early,
    below the two-sided argmin."""
    r = np.random.default_rng(0)
    d = np.abs(r.normal(1e-3, 1e-3, (384, 256)))
    x = np.abs(r.normal(1.0, 0.3, 384))
    flips = np.where(r.random(256) < 0.5, -1.0, 1.0)[None, :]
    p = 0.99
    compared = 0
    for eta in _library_etas(d, x, p):
        ours, theirs = analytic_q_leaf(d * flips, x, p, eta), _official_float16(d, x, p, eta)
        if ours <= 0.03:
            assert abs(ours - theirs) <= 0.003, (eta, ours, theirs)
            compared += 1
        else:
            assert theirs <= ours + 0.003
    assert compared >= 3


def test_a_selected_leaf_without_input_statistics_is_named():
    d, x = _layer(d_out=64)
    for fn in (lambda: eta_grid({"w": d, "v": d}, {"w": True, "v": True}, {"w": x}, 0.9),
               lambda: analytic_q_tree({"w": d, "v": d}, {"w": x}, 0.9, 0.1)):
        with pytest.raises(ValueError, match="no input statistic for selected leaf 'v'"):
            fn()


@pytest.mark.parametrize("eta, gamma", [(0.0, 0.05), (-1.0, 0.05), (float("nan"), 0.05),
                                        (1.0, 0.0), (1.0, 1.0)])
def test_eq5_takes_a_positive_eta_and_a_failure_probability_in_0_1(eta, gamma):
    d, x = _layer(d_out=64)
    with pytest.raises(ValueError, match=r"eta=.* must be > 0 .* gamma=.* in \(0, 1\)"):
        analytic_q_tree({"w": d}, {"w": x}, 0.9, eta, gamma=gamma)


def test_eq5_objective_by_hand():
    # q = 0.5, S1 = 1, S2 = 2, p = 0.9, eta = 3, gamma = 0.05:
    # |log(2 / 0.05) + 3 (1 - 0.1 / 0.5) 1 + 9 Phi(0.9) 2 / (4 0.25)|
    want = abs(np.log(40.0) + 2.4 + 18.0 * (-0.8 / np.log(1 / 9)))
    got = eq5_objective(0.5, np.array([1.0]), np.array([2.0]), 0.9, 3.0, 0.05)
    assert float(got) == pytest.approx(want, rel=1e-12)


def test_official_scan_ties_keep_the_larger_q_and_count_as_stops():
    """Units with no coefficients have a flat f_i: each tie moves their q up one step and
    marks them done, so with four of five units flat the scan stops (4/5 reaches 0.8) after
    its second step; the fifth unit, still falling, keeps that step's q."""
    p, eta = 0.9, 2.0
    d = np.zeros((3, 5))  # [d_in, d_out]: units 0-3 flat
    d[:, 4] = [0.2, 0.1, 0.3]
    x = np.ones(3)
    got = analytic_q_leaf(d, x, p, eta, form="official_signed")
    assert got == pytest.approx(_official_oracle(d.T, x, p, eta), rel=1e-12)
    assert got == pytest.approx(1 - p + 0.001, abs=1e-12)


def test_two_sided_scan_finds_the_argmin_above_the_official_cap():
    # S1 = 0, S2 = 2: f_i = log 40 + eta^2 Phi S2 / (4 q^2) > 1e4 on the whole grid at
    # eta = 300 and falls with q: the argmin is the grid's end, not DARE's 1-p
    d, x = np.array([[1.0], [-1.0]]), np.ones(2)
    assert analytic_q_leaf(d, x, 0.9, 300.0) == pytest.approx(0.998)


def test_pooled_q_is_within_one_step_of_its_200_point_grid_of_the_optimum():
    p = 0.9
    one = np.array([[0.5], [1.0], [0.25]])
    x = np.ones(3)
    s1, s2 = coefficient_sums(one, x)
    eta = 2 * (1 - p) * s1[0] * 0.4367 / (phi(p) * s2[0])  # q* = 0.4367
    step = (1 - (1 - p)) / 200
    assert abs(analytic_q_leaf(one, x, p, eta, form="pooled") - 0.4367) <= step


def test_other_leaves_take_their_weights_q_or_the_mean_of_the_layers():
    tree = {"blk": {"w_a": np.zeros((2, 2)), "b_a": np.zeros(2)}, "w_b": np.zeros((2, 2)),
            "w_c": np.zeros((2, 2)), "scale": np.zeros(2)}
    q_mask = {"blk": {"w_a": True, "b_a": False}, "w_b": True, "w_c": True, "scale": False}
    got = fill_other_leaves({"blk/w_a": 0.1, "w_b": 0.2, "w_c": 0.6}, tree, None, q_mask)
    assert got["blk/b_a"] == 0.1 and got["scale"] == pytest.approx(0.3)  # mean, not median


def test_eta_v_search_follows_the_metrics_direction():
    r = np.random.default_rng(3)
    pre = {"w": jnp.asarray(r.normal(size=(6, 4)), jnp.float32)}
    d = {"w": jnp.asarray(r.normal(0, 0.3, (6, 4)), jnp.float32)}
    xs = {"w": np.abs(r.normal(size=6))}
    xin = jnp.asarray(r.normal(size=(10, 6)), jnp.float32)
    target = xin @ (pre["w"] + d["w"])
    err = lambda prm: float(jnp.mean(jnp.abs(xin @ prm["w"] - target)))  # noqa: E731
    etas = [1.0, 10.0, 100.0, 1000.0]
    low = search_eta_v(jax.random.PRNGKey(0), pre, d, xs, 0.8, err, etas,
                       higher_is_better=False)
    high = search_eta_v(jax.random.PRNGKey(0), pre, d, xs, 0.8, err, etas)
    assert len(set(low.search.scores)) > 1
    assert low.search.best_score == min(low.search.scores)
    assert high.search.best_score == max(high.search.scores)
