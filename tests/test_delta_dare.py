"""DARE / DAREx-q: exactness vs a numpy oracle, unbiasedness, q searches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import (
    NoFiniteScore,
    apply,
    dare,
    dare_keep_mask,
    grid_search,
    q_grid,
    search_q_e,
    search_q_v,
    select_leaves,
    structural_dpp,
)
from moejax.optim import dare_updates


def _delta(mean=0.0):
    r = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(r.normal(mean, 1.0, (6, 5)), jnp.float32),
        "w2": jnp.asarray(r.normal(mean, 1.0, (5, 3)), jnp.float32),
        "bias": jnp.asarray(r.normal(size=(3,)), jnp.float32),
    }


def test_dare_matches_oracle_and_q_equals_1mp_is_dare():
    d, p, key = _delta(), 0.7, jax.random.PRNGKey(1)
    mask = select_leaves(d)
    keep = dare_keep_mask(key, d, p, mask)
    out = dare(key, d, p, mask=mask)
    for k in ("w1", "w2"):
        oracle = np.where(np.asarray(keep[k]), np.asarray(d[k]) / np.float32(1 - p), 0.0)
        np.testing.assert_allclose(np.asarray(out[k]), oracle.astype(np.float32), rtol=1e-6)
        assert np.array_equal(
            np.asarray(out[k]) != 0, np.asarray(keep[k]) & (np.asarray(d[k]) != 0)
        )
    np.testing.assert_array_equal(out["bias"], d["bias"])  # unselected leaf untouched
    same = dare(key, d, p, q=1 - p, mask=mask)
    for k in d:
        np.testing.assert_array_equal(np.asarray(same[k]), np.asarray(out[k]))
    # DAREx-q: same mask, survivors scaled by 1/q (global, per-path dict)
    qx = dare(key, d, p, q={"w1": 0.5, "w2": 0.4, "bias": 1.0}, mask=mask)
    np.testing.assert_allclose(
        np.asarray(qx["w1"]),
        np.where(np.asarray(keep["w1"]), np.asarray(d["w1"]) / 0.5, 0),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        np.asarray(qx["w2"]),
        np.where(np.asarray(keep["w2"]), np.asarray(d["w2"]) / 0.4, 0),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        dare(key, d, 1.0)


def test_dare_unbiased_statistically():
    d, p, n = _delta(), 0.9, 6000
    keys = jax.random.split(jax.random.PRNGKey(3), n)
    outs = jax.vmap(lambda k: dare(k, d, p))(keys)
    for k in d:
        mean = np.asarray(outs[k]).mean(0)
        sd = np.abs(np.asarray(d[k])) * np.sqrt(p / (1 - p) / n)
        assert np.all(np.abs(mean - np.asarray(d[k])) <= 5 * sd + 1e-6), k
        assert abs(np.mean(np.asarray(outs[k]) != 0) - (1 - p)) < 0.01
    # both mask generators keep 1 - p of the entries
    big = {"w": jnp.ones((400, 250))}
    for rng in ("hash", "threefry"):
        kept = np.asarray(dare_keep_mask(jax.random.PRNGKey(4), big, p, rng=rng)["w"]).mean()
        assert abs(kept - (1 - p)) < 0.005, (rng, kept)  # 100k draws: sd 0.001
    # independence across leaves: masks of two same-shape leaves differ
    m = dare_keep_mask(
        jax.random.PRNGKey(0), {"a": jnp.ones((50, 50)), "b": jnp.ones((50, 50))}, 0.5
    )
    assert not np.array_equal(m["a"], m["b"])


def _toy():
    """Linear model y = x @ (W_P + Delta), zero-mean deltas.

    At p=0.9 the 1/(1-p) rescale inflates the output variance, so q > 1-p helps.
    """
    r = np.random.default_rng(5)
    w_p = {"w": jnp.asarray(r.normal(size=(64, 8)), jnp.float32)}
    d = {"w": jnp.asarray(r.normal(0.0, 0.2, (64, 8)), jnp.float32)}
    x = jnp.asarray(np.abs(r.normal(size=(16, 64))), jnp.float32)
    return w_p, d, (lambda prm: x @ prm["w"])


def test_search_q_e_is_grid_argmin_of_oracle():
    w_p, d, fn = _toy()
    p, key = 0.9, jax.random.PRNGKey(2)
    grid = q_grid(p, 30)
    res = search_q_e(key, w_p, d, p, fn, grid=grid)
    ref = np.asarray(fn(apply(w_p, d)))
    keep = np.asarray(dare_keep_mask(key, d, p)["w"])
    oracle = [
        np.abs(np.asarray(fn({"w": w_p["w"] + np.where(keep, d["w"] / q, 0)})) - ref).mean()
        for q in grid
    ]
    np.testing.assert_allclose(res.scores, oracle, rtol=1e-4, atol=1e-5)
    assert res.best == pytest.approx(grid[int(np.argmin(oracle))])
    assert res.best > 1 - p + 1e-6 and res.best_score < oracle[0]  # DAREx-q beats DARE here
    fine = search_q_e(key, w_p, d, p, fn, grid=grid, refine_rounds=2)
    assert fine.best_score <= res.best_score + 1e-7 and len(fine.points) > len(grid)


def test_search_q_v_uses_metric_direction():
    w_p, d, fn = _toy()
    p, key = 0.9, jax.random.PRNGKey(2)
    target = fn(apply(w_p, d))
    neg_mse = lambda prm: -float(jnp.mean((fn(prm) - target) ** 2))
    hi = search_q_v(key, w_p, d, p, neg_mse, higher_is_better=True)
    lo = search_q_v(key, w_p, d, p, lambda prm: -neg_mse(prm), higher_is_better=False)
    assert hi.best == lo.best and hi.best > 1 - p
    assert hi.best_score == pytest.approx(np.max(hi.scores))


def test_a_search_whose_metric_fails_everywhere_chooses_nothing():
    with pytest.raises(NoFiniteScore, match=r"not finite at any of the 3 points"):
        grid_search(lambda q: float("nan"), [0.1, 0.2, 0.3])
    # one finite point is enough, and a non-finite one never wins
    assert grid_search(lambda q: float("nan") if q < 0.3 else 1.0, [0.1, 0.2, 0.3]).best == 0.3


def test_q_grid_is_algorithm_2s_and_refinement_stays_inside_its_bounds():
    # q_t = 1 - p + t dq, t = 0..N, dq = (1 - (1 - p)) / N; Algorithm 3 drops t = N
    np.testing.assert_allclose(q_grid(0.9, 4), [0.1, 0.325, 0.55, 0.775, 1.0])
    np.testing.assert_allclose(q_grid(0.9, 4, include_max=False), [0.1, 0.325, 0.55, 0.775])
    g = q_grid(0.99, 8, spacing="geometric", inv_q_min=10.0)
    assert len(g) == 9 and g[0] == pytest.approx(0.01) and g[-1] == pytest.approx(0.1)
    np.testing.assert_allclose(g[1:] / g[:-1], (0.1 / 0.01) ** (1 / 8))
    # p = 0.9: 1 - p is 1 / inv_q_min itself; the grid runs to q_max instead of collapsing
    g = q_grid(0.9, 4, spacing="geometric", inv_q_min=10.0)
    assert g[0] == pytest.approx(0.1) and g[-1] == pytest.approx(1.0)
    # each refinement round searches between the best point's neighbours of the round before
    res = grid_search(lambda q: (q - 1.23) ** 2, [0.0, 1.0, 2.0, 3.0, 4.0], refine_rounds=2,
                      refine_num=10)
    assert res.best == pytest.approx(1.24) and len(res.points) == 5 + 8 + 8  # no repeats
    # the best point at either end of the grid: refinement never leaves [lo, hi]
    for f in (lambda q: q, lambda q: -q):
        res = grid_search(f, q_grid(0.9, 4), refine_rounds=3, lo=0.1, hi=1.0)
        assert res.points.min() >= 0.1 - 1e-12 and res.points.max() <= 1.0 + 1e-12
        assert res.best == pytest.approx(0.1 if f(1.0) > f(0.1) else 1.0)


@pytest.mark.parametrize("method", ["dare", "structural_dpp", "dare_updates"])
def test_bfloat16_survivors_are_rescaled_by_the_exact_q_rounded_once(method):
    """A bfloat16 delta's survivors are ``d / q`` rounded once to bfloat16, so their sum is
    the exact rescaled sum up to rounding noise: dividing by q rounded to bfloat16 first
    (0.3 -> 0.30078) shrinks every survivor by the same factor, the sum by 0.27%, and DARE
    would no longer be unbiased."""
    d = jnp.abs(jax.random.normal(jax.random.key(0), (256, 256))).astype(jnp.bfloat16)
    key, q = jax.random.key(1), 0.3
    if method == "dare":
        out = dare(key, {"w": d}, 0.7)["w"]
    elif method == "structural_dpp":
        out = structural_dpp(key, {"w": d}, 0.5, 0.6, q=q)["w"]
    else:
        tx = dare_updates(0.7, 0)
        out = tx.update({"w": d}, tx.init({"w": d}))[0]["w"]
    assert out.dtype == jnp.bfloat16
    kept = np.asarray(out) != 0
    assert 0.1 < kept.mean() < 0.5
    ratio = np.asarray(out, np.float64)[kept].sum() / (np.asarray(d, np.float64)[kept] / q).sum()
    assert abs(ratio - 1) < 3e-4, ratio
