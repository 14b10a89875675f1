"""The grouped-matmul benchmark (experiments.benchmarks.grouped) on tiny settings: it times
each pass and names the fastest, trains on each kernel of its own where it runs, checks a
train row's gradients against the pass oracles, flags a wrong kernel and a time lost in the
cache flush, and keeps its other rows when one kernel fails."""

import jax
import jax.numpy as jnp
import pytest

from experiments.benchmarks import grouped as bench_grouped
from moejax.bench.oracles import grouped_pass_sample
from moejax.config import ConfigError
from moejax.harness.experiment import run_experiment


def test_bench_grouped_times_each_pass_and_names_the_fastest(tmp_path):
    summary, run = run_experiment(
        "bench_grouped", bench_grouped.make_config, bench_grouped.run,
        ["shapes=((64,16,32,4),)", "iters=2", "repeats=1"], out=tmp_path / "bg")
    import csv

    rows = list(csv.DictReader(open(run.path / "passes.csv")))
    timed = {(r["path"], r["pass"]) for r in rows if r["ms"]}
    assert {("dense", p) for p in ("fwd", "dlhs", "drhs")} <= timed
    assert {("train", "fwd+dlhs+drhs"), ("train[dense]", "fwd+dlhs+drhs")} <= timed
    (train,) = [r for r in rows if r["path"] == "train"]  # against the three dense products
    (step,) = [r for r in rows if r["path"] == "train[dense]"]  # and the dense train step
    three = sum(float(r["ms"]) for r in rows if r["path"] == "dense")
    assert float(train["x_dense"]) == pytest.approx(float(train["ms"]) / three)
    assert float(train["x_dense_step"]) == pytest.approx(float(train["ms"]) / float(step["ms"]))
    assert float(step["x_dense_step"]) == 1.0
    for r in rows:
        if r["path"] == "dense" and r["ms"]:
            assert float(r["x_dense"]) == 1.0
        if jax.default_backend() == "cpu" and r["path"] in bench_grouped.ACCELERATOR_PATHS:
            assert r["note"].startswith("not measured") and not r["ms"]
    choice = list(csv.DictReader(open(run.path / "choice.csv")))
    assert [c["pass"] for c in choice] == ["fwd", "dlhs", "drhs"]
    for c in choice:  # the fastest is the minimum over the timed grouped rows of that pass
        got = [float(r["ms"]) for r in rows if r["pass"] == c["pass"] and r["ms"]
               and r["path"] not in ("dense", "train")]
        assert float(c["fastest_ms"]) == pytest.approx(min(got))
    with pytest.raises(ConfigError, match="shapes"):
        run_experiment("bench_grouped", bench_grouped.make_config, bench_grouped.run,
                       ["shapes=((64,0,32,4),)"], out=tmp_path / "bad")


def test_bench_grouped_trains_on_each_own_kernel_where_it_runs(monkeypatch):
    cfg = bench_grouped.BenchGroupedConfig()
    # this CPU: no own kernel runs; the dense step is the train rows' reference
    assert bench_grouped._train_paths(cfg) == ("train[dense]", "train")
    monkeypatch.setattr(bench_grouped, "_unavailable", lambda path: None)
    assert bench_grouped._train_paths(cfg) == ("train[dense]", "train", "train[gmm]",
                                               "train[gmm_mgpu]")
    assert bench_grouped._train_paths(cfg.replace(paths=("xla", "gmm"))) == ("train",
                                                                             "train[gmm]")


def test_bench_grouped_keeps_the_other_rows_when_a_kernel_fails(monkeypatch):
    """A kernel path that fails to compile or run is a row saying so; the dense product's
    failure still fails the run."""
    def broken(*args, **kw):
        raise RuntimeError("Mosaic GPU: failed to compile\nmore")

    monkeypatch.setattr(bench_grouped, "time_device_loop", broken)
    cfg = bench_grouped.BenchGroupedConfig()
    assert bench_grouped._time(None, cfg=cfg, flops=1.0, path="gmm_mgpu") == (
        None, "failed: RuntimeError: Mosaic GPU: failed to compile")
    with pytest.raises(RuntimeError, match="failed to compile"):
        bench_grouped._time(None, cfg=cfg, flops=1.0, path="dense")


def test_bench_grouped_flags_a_wrong_used_kernel_and_a_time_lost_in_the_flush(monkeypatch):
    """A call whose time comes out inside the timing's noise once the L2 flush loop's is
    subtracted, or at a rate above the device's peak, is a row saying so, not a time; a time
    clear of both is kept; the choice table marks the implementation ragged_dot uses as WRONG
    where its output failed the oracle."""
    def timed(median_s, noise_s=1e-6):
        monkeypatch.setattr(bench_grouped, "time_device_loop", lambda *a, **kw: {
            "median_s": median_s, "flush_s": 2e-4, "noise_s": noise_s, "output": None})

    cfg = bench_grouped.BenchGroupedConfig()
    x = jnp.ones((4, 4), jnp.bfloat16)
    timed(-1.5e-5)
    assert bench_grouped._time(None, x, cfg=cfg, flops=1.0, path="gmm") == (
        None, "unresolved: -0.0150 ms (± 0.0010 ms) once the L2 flush's 0.2000 ms is "
        "subtracted: inside the timing's noise")
    timed(4e-6, noise_s=5e-6)  # positive, but less than its uncertainty
    assert bench_grouped._time(None, x, cfg=cfg, flops=1.0, path="gmm")[0] is None
    monkeypatch.setattr(bench_grouped.jax, "devices", lambda: [type(
        "D", (), {"device_kind": "NVIDIA H200"})()])
    timed(1.1e-6)  # 1.48 GFLOP in 1.1 us: 1345 TFLOP/s, above an H200's 989
    s, note = bench_grouped._time(None, x, cfg=cfg, flops=1.48e9, path="mosaic_gpu")
    assert s is None and note.endswith("1345 TFLOP/s, above the device's 989"), note
    timed(1.8e-5)  # 82 TFLOP/s: a time
    assert bench_grouped._time(None, x, cfg=cfg, flops=1.48e9, path="gmm") == (1.8e-5, "")
    monkeypatch.setattr(bench_grouped, "target_device", lambda: ("cuda", None))
    shape = {"M": 4096, "K": 256, "N": 704, "G": 8}  # under OWN_FROM_FLOPS: tokamax's fwd
    (fwd,) = bench_grouped.choice([
        {**shape, "path": "gmm", "pass": "fwd", "ms": 1.0},
        {**shape, "path": "mosaic_gpu", "pass": "fwd", "ms": None,
         "note": "wrong: error 0.129 of the oracle's largest value (allowed 0.0156)"}])
    assert (fwd["used"], fwd["used_ms"], fwd["fastest"]) == ("mosaic_gpu WRONG", None, "gmm")


def test_bench_grouped_checks_a_train_rows_gradients_against_the_pass_oracles(monkeypatch):
    """A train row's dX and dW are checked against the dX and dW products' oracles: right
    gradients keep their time, a wrong dW loses it."""
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (24, 8)), jax.random.normal(kw, (3, 8, 5))
    dy, gs = jax.random.normal(kd, (24, 5)), jnp.asarray([10, 0, 14], jnp.int32)
    row_w = w[jnp.repeat(jnp.arange(3), gs, total_repeat_length=24)]
    dx = jnp.einsum("mn,mkn->mk", dy, row_w)
    dw = jnp.stack([x[a:b].T @ dy[a:b] for a, b in ((0, 10), (10, 10), (10, 24))])
    checks = [(lambda out, i=i: out[1][i], grouped_pass_sample(
        which, *operands, gs, jax.random.key(i + 1)))
        for i, (which, operands) in enumerate((("dlhs", (dy, w)), ("drhs", (x, dy))))]
    cfg = bench_grouped.BenchGroupedConfig()
    for grads, want in (((dx, dw), ""), ((dx, dw.at[2].multiply(1.5)), "wrong")):
        monkeypatch.setattr(bench_grouped, "time_device_loop", lambda *a, g=grads, **k: {
            "median_s": 1e-3, "flush_s": 0.0, "noise_s": 0.0, "output": (0.0, g)})
        s, note = bench_grouped._time(None, x, cfg=cfg, flops=1.0, path="gmm",
                                      oracles=checks)
        assert note.startswith(want) and (s is None) == bool(want), note


def test_bench_grouped_names_the_own_kernel_where_tokamax_declines_the_call(monkeypatch):
    """float32 on a GPU: Mosaic GPU declines, ragged_pass runs the own gmm, and the choice
    table judges that kernel, not an empty row."""
    monkeypatch.setattr(bench_grouped, "target_device", lambda: ("cuda", None))
    shape = {"M": 64, "K": 16, "N": 32, "G": 4}
    rows = [{**shape, "path": "xla", "pass": "fwd", "ms": 2.0},
            {**shape, "path": "gmm", "pass": "fwd", "ms": 1.0},
            {**shape, "path": "mosaic_gpu", "pass": "fwd", "ms": None,
             "note": "not taken: NotImplementedError: Only bfloat16/float16 inputs"},
            {**shape, "path": "xla", "pass": "dlhs", "ms": 1.0},
            {**shape, "path": "gmm", "pass": "dlhs", "ms": 3.0},
            {**shape, "path": "mosaic_gpu", "pass": "dlhs", "ms": 0.5}]
    fwd, dlhs = bench_grouped.choice(rows)
    assert (fwd["used"], fwd["used_ms"], fwd["used_x_fastest"]) == (
        "gmm (mosaic_gpu declines)", 1.0, 1.0)
    assert (dlhs["used"], dlhs["used_ms"], dlhs["fastest"]) == ("mosaic_gpu", 0.5, "mosaic_gpu")
    big = {"M": 65536, "K": 2048, "N": 1408, "G": 64}  # past OWN_FROM_FLOPS: the own kernel
    (fwd,) = bench_grouped.choice([{**big, "path": "gmm", "pass": "fwd", "ms": 0.75},
                                   {**big, "path": "gmm_mgpu", "pass": "fwd", "ms": 0.7},
                                   {**big, "path": "mosaic_gpu", "pass": "fwd", "ms": 1.2}])
    assert (fwd["used"], fwd["used_ms"], fwd["fastest"]) == ("gmm_mgpu", 0.7, "gmm_mgpu")
