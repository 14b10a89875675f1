"""moejax.bench.timing: the synthetic union patterns have exactly the asked union, and the timers
time what they are given (the device loop calls the function in every iteration, not once)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.bench.timing import time_call, time_device_loop, time_interleaved, union_activations


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


def test_time_device_loop_runs_the_call_in_every_iteration():
    """A call that does k times the work takes about k times as long per iteration: the loop
    neither hoists the loop-invariant call nor drops it."""
    x = jax.random.normal(jax.random.key(0), (256, 256))

    def chain(k):
        def fn(x):
            for _ in range(k):
                x = jnp.tanh(x @ x) * 0.5
            return x
        return fn

    one = time_device_loop(chain(2), x, iters=20, repeats=5)
    many = time_device_loop(chain(16), x, iters=20, repeats=5)
    assert one["iters"] == 20 and 0 < one["min_s"] <= one["median_s"] and one["flush_s"] == 0
    # 8x the work: compared by the fastest repeat (the median of a short call on a busy
    # machine can be twice its minimum)
    assert many["min_s"] > 3 * one["min_s"], (one, many)
    flushed = time_device_loop(chain(16), x, iters=5, repeats=3, flush_bytes=1 << 20)
    assert flushed["flush_s"] > 0 and np.isfinite(flushed["median_s"])
    with pytest.raises(ValueError, match="flush_bytes"):
        time_device_loop(chain(1), x, flush_bytes=-1)
