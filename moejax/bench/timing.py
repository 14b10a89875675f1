"""Benchmark utilities: timing a jitted call and synthetic BlockFFN activation patterns.

* :func:`time_call`: compile once, ``warmup`` untimed calls, then ``repeats`` timed calls
  (each waits for the result with ``block_until_ready``); median and minimum seconds.
* :func:`time_device_loop`: device time per call, from ``iters`` calls inside one jitted
  loop (no host dispatch between calls; the kernels' launches are counted); with
  ``profile``, also the call's kernels and their device time from the profiler. On a CPU,
  whose compiler hoists a loop-invariant call out of such a loop, blocking calls timed
  from the host.
* :func:`kernel_unavailable`: why a kernel path cannot be timed here (None when it can).
* :func:`union_activations`: combine weights ``[n, E]`` for a chunk of ``n`` tokens whose
  union of active experts is exactly a random set of ``union_size`` experts: each token is
  active on each union expert with probability ``density`` and every union expert is active
  for at least one token (``density=1``: every token on every union expert, so the
  token-level and chunk-level sparsity coincide).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.bench.profile import trace_kernels
from moejax.kernels.tiling import hopper_target
from moejax.train.budget import lowered_fitting

__all__ = ["time_call", "time_interleaved", "time_device_loop", "how_timed", "union_activations",
           "kernel_unavailable", "device_matmul_gflops", "KERNEL_PATHS", "HOST_PATHS"]

KERNEL_PATHS = ("pallas", "triton", "gmm", "tokamax")
HOST_PATHS = ("host", "host_capacity")


def kernel_unavailable(path: str) -> str | None:
    """Why the compute path ``path`` has no speed measurement on this machine ("not
    measured: ..."), or None. The kernel paths need a GPU: on a CPU Pallas runs in interpret
    mode, which is no speed measurement; ``triton`` also needs ``jax_triton``. The host
    (numpy) dispatch paths run on the CPU backend only."""
    if path == "decode":
        if jax.default_backend() == "tpu" or (jax.default_backend() == "gpu" and hopper_target()):
            return None
        return ("not measured: the decode kernels are Mosaic TPU and Mosaic GPU (Hopper) "
                f"kernels ({jax.default_backend()} runs them in interpret mode or not at all)")
    if path in HOST_PATHS:
        return (None if jax.default_backend() == "cpu" else
                "not measured: a host (numpy) path, for the CPU backend only")
    if path not in KERNEL_PATHS:
        return None
    if jax.default_backend() != "gpu":
        return (f"not measured: needs a GPU ({jax.default_backend()} runs Pallas in "
                "interpret mode)")
    if path == "triton":
        from moejax.kernels.chunk_union.fused_triton import unavailable_reason

        why = unavailable_reason()
        return None if why is None else f"not measured: {why}"
    return None


def time_call(fn: Callable, *args, warmup: int = 2, repeats: int = 10) -> dict:
    """``{"compile_s", "median_s", "min_s", "repeats"}`` of ``fn(*args)``."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return {"compile_s": compile_s, "median_s": float(np.median(times)),
            "min_s": float(np.min(times)), "repeats": repeats}


def time_device_loop(fn: Callable, *args, iters: int = 20, repeats: int = 5,
                     flush_bytes: int = 0, profile: bool = False,
                     host_loop: bool | None = None, what: str = "a timed call",
                     fix: str = "smaller shapes") -> dict:
    """``{"compile_s", "median_s", "min_s", "flush_s", "noise_s", "iters", "output"}``:
    seconds per call of ``fn(*args)`` and the output of the loop's last call (to be checked
    against an oracle: :mod:`moejax.bench.oracles`),
    timed as ``iters`` calls in one jitted ``fori_loop`` (median and minimum over ``repeats``
    runs of the loop, after a warm-up run). Each iteration passes the arguments through an
    optimisation barrier with the loop index, so XLA cannot hoist the loop-invariant call, and
    the loop carries the result, so it cannot be removed. Per call this counts the device
    work and its kernel launches, not Python dispatch. Arguments that fit the L2 cache stay
    there across iterations unless ``flush_bytes`` > 0: then every iteration also rewrites a
    buffer of that size (a few times the L2, so each call reads its operands from memory, as
    a layer among many layers does), and the median time of a loop of the rewrites alone
    (``flush_s``) is subtracted: where the call is shorter than the rewrite's noise (a CPU),
    the difference can come out near zero or below it. ``noise_s``: half the spread of the
    call loop's per-call times over the repeats plus half the flush loop's, the uncertainty of
    ``median_s`` (a call shorter than it is not resolved).

    ``profile``: one more run of each loop under the profiler
    (:func:`moejax.bench.profile.trace_kernels`) adds ``kernels_per_call`` and ``kernel_s``
    (the call's kernels, copies and memsets per call and their summed device time, the
    rewrites' subtracted: the time without the gaps between launches) and ``kernels`` (seconds
    per call by kernel name, largest first, less the rewrite loop's kernels of the same name);
    each None where the trace has no device events (a CPU).

    ``host_loop`` (default: on a CPU) times the ``iters`` calls as separate blocking calls
    from the host instead, the rewrite between them untimed (``flush_s`` 0): XLA's CPU
    compiler expands the optimisation barriers before it moves loop-invariant code, so in
    the device loop a call whose output is smaller than its inputs (a reduction, a product
    with a few rows) runs once per loop, not once per iteration. On a CPU the host is the
    device, so a call's wall time is its device time plus its dispatch.

    The timed program (the loop, or the call) is compiled and its memory checked against the
    device's before it first runs (:class:`~moejax.train.budget.MemoryBudgetError` naming
    ``what`` is timed and the ``fix``: what shrinks it)."""
    if iters < 1 or repeats < 1 or flush_bytes < 0:
        raise ValueError(f"iters={iters} and repeats={repeats} must be >= 1 and "
                         f"flush_bytes={flush_bytes} >= 0")
    if _on_host() if host_loop is None else host_loop:
        return _host_loop(fn, args, iters, repeats, flush_bytes, profile, what, fix)
    out0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
    scratch = jnp.zeros((max(1, flush_bytes // 4),), jnp.float32)

    def device_loop(call):
        @jax.jit
        def loop(scratch, *args):
            def body(i, carry):
                out, scratch = carry
                if flush_bytes:  # after the previous call, before this one: never beside them
                    scratch = jax.lax.optimization_barrier((scratch, out))[0] + 1.0
                a = jax.lax.optimization_barrier((args, i, scratch))[0]
                return (call(*a) if call else out), scratch
            return jax.lax.fori_loop(0, iters, body, (out0, scratch))
        return loop

    def timed(loop, check: bool = False):
        t0 = time.perf_counter()
        if check:  # compiled once here, reused by the first call
            lowered_fitting(loop.lower(scratch, *args), what=what, fix=fix)
        first = jax.block_until_ready(loop(scratch, *args))[0]
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(loop(scratch, *args))
            times.append((time.perf_counter() - t) / iters)
        return compile_s, np.asarray(times), first

    loops = {"call": device_loop(fn), "flush": device_loop(None) if flush_bytes else None}
    compile_s, times, output = timed(loops["call"], check=True)
    flush_times = timed(loops["flush"])[1] if flush_bytes else np.zeros(1)
    flush_s = float(np.median(flush_times))
    result = {"compile_s": compile_s, "median_s": float(np.median(times)) - flush_s,
              "min_s": float(np.min(times)) - flush_s, "flush_s": flush_s,
              "noise_s": _half_range(times) + _half_range(flush_times), "iters": iters,
              "output": output}
    if profile:
        result.update(_profiled(loops, scratch, args, iters))
    return result


def _on_host() -> bool:
    """Whether :func:`time_device_loop` times from the host by default here (a CPU)."""
    return jax.default_backend() == "cpu"


def how_timed(iters: int, repeats: int, flushed: bool = False) -> str:
    """What :func:`time_device_loop` measures on this backend, for a table's title."""
    if _on_host():
        return (f"wall time per blocking call (median of {repeats} runs of {iters} calls"
                f"{', L2 flushed before each' if flushed else ''})")
    return (f"device time per call (median of {repeats} loops of {iters}"
            f"{', L2 flushed between calls' if flushed else ''})")


def _host_loop(fn: Callable, args: tuple, iters: int, repeats: int, flush_bytes: int,
               profile: bool, what: str, fix: str) -> dict:
    """:func:`time_device_loop`'s keys from ``iters`` blocking calls per repeat, timed one
    by one from the host (the L2 rewrite, where asked, before each call and untimed)."""
    call = jax.jit(fn)
    rewrite = jax.jit(lambda s: s + 1.0)
    scratch = jnp.zeros((max(1, flush_bytes // 4),), jnp.float32)
    t0 = time.perf_counter()
    lowered_fitting(call.lower(*args), what=what, fix=fix)  # reused by the first call
    output = jax.block_until_ready(call(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(iters):
            if flush_bytes:
                scratch = jax.block_until_ready(rewrite(scratch))
            t = time.perf_counter()
            output = jax.block_until_ready(call(*args))
            total += time.perf_counter() - t
        times.append(total / iters)
    result = {"compile_s": compile_s, "median_s": float(np.median(times)),
              "min_s": float(np.min(times)), "flush_s": 0.0, "noise_s": _half_range(times),
              "iters": iters, "output": output}
    if profile:  # a host's trace has no device kernels
        result.update(kernels_per_call=None, kernel_s=None, kernels=None)
    return result


def _half_range(times) -> float:
    """Half the spread of a loop's per-call times over its repeats."""
    return float(np.max(times) - np.min(times)) / 2


def _profiled(loops: dict, scratch, args, iters: int) -> dict:
    """:func:`time_device_loop`'s profile keys from one traced run of each (compiled) loop."""
    traces = {name: trace_kernels(lambda loop=loop: loop(scratch, *args))
              for name, loop in loops.items() if loop is not None}
    call, flush = traces["call"], traces.get("flush")
    if call is None or ("flush" in traces and flush is None):
        return {"kernels_per_call": None, "kernel_s": None, "kernels": None}
    launches, busy, by_name = call.launches, call.busy_s, dict(call.by_name)
    if flush is not None:
        launches, busy = launches - flush.launches, busy - flush.busy_s
        for name, s in flush.by_name.items():  # the rewrites' kernels, where named alike
            if name in by_name:
                by_name[name] -= s
    kernels = {name: s / iters for name, s in sorted(by_name.items(), key=lambda kv: -kv[1])
               if s > 0}
    return {"kernels_per_call": launches / iters, "kernel_s": busy / iters, "kernels": kernels}


def device_matmul_gflops(m: int, k: int, n: int, dtype=jnp.float32, iters: int = 20,
                         repeats: int = 5) -> float:
    """GFLOP/s of a ``[m, k] @ [k, n]`` matmul of ``dtype`` (jax's default precision) in
    device time (:func:`time_device_loop`): the rate a path timed the same way is held to."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k)).astype(dtype)
    b = jax.random.normal(kb, (k, n)).astype(dtype)
    s = time_device_loop(jnp.matmul, a, b, iters=iters, repeats=repeats)["median_s"]
    return 2.0 * m * k * n / s / 1e9


def time_interleaved(fns: dict[str, Callable], *args, warmup: int = 1,
                     repeats: int = 5) -> dict[str, dict]:
    """``{name: {"median_s", "min_s", "repeats"}}`` of each ``fn(*args)``, timed round-robin:
    every fn is warmed up first, then repeat ``r`` times each fn once. Ops compared as ratios
    then see the same process state (heap size, page cache, clocks); timed one after another,
    the first one measured could run on memory the others had to fault in (seen: a jitted
    ``x * 2`` at 0.044 s and DARE at 0.064 s in sequence; 0.040 and 0.041 s interleaved)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for fn in fns.values():
        for _ in range(1 + warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    return {name: {"median_s": float(np.median(t)), "min_s": float(np.min(t)),
                   "repeats": repeats} for name, t in times.items()}


def union_activations(key: jax.Array, n: int, n_experts: int, union_size: int,
                      density: float = 1.0) -> jax.Array:
    """float32 ``[n, n_experts]``, positive exactly on (token, expert) pairs of the union
    pattern described in the module docstring, zero elsewhere."""
    if not 0 <= union_size <= n_experts or not 0 < density <= 1 or n < 1:
        raise ValueError(f"need 0 <= union_size={union_size} <= n_experts={n_experts}, "
                         f"0 < density={density} <= 1 and n={n} >= 1")
    k_set, k_on, k_val = jax.random.split(key, 3)
    members = jax.random.permutation(k_set, n_experts)[:union_size]
    in_union_E = jnp.zeros(n_experts, bool).at[members].set(True)
    on_nE = jax.random.uniform(k_on, (n, n_experts)) < density
    owner_E = jnp.zeros(n_experts, jnp.int32).at[members].set(
        jnp.arange(union_size, dtype=jnp.int32) % n)  # each member's guaranteed token
    on_nE = on_nE | (jnp.arange(n)[:, None] == owner_E[None, :])
    values = jax.random.uniform(k_val, (n, n_experts), minval=0.1, maxval=1.0)
    return jnp.where(on_nE & in_union_E[None, :], values, 0.0).astype(jnp.float32)
