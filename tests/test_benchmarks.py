"""The benchmark modules run end to end on tiny settings: each checks its work against memory
before it runs, times the paths it names against the bounds it reports, flags a wrong kernel,
and keeps its other rows when one path fails."""

import jax
import pytest

import moejax.train.budget as budget
from experiments.benchmarks import dispatch as bench_dispatch
from experiments.benchmarks import grouped as bench_grouped
from experiments.benchmarks import parallel as bench_parallel
from experiments.benchmarks.dispatch import _ratios
from experiments.blockffn import kernels as bench_kernels
from experiments.blockffn.kernels import (
    _breakdown_note,
    _ffn_summary,
    _profile_columns,
    union_breakdown,
)
from experiments.ders import bench as bench_ders
from moejax.bench import moe_block, train_steps
from moejax.bench.moe_block import TORCH
from moejax.bench.profile import KernelTrace, fused_ops
from moejax.config import ConfigError
from moejax.harness.experiment import main, run_experiment
from tests.tiny_substrates import TINY_LM


def test_bench_dispatch_checks_its_step_against_memory_before_it_runs(tmp_path, monkeypatch,
                                                                     capsys):
    """A benchmark's own timed step is compiled and its estimate compared with the device's
    memory before its first call (here the host is made 10 kB): exit 2 in one line, no row."""
    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**4, "this host's memory"))
    called = []
    monkeypatch.setattr(bench_dispatch, "_block_table", lambda *a: called.append(1))
    code = main("bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
                TINY_LM + ["batch_size=2", "seq_len=16", "warmup=1", "steps=2",
                           "paths=(capacity,)", f"out={tmp_path / 'bench'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not called
    assert "the capacity train step needs about" in err[-1] and "lower batch_size" in err[-1]
    assert not (tmp_path / "bench" / "dispatch.csv").exists()


def test_bench_dispatch_times_the_train_step_alone_on_each_attention(tmp_path):
    """``block_paths=()`` and ``delta_tree=none`` leave the train step alone, and
    ``attentions`` times each path on each attention in the one run (the GPU's comparison of
    the flash kernel with XLA's attention): a row each, the ratio of the steps in the
    headline; a machine that cannot time any path says so in the headline instead of
    failing."""
    import csv

    tiny = TINY_LM + ["batch_size=2", "seq_len=16", "warmup=1", "steps=1", "block_paths=()",
                      "delta_tree=none", "attentions=(einsum,jax)"]
    summary, run = run_experiment("bench_dispatch", bench_dispatch.make_config,
                                  bench_dispatch.run, [*tiny, "paths=(capacity,)"],
                                  out=tmp_path / "one")
    assert sorted(p.name for p in run.path.glob("*.csv")) == ["dispatch.csv"]
    rows = list(csv.DictReader(open(run.path / "dispatch.csv")))
    assert [(r["path"], r["attention"]) for r in rows] == [("capacity", "einsum"),
                                                           ("capacity", "jax")]
    # the same model and batches on either attention: the same loss
    assert float(rows[0]["final_ce"]) == pytest.approx(float(rows[1]["final_ce"]), rel=1e-4)
    ratio = float(rows[1]["step_s_median"]) / float(rows[0]["step_s_median"])
    assert f"train step on jax / on einsum: capacity {ratio:.2f}" in (
        run.path / "summary.md").read_text()
    assert "matmul_gflops" not in summary and {"capacity_ms", "capacity_jax_ms"} <= set(summary)
    assert ", attention einsum, jax (auto: " in (run.path / "dispatch.md").read_text()
    _, run = run_experiment("bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
                            [*tiny, "paths=(gmm,)"], out=tmp_path / "none")
    if jax.default_backend() == "cpu":
        assert ("no train step timed here: gmm: not measured: needs a GPU (cpu runs Pallas in "
                "interpret mode)") in (run.path / "summary.md").read_text()


@pytest.mark.slow
def test_bench_dispatch_tiny_paths_agree(tmp_path, monkeypatch):
    # the retained-memory columns run, without changing this worker's allocator
    monkeypatch.setattr(moe_block, "retain_freed_memory", lambda: True)

    summary, run = run_experiment(
        "bench_dispatch",
        bench_dispatch.make_config,
        bench_dispatch.run,
        TINY_LM
        + ["model.moe.capacity_factor=8.0", "batch_size=2", "seq_len=16", "warmup=1", "steps=2",
           "paths=(dense,capacity,host,host_capacity,gmm)", "block_tokens=64",
           "block_d=16", "block_f=32",
           "block_repeats=1", "block_paths=(capacity,)", "delta_tree=tiny"],
        out=tmp_path / "bench",
    )
    import csv

    block = {r["impl"]: r for r in csv.DictReader(open(run.path / "block.csv"))}
    assert {"capacity cf=1.25", "capacity cf=2.0"} <= set(block)
    assert "grouped (dropless)" not in block  # block_paths selects
    bound = next(r for k, r in block.items() if k.startswith("FLOP bound"))
    assert float(bound["vs_flop_bound"]) == 1.0
    assert all(float(r["ms"]) > 0 for k, r in block.items() if r["ms"])
    assert all(float(r["ms_retained"]) > 0 for k, r in block.items() if r["ms"])
    assert float(bound["vs_flop_bound_retained"]) == 1.0
    (torch_row,) = [r for k, r in block.items() if k.startswith(TORCH)]
    assert torch_row["ms"] or torch_row["note"].startswith("not installed")
    if torch_row["ms"]:  # the peer runs where jax runs, and its row says so
        assert torch_row["impl"].endswith(", on CPU)" if jax.default_backend() == "cpu"
                                          else ")")
    delta = {r["op"]: r for r in csv.DictReader(open(run.path / "delta_ops.csv"))}
    assert float(delta["jitted x * 2 (reference)"]["vs_x2"]) == 1.0
    assert {"DARE p=0.9 (hash masks)", "numpy copy (reference)",
            "WANDA p=0.9 (threshold select)"} <= set(delta)

    rows = list(csv.DictReader(open(run.path / "dispatch.csv")))
    assert [r["path"] for r in rows] == ["dense", "capacity", "host", "host_capacity", "gmm"]
    if jax.default_backend() == "cpu":  # the kernel is not timed in interpret mode
        assert rows.pop()["note"].startswith("not measured: needs a GPU")
    ce = [float(r["final_ce"]) for r in rows]
    # Same init, same data, no drops at capacity factor 8: the four paths train identically.
    assert max(ce) - min(ce) < 1e-3
    assert all(float(r["dropped_fraction"]) == 0.0 for r in rows)


def test_bench_kernels_tiny_rows_and_bounds(tmp_path):
    summary, run = run_experiment(
        "bench_kernels", bench_kernels.make_config, bench_kernels.run,
        ["ffn.d_model=16", "ffn.n_experts=8", "ffn.d_expert=8", "chunk_sizes=(1,4)",
         "union_fractions=(0.25,1.0)", "repeats=2", "bandwidth_mb=4"],
        out=tmp_path / "bk")
    import csv

    ffn = list(csv.DictReader(open(run.path / "ffn.csv")))
    assert len(ffn) == 2 * 2 * 8  # chunk sizes x fractions x paths
    floors = []
    for r in ffn:
        if r["path"] in ("pallas", "triton", "decode") and jax.default_backend() == "cpu":
            assert r["note"].startswith("not measured") and not r["ms"]
            continue
        dense = next(d for d in ffn if d["path"] == "dense" and d["n"] == r["n"]
                     and d["union"] == r["union"])
        bound = float(dense["ms"]) * int(r["union"]) / 8
        assert float(r["bound_ms"]) == pytest.approx(bound, rel=1e-6)
        assert float(r["x_bound"]) == pytest.approx(float(r["ms"]) / bound, rel=1e-6)
        read = 2 * int(r["union"]) * 16 * 8 * 4  # the union's up and down weights, f32
        floors.append(read / float(r["floor_ms"]))  # the one measured bandwidth, per row
        assert float(r["x_floor"]) == pytest.approx(float(r["ms"]) / float(r["floor_ms"]))
    assert max(floors) == pytest.approx(min(floors), rel=1e-6)
    assert (run.path / "ffn_n1.png").exists() and (run.path / "ffn_n4.png").exists()
    assert "chunk_union: within 1.3x" in (run.path / "summary.md").read_text()
    parts = list(csv.DictReader(open(run.path / "union_breakdown.csv")))
    assert {(r["n"], r["path"]) for r in parts} == {
        (n, p) for n in ("1", "4") for p in ("chunk_union", "chunk_union_gather")}
    for p in parts:  # the two factors multiply to the distance from the bound
        assert float(p["overhead"]) * float(p["dense_scaling"]) == pytest.approx(
            float(p["x_bound"]), rel=1e-6)
    with pytest.raises(ConfigError, match="union_fractions"):
        run_experiment("bench_kernels", bench_kernels.make_config, bench_kernels.run,
                       ["union_fractions=(0.0,)"], out=tmp_path / "bad")


def test_union_breakdown_splits_the_distance_to_the_bound():
    def row(path, u, ms, bound=None):
        r = {"n": 4, "union": u, "union_fraction": u / 8, "path": path, "ms": ms}
        if bound:
            r.update(bound_ms=bound, x_bound=ms / bound)
        return r

    # bound = dense 8 ms x |U| / 8: 2 ms at |U| = 2, 4 ms at |U| = 4
    rows = [row("dense", 2, 8.0, 2.0), row("dense_union", 2, 2.4, 2.0),
            row("chunk_union", 2, 4.8, 2.0), row("dense", 4, 8.0, 4.0),
            row("dense_union", 4, 5.6, 4.0), row("chunk_union", 4, 6.16, 4.0),
            {"n": 4, "union": 4, "path": "pallas", "note": "not measured"}]
    got = {r["union_fraction"]: r for r in union_breakdown(rows)}
    assert set(got) == {0.25, 0.5}
    assert got[0.25]["overhead"] == pytest.approx(2.0)         # 4.8 / 2.4
    assert got[0.25]["dense_scaling"] == pytest.approx(1.2)    # 2.4 / 2
    assert got[0.5]["overhead"] == pytest.approx(1.1)          # 6.16 / 5.6
    assert got[0.5]["dense_scaling"] == pytest.approx(1.4)
    note = _breakdown_note(list(got.values()))
    assert "in 2 cases" in note and "1 by its own overhead" in note
    assert "n=4 |U|/E=0.25 (2.40x = 2.00 x 1.20)" in note
    # chunk_union not timed (a GPU run of the kernel paths only): no verdict on it
    others = [p for p in got.values() if p["path"] != "chunk_union"]
    assert "no breakdown" in _breakdown_note(others)


@pytest.mark.slow
def test_bench_parallel_tiny_measures_the_collectives_of_each_path(tmp_path):
    _, run = run_experiment(
        "bench_parallel", bench_parallel.make_config, bench_parallel.run,
        ["meshes=(1x8,)", "paths=(expert_parallel,)", "tokens=256", "d_model=32",
         "d_expert=32", "n_experts=8", "repeats=1"],
        out=tmp_path / "bench_parallel")
    import csv

    ep = {r["path"]: r for r in csv.DictReader(open(run.path / "layer.csv"))}["expert_parallel"]
    # the executed rung of the dropless ladder: below the every-row rung (8x on 8 devices)
    assert float(ep["vs_a2a_volume"]) <= 3.1 and float(ep["all_reduce_mb"]) == 0
    assert 0 < float(ep["collective_mb"]) < float(ep["static_hlo_mb"])
    scaling = list(csv.DictReader(open(run.path / "scaling_model.csv")))
    assert len(scaling) == 6 and all(float(r["a2a_ms"]) > 0 for r in scaling)
    with pytest.raises(Exception, match="DATAxEXPERT"):
        bench_parallel.make_config("quick").replace(meshes=("8by1",))


@pytest.mark.slow
def test_bench_ders_tiny_decodes_and_measures_training_memory(tmp_path):
    _, run = run_experiment(
        "bench_ders", bench_ders.make_config, bench_ders.run,
        ["d_model=32", "n_layers=1", "n_heads=2", "d_hidden=64", "n_experts=8", "top_k=2",
         "vocab_size=32", "n_prompts=1", "prompt_len=4", "max_new_tokens=3", "train_batch=4",
         "train_seq=8", "lm_rank=2"], out=tmp_path / "bench_ders")
    import csv

    dec = list(csv.DictReader(open(run.path / "decode.csv")))
    assert [(r["model"], r["synthesis"]) for r in dec] == [
        ("vanilla", "-"), ("DeRS-SM", "all"), ("DeRS-SM", "selected"), ("DeRS-LM", "all"),
        ("DeRS-LM", "selected")]
    mem = {(r["model"], r["synthesis"]): float(r["temp_mb"])
           for r in csv.DictReader(open(run.path / "train_memory.csv"))}
    assert set(mem) == {("vanilla", "-"), ("DeRS-SM", "all"), ("DeRS-SM", "stream"),
                        ("DeRS-LM", "all"), ("DeRS-LM", "stream")}
    copies = 8 * 3 * 32 * 64 * 4 / 1e6  # the synthesised experts "all" keeps
    for form in ("SM", "LM"):
        assert mem[(f"DeRS-{form}", "stream")] < mem[(f"DeRS-{form}", "all")] - 0.5 * copies


def test_bench_ders_names_a_row_faster_than_its_bandwidth_bound():
    """A decode row faster than the bytes it is charged allow (x_bound < 1) times something
    else than it names (e.g. expert synthesis hoisted out of the decode loop): the run says
    so; a row at or under its bound is not named."""
    rows = [{"model": "vanilla", "synthesis": "-", "tokens_per_s": 45.0,
             "bound_tokens_per_s": 150.0, "x_bound": 150.0 / 45.0},
            {"model": "DeRS-SM", "synthesis": "all", "tokens_per_s": 46.0,
             "bound_tokens_per_s": 20.9, "x_bound": 20.9 / 46.0}]
    (line,) = bench_ders.beyond_bound(rows)
    assert line.startswith("DeRS-SM all decoded faster than its bandwidth bound (46.0 "
                           "against 20.9 tokens/s)")
    assert bench_ders.beyond_bound(rows[:1]) == []


def test_bench_dispatch_headline_sets_every_dropless_step_against_the_capacity_step():
    """The default dropless path (auto) is compared with the capacity step first, then the
    others measured; a block under a millisecond keeps its digits."""
    timed = [{"path": p, "step_s_median": s} for p, s in
             (("auto", 0.03702), ("capacity", 0.03634), ("bucketed", 0.08709))]
    blk = {"grouped (dropless)": {"ms": 0.8, "vs_flop_bound": 2.66, "vs_torch": 0.069}}
    assert _ratios(timed, blk) == (
        "; dropless step / capacity step: auto 1.02, bucketed 2.40; MoE block: grouped "
        "(dropless) 0.8 ms = 2.66x the FLOP bound, 0.07x PyTorch's time")


def test_bench_kernels_judges_the_profiled_kernel_time_against_the_floor(tmp_path):
    timed = {"kernel_s": 12e-6, "kernels_per_call": 3.0,
             "kernels": {"decode_kernel": 10e-6, "fusion": 1.5e-6, "memset": 0.5e-6,
                         "slice": 0.1e-6}}
    cols = _profile_columns(timed, floor_ms=0.010)
    assert cols["kernel_ms"] == pytest.approx(0.012) and cols["kernels_per_call"] == 3.0
    assert cols["x_floor_kernel"] == pytest.approx(1.2)
    assert cols["top_kernels"] == "decode_kernel: 10.0 us; fusion: 1.5 us; memset: 0.5 us"
    rows = [{"n": 1, "union": 16, "union_fraction": 0.25, "path": "decode", "ms": 0.02,
             "x_floor": 2.0, "floor_ms": 0.01, **cols},
            {"n": 8, "union": 64, "union_fraction": 1.0, "path": "decode", "ms": 0.06,
             "x_floor": 1.6, "floor_ms": 0.04,
             **_profile_columns({**timed, "kernel_s": 70e-6}, floor_ms=0.04)}]
    headline, notes = _ffn_summary(rows)
    assert "decode: within 1.5x of the memory floor in 0/2 cases" in notes[-2]
    # only the decode kernel ran: the headline is its target, not "chunk_union: not measured"
    assert notes[0] == "chunk_union: not measured here" and headline == notes[-2]
    assert notes[-1].startswith("decode, its kernels' own device time (profiler: no launch "
                                "gaps; 3.0 kernels a call): within 1.5x of the memory floor "
                                "in 1/2 cases (nearest 1.20x at n=1, |U|/E=0.25)")
    # the pair kernels measured beside it: the headline is still the decode target
    pallas = {"n": 1, "union": 16, "union_fraction": 0.25, "path": "pallas", "ms": 0.05,
              "x_bound": 4.0, "x_floor": 5.0, "floor_ms": 0.01}
    headline, notes = _ffn_summary([pallas, *rows])
    assert notes[1].startswith("pallas: within 1.15x of the bound in 0/1 cases")
    assert headline.startswith("decode: within 1.5x of the memory floor in 0/2 cases")
    assert _ffn_summary([pallas])[0] == notes[1]
    with pytest.raises(ConfigError, match="profile_paths"):
        run_experiment("bench_kernels", bench_kernels.make_config, bench_kernels.run,
                       ["ffn_paths=(dense,)"], out=tmp_path / "bad")


def test_the_benchmarks_time_no_wrong_kernel(monkeypatch):
    """A grouped product or an expert path whose output is not its oracle's is a row saying
    "wrong: ...", with no time; the others are timed."""
    right = bench_grouped._pass_fn
    monkeypatch.setattr(bench_grouped, "_pass_fn", lambda path, which: (
        (lambda a, b, gs: 2 * right("xla", which)(a, b, gs)) if path == "xla" and
        which == "dlhs" else right(path, which)))
    cfg = bench_grouped.BenchGroupedConfig(paths=("dense", "xla"), shapes=((64, 16, 32, 4),),
                                           iters=1, repeats=1)
    rows = bench_grouped.bench(cfg, jax.random.key(0))
    xla = {r["pass"]: r for r in rows if r["path"] == "xla"}
    assert xla["dlhs"]["note"].startswith("wrong: error") and not xla["dlhs"]["ms"]
    assert xla["fwd"]["ms"] and xla["drhs"]["ms"] and not xla["fwd"]["note"]

    right_ffn = bench_kernels._ffn_fn
    monkeypatch.setattr(bench_kernels, "_ffn_fn", lambda path, cfg, u: (
        (lambda *z: 2 * right_ffn(path, cfg, u)(*z)) if path == "chunk_union"
        else right_ffn(path, cfg, u)))
    cfg = bench_kernels.BenchKernelsConfig(
        ffn=bench_kernels.FfnShape(d_model=16, n_experts=8, d_expert=8), chunk_sizes=(2,),
        union_fractions=(0.5,), repeats=1,
        ffn_paths=("dense", "dense_union", "chunk_union", "chunk_union_gather"),
        profile_paths=())
    rows = {r["path"]: r for r in bench_kernels.bench_ffn(cfg, jax.random.key(0), 1.0)}
    assert rows["chunk_union"]["note"].startswith("wrong: error")
    assert "ms" not in rows["chunk_union"]
    assert all(rows[p].get("ms") for p in ("dense", "dense_union", "chunk_union_gather"))


def test_bench_dispatch_profiles_a_step_per_path_where_it_sees_the_device(tmp_path, monkeypatch):
    """With a device trace (stubbed here: a CPU trace has none), each path's row gets its
    kernels per step and the device's busy fraction, and step_kernels its longest kernels and
    the rest together, each with what it fuses."""
    import csv

    compiled, real_compile, named = [], bench_dispatch.compile_fitting, []
    monkeypatch.setattr(bench_dispatch, "compile_fitting",
                        lambda *a, **k: compiled.append(real_compile(*a, **k)) or compiled[-1])

    def traced(one_step):
        one_step()  # the step runs (and donates its state) as under the profiler
        # the second kernel named as a profile names one of the step's own fusions
        named.append(next(k for k in fused_ops(compiled[-1].as_text()) if "." not in k))
        return KernelTrace(12, 3e-3, {"gemm": 2e-3, named[-1]: 0.8e-3, "copy": 0.2e-3})

    monkeypatch.setattr(train_steps, "sees_device", lambda: True)
    monkeypatch.setattr(train_steps, "trace_kernels", traced)
    _, run = run_experiment(
        "bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
        TINY_LM + ["batch_size=2", "seq_len=16", "warmup=1", "steps=1", "paths=(dense,capacity)",
                   "profile_top=2", "block_tokens=64", "block_d=16", "block_f=32",
                   "block_repeats=1", "block_paths=(capacity,)", "delta_tree=none"],
        out=tmp_path / "bench")
    rows = list(csv.DictReader(open(run.path / "dispatch.csv")))
    for r in rows:
        assert int(r["kernels_per_step"]) == 12
        assert float(r["device_busy"]) == pytest.approx(3e-3 / float(r["step_s_median"]))
    top = list(csv.DictReader(open(run.path / "step_kernels.csv")))
    assert [(t["path"], t["kernel"]) for t in top] == [
        (p, k) for p, name in zip(("dense", "capacity"), named)
        for k in ("gemm", name, "(the other kernels)")]
    assert [float(t["ms"]) for t in top[:3]] == pytest.approx([2.0, 0.8, 0.2])
    assert float(top[0]["share"]) == pytest.approx(2 / 3)
    # what each kernel fuses, read from the step each path compiled and timed
    fuses = [fused_ops(c.as_text()) for c in compiled]
    assert [t["fuses"] for t in top] == [
        x for f, name in zip(fuses, named) for x in ("", f[name], "")]
    assert all(" -> " in f[name] for f, name in zip(fuses, named))
    with pytest.raises(ConfigError, match="profile_top"):
        run_experiment("bench_dispatch", bench_dispatch.make_config, bench_dispatch.run,
                       ["profile_top=0"], out=tmp_path / "bad")
