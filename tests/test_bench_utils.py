"""moejax.bench.timing, .profile and .cost: the synthetic union patterns have exactly the asked
union, the timers time what they are given (the device loop calls the function in every
iteration, not once), the profiler's device time counts each kernel once and is None where the
trace sees no device, and a union path's time on a line gives back its fixed and per-member
parts."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.profiler import ProfileData

import moejax.train.budget as budget
from moejax.bench import timing
from moejax.bench.cost import fixed_plus_per_member, smallest_union_within, union_cost
from moejax.bench.oracles import grouped_pass_sample
from moejax.bench.profile import (
    KernelTrace,
    device_kernels,
    fused_ops,
    kernel_kind,
    kernel_kind_rows,
    trace_kernels,
)
from moejax.bench.timing import time_call, time_device_loop, time_interleaved, union_activations
from moejax.kernels.tuning import WrongResult, check_close


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
    flushed = time_device_loop(chain(16), x, iters=5, repeats=3, flush_bytes=1 << 20,
                               host_loop=False)
    assert flushed["flush_s"] > 0 and np.isfinite(flushed["median_s"])
    hosted = time_device_loop(chain(16), x, iters=5, repeats=3, flush_bytes=1 << 20,
                              host_loop=True)  # a CPU's default
    assert hosted["flush_s"] == 0 and hosted["min_s"] > 3 * one["min_s"]
    with pytest.raises(ValueError, match="flush_bytes"):
        time_device_loop(chain(1), x, flush_bytes=-1)



@pytest.mark.parametrize("host_loop", [False, True])
def test_time_device_loop_checks_the_timed_program_against_memory_first(host_loop,
                                                                          monkeypatch):
    """The timed program is compiled and XLA's estimate compared with the device's memory
    before it runs: with the host made 10 kB, MemoryBudgetError naming what is timed and the
    fix, and the call never runs."""
    ran = []
    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**4, "this host's memory"))
    x = jnp.ones((128, 128))
    with pytest.raises(budget.MemoryBudgetError,
                       match="the big product needs about .* Fix: fewer rows"):
        time_device_loop(lambda a: jax.debug.callback(lambda: ran.append(1)) or a @ a, x,
                         iters=2, repeats=1, host_loop=host_loop, what="the big product",
                         fix="fewer rows")
    assert ran == []


def test_a_call_with_a_small_output_is_timed_once_per_iteration():
    """A reduction of a large array (a small output from a large input: what XLA's CPU
    compiler hoists out of a loop once the optimisation barriers are expanded) runs in every
    iteration, on this backend's default (``make gpu-check``'s tests stage runs it on the
    GPU's device loop): a loop of 32 calls takes well over twice as long as one of 4 (8x,
    less the loop's fixed cost), where a hoisted call would take the two loops about as
    long (each call 8x cheaper in the longer loop)."""
    buf = jnp.ones((16 * 2**20 // 4,), jnp.float32)

    def total(b):
        return jnp.sum(jnp.sin(b))

    few = time_device_loop(total, buf, iters=4, repeats=3)
    many = time_device_loop(total, buf, iters=32, repeats=3)
    assert 32 * many["min_s"] > 2 * 4 * few["min_s"], (few, many)


def test_time_device_loop_subtracts_the_flush_and_reports_its_noise(monkeypatch):
    """On a scripted clock: per call, the call loop's median less the flush loop's, and the
    noise is half of each loop's spread over the repeats, added."""
    call_s, flush_s = (0.30, 0.34, 0.31), (0.20, 0.26, 0.22)  # per loop of 10 calls
    ticks = []
    for loop in (call_s, flush_s):
        start = len(ticks) * 100.0
        ticks += [start, start + 1.0]  # the first (compiling) run
        for i, d in enumerate(loop):
            ticks += [start + 10.0 * (i + 1), start + 10.0 * (i + 1) + d]
    clock = iter(ticks)
    monkeypatch.setattr("moejax.bench.timing.time.perf_counter", lambda: next(clock))
    out = time_device_loop(lambda x: x + 1, jnp.ones(4), iters=10, repeats=3, flush_bytes=64,
                           host_loop=False)
    assert out["median_s"] == pytest.approx((0.31 - 0.22) / 10)
    assert out["flush_s"] == pytest.approx(0.022)
    assert out["noise_s"] == pytest.approx((0.04 / 2 + 0.06 / 2) / 10)
    assert out["min_s"] == pytest.approx((0.30 - 0.22) / 10)

def _xspace(device_plane: str, lines: dict[str, list[tuple[str, int]]]) -> ProfileData:
    """A profile with one device plane: ``lines`` {line name: [(event name, duration ns)]}."""
    names = sorted({name for events in lines.values() for name, _ in events})
    ids = {name: i + 1 for i, name in enumerate(names)}
    text = "".join(
        f'lines {{ id: {j} name: "{line}" ' + "".join(
            f"events {{ metadata_id: {ids[name]} offset_ps: {k * 10**7} "
            f"duration_ps: {ns * 1000} }} " for k, (name, ns) in enumerate(events)) + "} "
        for j, (line, events) in enumerate(lines.items()))
    meta = "".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }} '
                   for n, i in ids.items())
    host = 'planes { id: 2 name: "/host:CPU" lines { id: 1 name: "python" ' \
           'events { metadata_id: 1 offset_ps: 0 duration_ps: 99000000 } } ' \
           'event_metadata { key: 1 value { id: 1 name: "host_work" } } }'
    xspace = f'planes {{ id: 1 name: "{device_plane}" {text}{meta}}} {host}'
    return ProfileData.from_serialized_xspace(ProfileData.text_proto_to_serialized_xspace(xspace))


def test_device_kernels_reads_a_gpus_streams_and_a_tpus_ops_once():
    """GPU: the stream lines' kernels, not the summary lines that repeat their time; TPU:
    the XLA Ops line; the host plane is never device time."""
    gpu = _xspace("/device:GPU:0", {
        "Stream #7(Compute)": [("fusion_2", 3000), ("mosaic_kernel", 9000), ("fusion_2", 1000)],
        "Stream #9(MemcpyD2D)": [("memset", 500)],
        "XLA Ops": [("fusion.2", 4000), ("custom-call", 9000)],
        "XLA Modules": [("jit_loop", 20000)]})
    got = device_kernels(gpu)
    assert got.launches == 4 and got.busy_s == pytest.approx(13.5e-6)
    assert list(got.by_name) == ["mosaic_kernel", "fusion_2", "memset"]
    assert got.by_name["fusion_2"] == pytest.approx(4e-6)
    assert got.counts == {"fusion_2": 2, "mosaic_kernel": 1, "memset": 1}
    tpu = device_kernels(_xspace("/device:TPU:0", {"XLA Ops": [("fusion.1", 2000)],
                                                   "XLA Modules": [("jit_f", 5000)]}))
    assert tpu == KernelTrace(1, pytest.approx(2e-6), {"fusion.1": pytest.approx(2e-6)},
                              {"fusion.1": 1})
    assert device_kernels(_xspace("/device:GPU:0", {"XLA Modules": [("jit_f", 5)]})) is None


def test_kernels_are_grouped_by_kind_without_xlas_instance_numbers():
    assert [kernel_kind(n) for n in ("input_reduce_fusion_83", "gemm_fusion_dot_general_5",
                                     "fusion.1", "loop_fusion", "sm90_xmma_gemm", "7")] == [
        "input_reduce_fusion", "gemm_fusion_dot_general", "fusion", "loop_fusion",
        "sm90_xmma_gemm", "7"]
    row = {"mode": "AR", "kernels": {"input_reduce_fusion_83": 3e-6, "gemm_2": 4e-6,
                                     "input_reduce_fusion_11": 2e-6},
           "kernel_counts": {"input_reduce_fusion_83": 1.0, "gemm_2": 2.0,
                             "input_reduce_fusion_11": 3.0}}
    got = kernel_kind_rows([row, {"mode": "no counts", "kernels": {"gemm_2": 1e-6}}],
                           ("mode",))
    assert [(r["kind"], r["kernels"]) for r in got] == [("input_reduce_fusion", 4.0),
                                                        ("gemm", 2.0)]
    assert got[0]["ms"] == pytest.approx(5e-3) and got[0]["share"] == pytest.approx(5 / 9)
    assert got[1]["mode"] == "AR" and "kernels" in row  # the row is left as it was


# a GPU program's shape: fusions inside a while loop's body, a Triton fusion with its own
# nested computation, a custom call that is no fusion
_GPU_PROGRAM = """HloModule jit_draw, is_scheduled=true

%region_0.4 (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a.1, %b.1)
}

%fused_reduce.26 (param_0.3: bf16[1,256], param_1.7: bf16[256,1024]) -> f32[1,1024] {
  %param_0.3 = bf16[1,256]{1,0} parameter(0)
  %convert.5 = f32[1,256]{1,0} convert(%param_0.3)
  %param_1.7 = bf16[256,1024]{1,0} parameter(1)
  %convert.6 = f32[256,1024]{1,0} convert(%param_1.7)
  %multiply.2 = f32[256,1024]{1,0} multiply(%convert.6, %convert.6)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.3 = f32[1,1024]{1,0} reduce(%multiply.2, %constant.1), dimensions={0}, \
to_apply=%region_0.4
}

%gemm_dot (p0: bf16[8,256], p1: bf16[256,512]) -> bf16[8,512] {
  %p0 = bf16[8,256]{1,0} parameter(0)
  %p1 = bf16[256,512]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,512]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body.2 (state: (s32[], bf16[1,256])) -> (s32[], bf16[1,256]) {
  %state = (s32[], bf16[1,256]{1,0}) parameter(0)
  %input_reduce_fusion.26 = f32[1,1024]{1,0} fusion(%x, %w), kind=kInput, calls=%fused_reduce.26
  %gemm_fusion_dot.3 = bf16[8,512]{1,0} fusion(%y, %v), kind=kCustom, calls=%gemm_dot, \
backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %pallas_flash_attention_ = bf16[1,1,8,32]{3,2,1,0} custom-call(%q, %k), \
custom_call_target="__gpu$xla.gpu.triton"
  ROOT %t = (s32[], bf16[1,256]{1,0}) tuple(%i, %h)
}
"""


def test_a_programs_fusions_read_as_the_work_they_fuse():
    """Each fusion of a compiled program, by its name and by the name a GPU profile gives its
    kernel: its fused instructions by count and its result type; a custom call is no fusion."""
    got = fused_ops(_GPU_PROGRAM)
    assert got["input_reduce_fusion_26"] == got["input_reduce_fusion.26"] == (
        "convert x2, multiply, reduce -> f32[1,1024]")
    assert got["gemm_fusion_dot_3"] == "dot -> bf16[8,512]"
    assert "pallas_flash_attention_" not in got and "region_0.4" not in got
    # a program XLA compiled here: its three fusions, each what the function does there
    f = jax.jit(lambda x, w: jnp.tanh((x * 2).astype(jnp.bfloat16) @ w).sum())
    text = f.lower(jnp.ones((4, 8)), jnp.ones((8, 16), jnp.bfloat16)).compile().as_text()
    got = fused_ops(text)
    names = re.findall(r"%(\S+) = \S+ fusion\(", text)
    assert names and {got[n] for n in names} >= {"broadcast, convert, multiply -> bf16[4,8]"}
    assert all(got[n].endswith(("-> bf16[4,8]", "-> bf16[4,16]", "-> bf16[]")) for n in names)


def test_a_cpu_trace_has_no_device_kernels():
    f = jax.jit(lambda a: jnp.tanh(a @ a))
    a = jnp.ones((64, 64))
    f(a).block_until_ready()
    if jax.default_backend() == "cpu":
        assert trace_kernels(lambda: f(a)) is None
        r = time_device_loop(f, a, iters=2, repeats=1, flush_bytes=4096, profile=True)
        assert r["kernel_s"] is None and r["kernels_per_call"] is None and r["median_s"] > -1


def test_the_profiled_device_loop_subtracts_the_rewrites(monkeypatch):
    """kernel_s and kernels_per_call are the call loop's less the rewrite loop's, per call."""
    traces = iter([KernelTrace(30, 9e-6, {"kernel": 6e-6, "rewrite": 3e-6}),
                   KernelTrace(10, 3e-6, {"rewrite": 3e-6})])
    monkeypatch.setattr(timing, "trace_kernels", lambda run: next(traces))
    r = time_device_loop(lambda a: a * 2, jnp.ones(8), iters=10, repeats=1,
                         flush_bytes=4096, profile=True, host_loop=False)
    assert r["kernels_per_call"] == pytest.approx(2.0)
    assert r["kernel_s"] == pytest.approx(6e-7)
    assert r["kernels"] == {"kernel": pytest.approx(6e-7)}  # the rewrite's own kernel: out


def _grouped_case(sizes, M=40, K=24, N=20, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (M, K))
    w = jax.random.normal(k[1], (len(sizes), K, N))
    dy = jax.random.normal(k[2], (M, N))
    return x, w, dy, jnp.asarray(sizes, jnp.int32)


def _grouped_numpy(which, a, b, sizes):
    """The three products with one numpy loop over the groups (rows past them: zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ends = np.cumsum(sizes)
    out = (np.zeros((len(sizes), a.shape[1], b.shape[1])) if which == "drhs" else
           np.zeros((a.shape[0], b.shape[2] if which == "fwd" else b.shape[1])))
    for g, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        if which == "fwd":
            out[lo:hi] = a[lo:hi] @ b[g]
        elif which == "dlhs":
            out[lo:hi] = a[lo:hi] @ b[g].T
        else:
            out[g] = a[lo:hi].T @ b[lo:hi]
    return out


@pytest.mark.parametrize("sizes,moved", [((10, 0, 25, 5), (11, 0, 24, 5)),
                                         ((40, 0, 0, 0), (39, 0, 0, 0)),
                                         ((3, 7, 11, 9), (3, 8, 10, 9))])
@pytest.mark.parametrize("which", ["fwd", "dlhs", "drhs"])
def test_the_sampled_grouped_oracle_is_the_per_group_product(which, sizes, moved):
    """Its entries are numpy's per-group products (empty groups, rows past the groups), and
    an output with one row on the wrong side of a group boundary fails the check."""
    x, w, dy, gs = _grouped_case(sizes)
    a, b = {"fwd": (x, w), "dlhs": (dy, w), "drhs": (x, dy)}[which]
    full = jnp.asarray(_grouped_numpy(which, a, b, np.asarray(sizes)), jnp.float32)
    take, want = grouped_pass_sample(which, a, b, gs, jax.random.key(1), samples=16)
    np.testing.assert_allclose(np.asarray(take(full)), want, rtol=1e-5, atol=1e-4)
    check_close(take(full), want, jnp.float32)
    wrong = jnp.asarray(_grouped_numpy(which, a, b, np.asarray(moved)), jnp.float32)
    take, want = grouped_pass_sample(which, a, b, gs, jax.random.key(1), samples=400)
    with pytest.raises(WrongResult):  # 400 samples: the moved row is among them
        check_close(take(wrong), want, jnp.float32)


def test_a_failing_profiler_costs_the_trace_not_the_measurement(monkeypatch, capsys):
    """The profiler refusing to start: None and one line saying so, and the call still runs;
    the call's own error is raised, with the trace stopped (a later trace starts)."""
    calls = []

    def refuse(d):
        raise RuntimeError("a trace is already running")

    with monkeypatch.context() as m:
        m.setattr(jax.profiler, "start_trace", refuse)
        assert trace_kernels(lambda: calls.append(1) or jnp.ones(2)) is None
    assert calls == [1]
    assert "starting a trace failed (RuntimeError: a trace is already running)" in \
        capsys.readouterr().err

    def broken():
        raise ValueError("the call itself")

    with pytest.raises(ValueError, match="the call itself"):
        trace_kernels(broken)
    trace_kernels(lambda: jnp.ones(2))  # the failed call's trace was stopped


@pytest.mark.parametrize("which", ["fwd", "dlhs"])
def test_the_sampled_oracle_checks_every_group(which):
    """One sample beyond the per-group rows: a wrong 5-row group is still caught, and groups
    with no rows at all check the shape only."""
    x, w, dy, gs = _grouped_case((10, 0, 25, 5))
    a = x if which == "fwd" else dy
    full = _grouped_numpy(which, a, w, np.asarray((10, 0, 25, 5)))
    wrong = full.copy()
    wrong[35:40] += 1.0  # only the last group's rows
    take, want = grouped_pass_sample(which, a, w, gs, jax.random.key(2), samples=1)
    check_close(take(jnp.asarray(full, jnp.float32)), want, jnp.float32)
    with pytest.raises(WrongResult):
        check_close(take(jnp.asarray(wrong, jnp.float32)), want, jnp.float32)
    take, want = grouped_pass_sample(which, a, w, jnp.zeros(4, jnp.int32), jax.random.key(2))
    assert check_close(take(jnp.asarray(full, jnp.float32)), want, jnp.float32) == 0.0


@pytest.mark.parametrize("fixed,per", [(5.0, 0.7), (0.0, 0.5), (12.5, 1.1)])
def test_a_union_paths_line_is_recovered_from_its_times(fixed, per):
    """Times on an exact line give back its fixed part and per-member cost (noise-free), and
    the union size from which it is within a limit of the floor is where the line says."""
    unions = [16, 32, 48, 64]
    got_fixed, got_per = fixed_plus_per_member(unions, [fixed + per * u for u in unions])
    assert got_fixed == pytest.approx(fixed, abs=1e-9) and got_per == pytest.approx(per)
    floor, limit = 0.5, 1.5
    reach = smallest_union_within(fixed, per, floor, limit)
    if per >= limit * floor:
        assert reach is None
    else:
        assert fixed + per * reach == pytest.approx(limit * floor * reach)
        assert all((fixed + per * u <= limit * floor * u) == (u >= reach) for u in range(1, 200))
    with pytest.raises(ValueError, match="two or more distinct union sizes"):
        fixed_plus_per_member([16, 16], [1.0, 2.0])


def test_bench_kernels_sets_each_union_paths_time_as_a_line():
    """union_cost fits the call's and the kernels' times per path and chunk size; a path with
    one union size measured has no line."""
    rows = []
    for u in (16, 32, 64):
        for path, fixed, per in (("decode", 4.0, 0.6), ("pallas", 30.0, 1.8)):
            t_ms = (fixed + per * u) / 1e3
            floor_ms = 0.5 * u / 1e3
            rows.append({"n": 1, "union": u, "union_fraction": u / 64, "path": path,
                         "ms": t_ms, "floor_ms": floor_ms, "gbps": 2e6 * u / t_ms / 1e9 * 1e3,
                         **({"kernel_ms": t_ms - 1e-3} if path == "decode" else {})})
    rows.append({"n": 8, "union": 16, "union_fraction": 0.25, "path": "decode", "ms": 0.02,
                 "floor_ms": 0.008, "gbps": 1.0})
    got = {(c["path"], c["n"], c["time"]): c for c in union_cost(rows)}
    assert set(got) == {("decode", 1, "call"), ("decode", 1, "kernels"), ("pallas", 1, "call")}
    call = got[("decode", 1, "call")]
    assert call["fixed_us"] == pytest.approx(4.0) and call["per_member_us"] == pytest.approx(0.6)
    assert got[("decode", 1, "kernels")]["fixed_us"] == pytest.approx(3.0)
    assert call["member_gbps"] == pytest.approx(2e6 / 0.6e-6 / 1e9)  # 2 MB a member
    # 4 us / (1.5 x 0.5 - 0.6) us a member: from 27 members; pallas's 1.8 us a member alone is
    # beyond 1.5 x 0.5
    assert call["within_1.5x_from_union"] == 27
    assert got[("pallas", 1, "call")]["within_1.5x_from_union"] == "none"
