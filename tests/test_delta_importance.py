"""Magnitude / WANDA keep exactly the top (1-p) m n; structural DPP; input norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import (
    accumulate_input_norms,
    input_mean,
    input_mean_abs,
    input_stats_init,
    input_stats_update,
    magnitude_prune,
    num_kept,
    structural_dpp,
    topk_keep_mask,
    topk_keep_mask_sort,
    wanda_prune,
)
from moejax.delta.importance import _select_top_k


def _oracle_topk(score, k):
    flat = score.ravel()
    keep = np.zeros(flat.size, bool)
    keep[np.argsort(-flat, kind="stable")[:k]] = True
    return keep.reshape(score.shape)


@pytest.mark.parametrize("kind", ["continuous", "ties", "zeros", "tiny"])
def test_topk_select_equals_sort_oracle(kind):
    """The bitwise threshold search keeps exactly the entries the stable sort keeps, ties
    by flat index included: integer scores with many duplicates, mostly-zero scores (a
    sparse delta), -0.0, denormals and huge values, per block of 1 and 2 trailing axes,
    k from 0 to size."""
    r = np.random.default_rng({"continuous": 0, "ties": 1, "zeros": 2, "tiny": 3}[kind])
    shape = (3, 17, 23)
    if kind == "continuous":
        s = np.abs(r.normal(size=shape))
    elif kind == "ties":
        s = r.integers(0, 4, size=shape).astype(np.float64)
    elif kind == "zeros":
        s = np.where(r.random(shape) < 0.8, 0.0, np.abs(r.normal(size=shape)))
        s[0, 0, :5] = -0.0
    else:
        s = r.choice([0.0, 1e-45, 3e-40, 1e-38, 1.0, 3e38], size=shape)
    s = jnp.asarray(s, jnp.float32)
    for nd in (1, 2):
        for p in (0.0, 0.3, 0.5, 0.8, 0.9, 0.97, 1.0):
            got = np.asarray(jax.jit(lambda x, p=p, nd=nd: topk_keep_mask(x, p, nd))(s))
            want = np.asarray(topk_keep_mask_sort(s, p, nd))
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} nd={nd} p={p}")
            size = 23 if nd == 1 else 17 * 23
            assert (got.reshape(-1, size).sum(-1) == num_kept(size, p)).all()


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_magnitude_keeps_exact_top_count(p):
    r = np.random.default_rng(0)
    d = {
        "w": jnp.asarray(r.normal(size=(20, 10)), jnp.float32),
        "stack": jnp.asarray(r.normal(size=(3, 10, 20)), jnp.float32),
        "n": jnp.ones(7),
    }
    out = magnitude_prune(d, p, mask={"w": True, "stack": True, "n": False})
    k = num_kept(200, p)
    np.testing.assert_array_equal(
        np.asarray(out["w"]) != 0, _oracle_topk(np.abs(np.asarray(d["w"])), k)
    )
    for e in range(3):  # per matrix of the expert stack
        assert np.count_nonzero(np.asarray(out["stack"][e])) == k
        np.testing.assert_array_equal(
            np.asarray(out["stack"][e]) != 0, _oracle_topk(np.abs(np.asarray(d["stack"][e])), k)
        )
    kept = np.asarray(out["w"])[np.asarray(out["w"]) != 0]
    assert set(kept.tolist()) <= set(np.asarray(d["w"]).ravel().tolist())  # no rescale
    np.testing.assert_array_equal(out["n"], d["n"])


def test_wanda_with_accumulated_norms():
    r = np.random.default_rng(1)
    d = {"w": jnp.asarray(r.normal(size=(16, 6)), jnp.float32)}
    batches = [r.normal(size=(2, 5, 16)) * np.linspace(0.1, 3, 16) for _ in range(3)]
    norms = accumulate_input_norms(batches)
    np.testing.assert_allclose(
        norms, np.sqrt(sum((b.reshape(-1, 16) ** 2).sum(0) for b in batches)), rtol=1e-5
    )
    st = input_stats_init(16)
    for b in batches:
        st = input_stats_update(st, jnp.asarray(b))
    np.testing.assert_allclose(
        input_mean_abs(st),
        np.abs(np.concatenate([b.reshape(-1, 16) for b in batches])).mean(0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(  # the signed mean (official analytic-q statistic)
        input_mean(st), np.concatenate([b.reshape(-1, 16) for b in batches]).mean(0),
        rtol=1e-5, atol=1e-6,
    )
    p = 0.75
    out = wanda_prune(d, {"w": norms}, p)
    score = np.abs(np.asarray(d["w"])) * np.asarray(norms)[:, None]
    np.testing.assert_array_equal(np.asarray(out["w"]) != 0, _oracle_topk(score, num_kept(96, p)))
    assert np.count_nonzero(out["w"]) == 24
    per_out = wanda_prune(d, {"w": norms}, p, per_output=True)
    assert all(np.count_nonzero(np.asarray(per_out["w"])[:, j]) == 4 for j in range(6))
    # WANDA differs from magnitude when input norms vary
    assert not np.array_equal(
        np.asarray(out["w"]) != 0, np.asarray(magnitude_prune(d, p)["w"]) != 0
    )
    with pytest.raises(ValueError, match="d_in"):
        wanda_prune(d, {"w": norms[:5]}, p)


def test_structural_dpp_columns_and_rate():
    r = np.random.default_rng(2)
    d = {
        "w": jnp.asarray(r.normal(size=(200, 50)) + 0.1, jnp.float32),
        "s": jnp.asarray(r.normal(size=(2, 40, 30)), jnp.float32),
    }
    a, b = 0.05, 0.2
    out = structural_dpp(jax.random.PRNGKey(0), d, a, b)
    w = np.asarray(out["w"])
    rows = np.flatnonzero(np.any(w != 0, axis=1))  # in_axis=-2 -> input features are rows
    assert len(rows) <= 10 and len(rows) >= 8  # round(0.05 * 200) = 10 chosen features
    chosen_total = 10 * 50
    assert abs(np.count_nonzero(w) / chosen_total - b) < 0.08
    nz = w != 0
    np.testing.assert_allclose(
        w[nz], np.asarray(d["w"])[nz] / (a * b), rtol=1e-6
    )  # default q = a b
    for e in range(2):
        assert np.count_nonzero(np.any(np.asarray(out["s"][e]) != 0, axis=1)) <= 2
    q = structural_dpp(jax.random.PRNGKey(0), d, a, b, q=0.5)
    np.testing.assert_allclose(np.asarray(q["w"])[nz], np.asarray(d["w"])[nz] / 0.5, rtol=1e-6)
    # unbiased in expectation over keys (rate a*b, rescale 1/(a b))
    outs = jax.vmap(lambda k: structural_dpp(k, {"w": d["w"][:20, :4]}, 0.5, 0.5)["w"])(
        jax.random.split(jax.random.PRNGKey(1), 4000)
    )
    np.testing.assert_allclose(np.asarray(outs).mean(0), np.asarray(d["w"][:20, :4]), atol=0.25)


def test_eager_topk_compiles_once_per_shape_and_k():
    """Eager pruning calls reuse one compiled search per (shape, k) instead of re-tracing the
    loop each call (which once exhausted XLA's code memory in a long study)."""
    d = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(24, 40)), jnp.float32)}
    magnitude_prune(d, 0.7)
    before = _select_top_k._cache_size()
    for _ in range(5):
        magnitude_prune(d, 0.7)
    assert _select_top_k._cache_size() == before


def test_the_kept_count_rounds_to_nearest():
    assert num_kept(3, 0.5) == 2 and num_kept(7, 0.9) == 1 and num_kept(10, 0.99) == 0
    assert num_kept(100, 0.0) == 100 and num_kept(100, 1.0) == 0


def test_wanda_on_stacked_experts_uses_each_experts_own_input_norms():
    r = np.random.default_rng(3)
    d = {"w": jnp.asarray(r.normal(size=(3, 12, 5)), jnp.float32)}  # [E, d_in, d_out]
    norms = np.abs(r.normal(size=(3, 12))) * np.array([[0.1], [1.0], [10.0]])
    norms[1, :6] *= 50  # expert 1's first inputs dominate its scores
    out = np.asarray(wanda_prune(d, {"w": norms}, 0.6)["w"])
    for e in range(3):
        alone = wanda_prune({"w": d["w"][e]}, {"w": norms[e]}, 0.6)["w"]
        np.testing.assert_array_equal(out[e], np.asarray(alone))


def test_structural_dpp_draws_round_a_d_in_features_per_expert():
    r = np.random.default_rng(4)
    d = {"s": jnp.asarray(r.normal(size=(4, 30, 8)) + 0.1, jnp.float32)}  # [E, d_in, d_out]
    out = np.asarray(structural_dpp(jax.random.PRNGKey(3), d, 0.05, 1.0)["s"])
    rows = [tuple(np.flatnonzero(np.any(out[e] != 0, axis=1))) for e in range(4)]
    assert all(len(x) == 2 for x in rows)  # round(0.05 x 30) = round(1.5) = 2, b = 1
    assert len(set(rows)) > 1  # each expert draws its own features
