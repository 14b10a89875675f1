"""experiments.bench: the synthetic union patterns have exactly the asked union, and the timer
times what it is given."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import time_call, time_interleaved, union_activations


@pytest.mark.parametrize("n,union,density", [(1, 3, 1.0), (8, 16, 0.3), (32, 1, 0.5),
                                              (4, 0, 1.0), (2, 32, 0.01)])
def test_union_activations_have_exactly_the_asked_union(n, union, density):
    a = union_activations(jax.random.key(n + union), n, 32, union, density)
    assert a.shape == (n, 32) and bool(jnp.all(a >= 0))
    assert int(jnp.sum(jnp.any(a > 0, axis=0))) == union
    if density == 1.0:  # every token active on every union expert
        np.testing.assert_array_equal(np.asarray(a > 0), np.asarray(jnp.any(a > 0, 0))[None]
                                      .repeat(n, 0))


def test_union_activations_density_sets_the_token_level_fraction():
    a = union_activations(jax.random.key(0), 512, 64, 32, density=0.25)
    frac = float(jnp.mean((a > 0)[:, jnp.any(a > 0, 0)]))
    assert 0.22 < frac < 0.29
    with pytest.raises(ValueError, match="union_size"):
        union_activations(jax.random.key(0), 4, 8, 9)


def test_time_call_counts_repeats_and_orders_min_median():
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    out = time_call(fn, jnp.ones(3), warmup=1, repeats=4)
    assert len(calls) == 1 + 1 + 4
    assert 0 < out["min_s"] <= out["median_s"] and out["repeats"] == 4
    with pytest.raises(ValueError, match="repeats"):
        time_call(fn, jnp.ones(3), repeats=0)


def test_time_interleaved_warms_every_fn_then_alternates():
    order = []
    fns = {name: (lambda x, name=name: order.append(name) or x + 1) for name in ("a", "b")}
    out = time_interleaved(fns, jnp.ones(3), warmup=1, repeats=3)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3   # warm-ups, then round-robin
    assert set(out) == {"a", "b"}
    assert all(0 < r["min_s"] <= r["median_s"] and r["repeats"] == 3 for r in out.values())
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved(fns, jnp.ones(3), repeats=0)
