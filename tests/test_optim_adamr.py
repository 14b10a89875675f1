"""AdamR (Algorithm 1) vs a plain numpy oracle; composition with optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax.optim import adamr

SHAPES = {"w": (4, 3), "b": (3,), "blk": {"k": (2, 5)}}


def _tree(rng, scale=1.0, shift=0.0):
    return jax.tree_util.tree_map(
        lambda s: (shift + scale * rng.normal(size=s)).astype(np.float32),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _oracle(theta0, anchor, grads_seq, lr_fn, lam, reg, b1=0.9, b2=0.999, eps=1e-8):
    """Algorithm 1 literally, float64, flat vector over all parameters."""
    flat = lambda t: np.concatenate(
        [np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(t)]
    )
    th, tp = flat(theta0), flat(anchor)
    m = np.zeros_like(th)
    v = np.zeros_like(th)
    for t, g in enumerate(grads_seq, start=1):
        g = flat(g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1**t), v / (1 - b2**t)
        vbar = vh.mean()
        r = th - tp if reg == "l2" else np.sign(th - tp)
        th = (
            th
            - lr_fn(t - 1) * mh / (np.sqrt(vh) + eps)
            - lr_fn(t - 1) / (np.sqrt(vbar) + eps) * lam * r
        )
    return th


def _run(tx, theta0, grads_seq):
    state = tx.init(theta0)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    params = theta0
    for g in grads_seq:
        upd, state = step(g, state, params)
        params = optax.apply_updates(params, upd)
    return params


@pytest.mark.parametrize("reg", ["l2", "l1"])
def test_adamr_matches_numpy_algorithm1(reg):
    rng = np.random.default_rng(0)
    anchor = _tree(rng)
    theta0 = jax.tree_util.tree_map(
        lambda a: a + 0.5 * rng.normal(size=a.shape).astype(np.float32), anchor
    )
    grads = [_tree(rng, scale=10.0 ** rng.uniform(-2, 0)) for _ in range(60)]
    sched = optax.linear_schedule(1e-2, 1e-3, 60)
    out = _run(adamr(sched, 0.1, reg=reg, anchor=anchor), theta0, grads)
    ref = _oracle(theta0, anchor, grads, lambda c: float(sched(c)), 0.1, reg)
    got = np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(out)])
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    assert (
        np.abs(
            got - np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(theta0)])
        ).max()
        > 1e-2
    )


def test_weight_zero_equals_adam_exactly():
    rng = np.random.default_rng(1)
    theta0 = _tree(rng)
    grads = [_tree(rng) for _ in range(25)]
    a = _run(adamr(3e-3, 0.0), theta0, grads)
    b = _run(optax.adam(3e-3), theta0, grads)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_pulls_toward_anchor_not_zero():
    rng = np.random.default_rng(2)
    anchor = _tree(rng, scale=0.1, shift=3.0)
    theta0 = jax.tree_util.tree_map(
        lambda a: a + rng.normal(size=a.shape).astype(np.float32), anchor
    )
    grads = [_tree(rng, scale=0.1) for _ in range(300)]  # zero-mean noise: only the decay pulls
    dist = lambda t: max(
        float(jnp.abs(x - a).max())
        for x, a in zip(jax.tree_util.tree_leaves(t), jax.tree_util.tree_leaves(anchor))
    )
    out = _run(adamr(1e-2, 0.5, anchor=anchor), theta0, grads)
    assert dist(out) < 0.1 * dist(theta0)
    # anchor defaults to the params given to init: starting at the anchor stays there
    same = _run(adamr(1e-2, 0.5), anchor, grads)
    assert dist(same) < 0.15
    # AdamW's decay pulls toward zero instead
    out_w = _run(optax.adamw(1e-2, weight_decay=0.5), theta0, grads)
    mean = lambda t: float(
        np.mean(np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(t)]))
    )
    assert mean(out) == pytest.approx(3.0, abs=0.1)
    assert mean(out_w) < 2.0


def test_composes_with_clipping_masking_and_decay_mask():
    rng = np.random.default_rng(3)
    theta0 = _tree(rng)
    grads = [_tree(rng, scale=100.0) for _ in range(5)]
    clipped = _run(optax.chain(optax.clip_by_global_norm(1.0), adamr(1e-2, 0.1)), theta0, grads)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(clipped))
    mask = {"w": True, "b": False, "blk": {"k": True}}
    masked = _run(optax.masked(adamr(1e-2, 0.1), mask), theta0, grads)
    # masked-out leaves get the raw gradients (optax.masked passes them through)
    np.testing.assert_allclose(
        masked["b"], theta0["b"] + np.sum([g["b"] for g in grads], 0), rtol=1e-6
    )
    assert not np.allclose(masked["w"], theta0["w"])
    # mask: no anchored decay on "b" -> identical to weight_decay 0 on that leaf's Adam path
    dm = {"w": True, "b": False, "blk": {"k": True}}
    a = _run(adamr(1e-2, weight_decay=0.3, mask=dm), theta0, grads)
    b0 = _run(optax.adam(1e-2), theta0, grads)
    np.testing.assert_array_equal(np.asarray(a["b"]), np.asarray(b0["b"]))
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(b0["w"]))


def test_former_keyword_names_still_work_and_warn():
    """optax's names (weight_decay, mask) are the API; the former weight / decay_mask give
    the same updates with a DeprecationWarning, and giving both names is refused."""
    theta0 = {"w": jnp.ones((3, 3)), "b": jnp.full((3,), 0.5)}
    grads = [jax.tree.map(lambda x, i=i: jnp.full_like(x, 0.1 * (i + 1)), theta0)
             for i in range(3)]
    dm = {"w": True, "b": False}
    new = _run(adamr(1e-2, weight_decay=0.3, mask=dm), theta0, grads)
    with pytest.warns(DeprecationWarning, match="weight= is now weight_decay="):
        old_w = adamr(1e-2, weight=0.3, mask=dm)
    with pytest.warns(DeprecationWarning, match="decay_mask= is now mask="):
        old_m = adamr(1e-2, 0.3, decay_mask=dm)
    for tx in (old_w, old_m):
        got = _run(tx, theta0, grads)
        for k in theta0:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(new[k]))
    with pytest.raises(TypeError, match="not both"):
        adamr(1e-2, 0.3, weight=0.3)


def test_update_without_params_errors():
    tx = adamr(1e-3, 0.1)
    p = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(p, tx.init(p))


@pytest.mark.parametrize("reg", ["l2", "l1"])
def test_inject_hyperparams_binds_adamr_and_its_weight_decay_can_change(reg):
    """``optax.inject_hyperparams(adamr)`` (the usual way to schedule or log a rate) binds
    the signature and gives adamr's updates; the injected weight decay is state, so setting
    it to 0 mid-run gives injected Adam's updates from there (injected hyperparameters are
    float32 arrays, so both are compared injected)."""
    rng = np.random.default_rng(4)
    anchor = _tree(rng)
    theta0 = jax.tree.map(lambda a: a + 0.5 * rng.normal(size=a.shape).astype(np.float32),
                          anchor)
    grads = [_tree(rng) for _ in range(6)]
    injected = optax.inject_hyperparams(adamr)(learning_rate=1e-2, weight_decay=0.1, reg=reg,
                                               anchor=anchor)
    plain = _run(adamr(1e-2, 0.1, reg=reg, anchor=anchor), theta0, grads)
    got = _run(injected, theta0, grads)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    state = injected.init(theta0)
    assert set(state.hyperparams) >= {"learning_rate", "weight_decay"}
    state.hyperparams["weight_decay"] = jnp.zeros_like(state.hyperparams["weight_decay"])
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    upd, _ = jax.jit(injected.update)(grads[0], state, theta0)
    ref, _ = jax.jit(adam.update)(grads[0], adam.init(theta0), theta0)
    for x, y in zip(jax.tree_util.tree_leaves(upd), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
