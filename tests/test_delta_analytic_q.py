"""Per-layer analytic q (Eq. 5) vs a numpy oracle; eta search."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import (
    analytic_q_leaf,
    analytic_q_tree,
    coefficient_sums,
    phi,
    psi,
    q_grid,
    search_eta_e,
)


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
        assert analytic_q_leaf(d, xbar, p, eta, gamma=gamma, grid=grid) == pytest.approx(
            _oracle_q(d, xbar, p, eta, gamma, grid)
        )
    s1, s2 = coefficient_sums(d, xbar)
    np.testing.assert_allclose(s1, (np.abs(d) * xbar[:, None]).sum(0), rtol=1e-6)
    # single output unit: objective is minimised at q* = eta Phi S2 / (2 (1-p) S1)
    one = d[:, :1]
    s1, s2 = coefficient_sums(one, xbar)
    eta = 2 * (1 - p) * s1[0] * 0.5 / (phi(p) * s2[0])  # puts q* = 0.5
    fine = np.linspace(1 - p, 1, 2001)[:-1]
    assert analytic_q_leaf(one, xbar, p, eta, grid=fine) == pytest.approx(0.5, abs=1e-3)
    # torch layout [d_out, d_in] with in_axis=-1 gives the same q
    assert analytic_q_leaf(d.T, xbar, p, 30.0, grid=grid, in_axis=-1) == analytic_q_leaf(
        d, xbar, p, 30.0, grid=grid
    )
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
    qs = analytic_q_tree(d, xs, 0.8, 50.0, mask=mask)
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
    assert res.search.best_score == pytest.approx(min(res.search.scores))
