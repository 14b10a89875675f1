"""delta / apply and path-pattern leaf selection on arbitrary pytrees."""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.delta import apply, delta, leaf_paths, per_leaf_values, select_leaves


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
