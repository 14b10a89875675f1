"""delta / apply and path-pattern leaf selection on arbitrary pytrees."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import delta as dl
from moejax.delta import apply, delta, leaf_paths, per_leaf_values, select_leaves
from moejax.delta.hash_mask import hash_keep_mask


class Blk(NamedTuple):
    ffn: dict
    norm: jnp.ndarray


def _params(shift=0.0):
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s) + shift, jnp.float32)
    return {
        "embed": f(10, 4),
        "layers": [Blk({"w_up": f(4, 8), "w_down": f(8, 4)}, f(4)) for _ in range(2)],
        "attn": {"q": f(4, 4)},
    }


def test_delta_apply_roundtrip_and_shape_errors():
    p, f = _params(), _params(0.3)
    d = delta(p, f)
    np.testing.assert_allclose(
        d["layers"][1].ffn["w_up"], f["layers"][1].ffn["w_up"] - p["layers"][1].ffn["w_up"]
    )
    back = apply(p, d)
    for a, b in zip(
        np.concatenate([np.ravel(x) for x in __import__("jax").tree_util.tree_leaves(back)]),
        np.concatenate([np.ravel(x) for x in __import__("jax").tree_util.tree_leaves(f)]),
    ):
        assert a == pytest.approx(b, abs=1e-6)
    bad = _params()
    bad["attn"]["q"] = jnp.zeros((4, 5))
    with pytest.raises(ValueError, match="attn/q"):
        delta(p, bad)
    with pytest.raises(ValueError, match="structures"):
        delta(p, {"embed": p["embed"]})
    # a delta whose leaf broadcasts against the parameter ([1, 4, 4] onto [4, 4], one per
    # stacked expert onto one matrix) would change the parameter's shape, silently
    for shape in ((1, 4, 4), (3, 4, 4)):
        d_bad = delta(p, f)
        d_bad["attn"]["q"] = jnp.zeros(shape)
        with pytest.raises(ValueError, match=rf"apply_delta: leaf 'attn/q' has shape "
                           rf"\({shape[0]}, 4, 4\) in the delta but \(4, 4\)"):
            apply(p, d_bad)


def test_select_leaves_patterns():
    p = _params()
    assert "layers/0/ffn/w_up" in leaf_paths(p) and "layers/1/norm" in leaf_paths(p)
    m = select_leaves(p, include=[r"ffn/", r"attn/"], exclude=r"embed|norm")
    sel = {path for path, s in zip(leaf_paths(p), __import__("jax").tree_util.tree_leaves(m)) if s}
    assert sel == {f"layers/{i}/ffn/{w}" for i in (0, 1) for w in ("w_up", "w_down")} | {"attn/q"}
    all_mats = select_leaves(p)  # min_ndim=2: norms (1-D) skipped
    assert sum(__import__("jax").tree_util.tree_leaves(all_mats)) == 6
    with pytest.raises(ValueError, match="matched no leaf"):
        select_leaves(p, include="nothing_here")


def test_per_leaf_values_forms():
    t = {"a": jnp.zeros(2), "b": {"c": jnp.zeros(3)}}
    assert per_leaf_values(0.5, t) == [0.5, 0.5]
    assert per_leaf_values({"a": 1.0, "b/c": 2.0}, t) == [1.0, 2.0]
    assert per_leaf_values({"a": 1.0, "b": {"c": 3.0}}, t) == [1.0, 3.0]
    with pytest.raises(ValueError, match="missing"):
        per_leaf_values({"a": 1.0}, t)


def test_a_mask_of_another_structure_is_refused_by_every_pruner():
    """A mask's leaves are matched to the delta's by position: one built from another tree
    (a missing or an extra leaf, other keys) would prune the wrong matrices, so it is
    refused, naming the function and the fix."""
    d = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 4))}
    x = {k: jnp.ones(4) for k in d}
    key = jax.random.key(0)
    calls = {
        "dare": lambda m: dl.dare(key, d, 0.5, mask=m),
        "dare_keep_mask": lambda m: dl.dare_keep_mask(key, d, 0.5, m, rng="threefry"),
        "hash_keep_mask": lambda m: hash_keep_mask(key, d, 0.5, m),
        "map_selected": lambda m: dl.map_selected(lambda v: v, d, m),
        "wanda_prune": lambda m: dl.wanda_prune(d, x, 0.5, mask=m),
        "structural_dpp": lambda m: dl.structural_dpp(key, d, 0.5, 0.5, mask=m),
        "analytic_q_tree": lambda m: dl.analytic_q_tree(d, x, 0.5, 0.1, mask=m),
        "eta_grid": lambda m: dl.eta_grid(d, m, x, 0.5),
        "delta_stats": lambda m: dl.delta_stats(d, m),
    }
    for bad in ({"a": True, "b": True}, {"a": True, "x": False, "c": True}):
        for who, call in calls.items():
            with pytest.raises(ValueError, match=rf"{who}: the mask's structure differs .*"
                                                 r"select_leaves\(delta_tree"):
                call(bad)
    assert dl.analytic_q_tree(d, x, 0.5, 0.1, mask={"a": True, "b": False, "c": True})


def test_a_bad_pattern_is_named():
    with pytest.raises(ValueError, match=r"select_leaves: '\(' is not a regular expression"):
        select_leaves({"a": jnp.ones((2, 2))}, include="(")
