"""Benchmark of the expert kernels (BlockFFN's chunk-sparse FFN and the dropless grouped
matmul), against their bounds.

(a) ``ffn``: one BlockFFN layer's experts on a chunk of ``n`` tokens whose union of active
experts is a fraction ``|U| / E`` of the experts (:func:`experiments.bench.union_activations`,
every token active on every union expert). Paths: ``dense`` (every expert), ``dense_union``
(the dense path on ``|U|`` experts: the union's bytes and FLOPs, no union bookkeeping),
``ragged`` (``jax.lax.ragged_dot`` over the ``n |U|`` (token, expert) pairs), ``chunk_union``
and ``chunk_union_gather`` (the jnp union path's two schedules, static cap set to ``|U|``),
and the kernels ``pallas`` and ``triton`` (GPU only: on a CPU they run in interpret mode,
which is no speed measurement, so their rows say "not measured"). Bound: ``dense time x |U|
/ E``; on GPU also the achieved bandwidth (bytes of the union's expert weights read per call)
against ``peak_gbps``. The paths of one (n, |U|) are timed round-robin (each call sees the
caches the others leave, as one layer among many would). ``union_breakdown`` splits each
union path's distance to the bound into two measured factors, ``x_bound = overhead x
dense_scaling``: ``overhead`` = its time over ``dense_union``'s (what the union path adds:
finding the union, gathering, one small product per member) and ``dense_scaling`` =
``dense_union``'s time over the bound (how far the dense computation itself is from
proportional to the experts it reads: caches, matmul shapes).

(b) ``gmm``: forward + backward (dX and dW) of a grouped matmul ``[M, K] x [G, K, N]`` with
random group sizes: ``ragged`` (``jax.lax.ragged_dot``), ``gmm`` (the Pallas kernels; GPU
only) and ``dense`` (one ``[M, K] x [K, N]`` matmul: the same active FLOPs).

    python -m experiments.bench_kernels                 # CPU: the jnp paths
    python -m experiments.bench_kernels preset=full     # GPU: every path, bf16, larger shapes
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments.bench import kernel_unavailable, time_call, time_interleaved, union_activations
from moejax.config import Config, config
from moejax.experiment import main
from moejax.kernels.chunk_union.pallas import chunk_union_kernel
from moejax.kernels.chunk_union.reference import chunk_union_experts, dense_experts
from moejax.kernels.grouped.pallas_gmm import gmm
from moejax.ops.dispatch import dispatch_ragged
from moejax.results import RunDir

NAME = "bench_kernels"
# smoke=true: this study's own cuts (moejax.smoke)
SMOKE = ("union_fractions=(0.25,1.0)", "warmup=1", "repeats=1")
FfnPath = Literal["dense", "dense_union", "ragged", "chunk_union", "chunk_union_gather", "pallas",
                  "triton"]
GmmPath = Literal["dense", "ragged", "gmm"]


@config
class FfnShape(Config):
    """One BlockFFN layer: model width, number of experts, expert width, activation."""

    d_model: int = 512
    n_experts: int = 32
    d_expert: int = 128
    activation: Literal["swish", "relu"] = "swish"


@config
class BenchKernelsConfig(Config):
    ffn: FfnShape = FfnShape()
    ffn_paths: tuple[FfnPath, ...] = ("dense", "dense_union", "ragged", "chunk_union",
                                      "chunk_union_gather", "pallas", "triton")
    chunk_sizes: tuple[int, ...] = (1, 8, 32)
    union_fractions: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
    gmm_paths: tuple[GmmPath, ...] = ("dense", "ragged", "gmm")
    # (M rows, K, N, G groups): the bench_dispatch up-projection (2048 tokens x top-2) and a
    # larger one.
    gmm_shapes: tuple[tuple[int, int, int, int], ...] = ((4096, 256, 704, 8),
                                                         (8192, 512, 1024, 8))
    precision: Literal["float32", "bfloat16"] = "float32"
    warmup: int = 3
    repeats: int = 20
    peak_gbps: float = 0.0  # the device's memory bandwidth (0 = not given): H100 SXM 3350
    seed: int = 0

    def validate(self):
        r = self._require
        r(len(self.chunk_sizes) > 0 and all(n >= 1 for n in self.chunk_sizes),
          f"chunk_sizes={self.chunk_sizes} must be >= 1")
        r(len(self.union_fractions) > 0 and all(0 < u <= 1 for u in self.union_fractions),
          f"union_fractions={self.union_fractions} must be in (0, 1]")
        r(all(len(s) == 4 and min(s) >= 1 for s in self.gmm_shapes),
          f"gmm_shapes={self.gmm_shapes}: each must be (M, K, N, G) >= 1")
        r(self.repeats >= 1 and self.warmup >= 0, "repeats must be >= 1 and warmup >= 0")
        r(self.peak_gbps >= 0, f"peak_gbps={self.peak_gbps} must be >= 0")


def make_config(preset: str) -> BenchKernelsConfig:
    if preset == "quick":
        return BenchKernelsConfig()
    return BenchKernelsConfig(
        ffn=FfnShape(d_model=2048, n_experts=64, d_expert=256), precision="bfloat16",
        gmm_shapes=((4096, 256, 704, 8), (65536, 2048, 1408, 64)), repeats=50,
        peak_gbps=3350.0)


def _ffn_fn(path: str, cfg: BenchKernelsConfig, union_size: int):
    act = cfg.ffn.activation
    if path == "dense":
        return lambda x, a, wu, wd: dense_experts(x, a, wu, wd, None, act)
    if path == "ragged":
        def ragged(x, a, wu, wd):
            w, ids = jax.lax.top_k(a, union_size)
            return dispatch_ragged(x, ids, w, wu, wd, activation=act).y_ND
        return ragged
    if path.startswith("chunk_union"):
        schedule = "gather" if path.endswith("gather") else "loop"
        return lambda x, a, wu, wd: chunk_union_experts(
            x, a, a > 0, wu, wd, None, act, tile=x.shape[0], max_union=union_size,
            schedule=schedule)[0]
    return lambda x, a, wu, wd: chunk_union_kernel(
        x, a, a > 0, wu, wd, activation=act, tile=x.shape[0], max_union=union_size,
        backend=path)[0]


def bench_ffn(cfg: BenchKernelsConfig, key) -> list[dict]:
    s, dt = cfg.ffn, jnp.dtype(cfg.precision)
    k_w, k_x, k_a = jax.random.split(key, 3)
    ku, kd = jax.random.split(k_w)
    wu = (jax.random.normal(ku, (s.n_experts, s.d_model, s.d_expert)) / np.sqrt(s.d_model))
    wd = (jax.random.normal(kd, (s.n_experts, s.d_expert, s.d_model)) / np.sqrt(s.d_expert))
    wu, wd = wu.astype(dt), wd.astype(dt)
    rows = []
    jobs = [(n, u) for n in cfg.chunk_sizes for u in cfg.union_fractions]
    for n, u in tqdm(jobs, desc="ffn kernels", leave=False):
        size = max(1, round(u * s.n_experts))
        x = jax.random.normal(jax.random.fold_in(k_x, n), (n, s.d_model)).astype(dt)
        a = union_activations(jax.random.fold_in(k_a, n * 1000 + size), n, s.n_experts, size)
        fns, job = {}, []
        for path in cfg.ffn_paths:
            row = {"n": n, "union_fraction": size / s.n_experts, "union": size, "path": path}
            job.append(row)
            why = kernel_unavailable(path)
            if why:
                row["note"] = why
                continue
            # dense_union: |U| experts' weights of their own (sliced here, not in the call)
            args = ((x, a[:, :size], wu[:size], wd[:size]) if path == "dense_union"
                    else (x, a, wu, wd))
            fn = jax.jit(_ffn_fn("dense" if path == "dense_union" else path, cfg, size))
            fns[path] = lambda fn=fn, args=args: fn(*args)
        # round-robin: every path sees the caches the others leave, as a layer among layers
        times = time_interleaved(fns, warmup=cfg.warmup, repeats=cfg.repeats)
        dense_s = times["dense"]["median_s"] if "dense" in times else None
        for row in job:
            if row["path"] not in times:
                rows.append(row)
                continue
            t = times[row["path"]]["median_s"]
            row["ms"] = t * 1e3
            if dense_s is not None:
                bound = dense_s * size / s.n_experts
                row["bound_ms"] = bound * 1e3
                row["x_bound"] = t / bound
            read = 2 * size * s.d_model * s.d_expert * dt.itemsize
            row["gbps"] = read / t / 1e9
            if cfg.peak_gbps:
                row["frac_of_peak"] = row["gbps"] / cfg.peak_gbps
            rows.append(row)
    return rows


def _gmm_loss(path: str):
    def loss(x, w, gs, ct):
        if path == "dense":
            y = x @ w[0]
        elif path == "ragged":
            y = jax.lax.ragged_dot(x, w, gs)
        else:
            y = gmm(x, w, gs)
        return jnp.sum(y.astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def bench_gmm(cfg: BenchKernelsConfig, key) -> list[dict]:
    dt = jnp.dtype(cfg.precision)
    rows = []
    for M, K, N, G in tqdm(cfg.gmm_shapes, desc="grouped matmul", leave=False):
        kx, kw, kg, kc = jax.random.split(jax.random.fold_in(key, M * K), 4)
        x = jax.random.normal(kx, (M, K)).astype(dt)
        w = (jax.random.normal(kw, (G, K, N)) / np.sqrt(K)).astype(dt)
        gs = jnp.bincount(jax.random.randint(kg, (M,), 0, G), length=G).astype(jnp.int32)
        ct = jax.random.normal(kc, (M, N))
        flops = 3 * 2 * M * K * N  # forward, dX, dW
        base = {"M": M, "K": K, "N": N, "G": G}
        times = {}
        for path in cfg.gmm_paths:
            why = kernel_unavailable(path)
            if why:
                rows.append({**base, "path": path, "note": why})
                continue
            try:
                t = time_call(_gmm_loss(path), x, w, gs, ct, warmup=cfg.warmup,
                              repeats=max(3, cfg.repeats // 4))
            except jax.errors.JaxRuntimeError as err:  # the dense path on a large shape
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                rows.append({**base, "path": path, "note": "out of device memory"})
                continue
            times[path] = t["median_s"]
            rows.append({**base, "path": path, "fwd_bwd_ms": t["median_s"] * 1e3,
                         "tflops": flops / t["median_s"] / 1e12})
        for r in rows[-len(cfg.gmm_paths):]:
            if "fwd_bwd_ms" in r:
                s = r["fwd_bwd_ms"] / 1e3
                if "ragged" in times:
                    r["speedup_vs_ragged"] = times["ragged"] / s
                if "dense" in times:
                    r["x_dense_equal_flops"] = s / times["dense"]
    return rows


def union_breakdown(rows: list[dict]) -> list[dict]:
    """Per union path, chunk size and union size: ``x_bound = overhead x dense_scaling``
    (module docstring), from the rows of :func:`bench_ffn`."""
    ms = {(r["n"], r["union"], r["path"]): r for r in rows if "ms" in r}
    out = []
    for (n, u, path), r in ms.items():
        ref = ms.get((n, u, "dense_union"))
        if path not in ("chunk_union", "chunk_union_gather", "pallas", "triton") or not ref \
                or "bound_ms" not in r:
            continue
        out.append({"n": n, "union_fraction": r["union_fraction"], "path": path,
                    "x_bound": r["x_bound"], "overhead": r["ms"] / ref["ms"],
                    "dense_scaling": ref["ms"] / r["bound_ms"]})
    return out


def _breakdown_note(parts: list[dict], limit: float = 1.3, lo: float = 0.25) -> str:
    """Of the jnp union path's cases beyond ``limit`` x the bound (``|U|/E >= lo``), how many
    are beyond it because of its own overhead and how many because the dense computation
    itself does not scale down with the experts."""
    miss = [p for p in parts if p["path"] == "chunk_union" and p["union_fraction"] >= lo
            and p["x_bound"] > limit]
    if not miss:
        return f"chunk_union: no case beyond {limit}x of the bound with |U|/E >= {lo:.0%}"
    own = [p for p in miss if p["overhead"] > limit]
    fmt = lambda ps: ", ".join(  # noqa: E731
        f"n={p['n']} |U|/E={p['union_fraction']:.2f} ({p['x_bound']:.2f}x = "
        f"{p['overhead']:.2f} x {p['dense_scaling']:.2f})" for p in ps)
    return (f"chunk_union beyond {limit}x of the bound in {len(miss)} cases with |U|/E >= "
            f"{lo:.0%}: {len(own)} by its own overhead over the dense computation on the same "
            f"experts (overhead > {limit}x: {fmt(own) or 'none'}), {len(miss) - len(own)} "
            f"because that dense computation is itself beyond the proportional bound "
            f"({fmt([p for p in miss if p not in own]) or 'none'}); x_bound = overhead x "
            "dense_scaling")


def _ffn_summary(rows: list[dict]) -> tuple[str, list[str]]:
    """A headline about the CPU/GPU target of the jnp union path and the kernels."""
    notes = []
    for path, lo, limit in (("chunk_union", 0.25, 1.3), ("pallas", 0.10, 1.15),
                            ("triton", 0.10, 1.15)):
        got = [r for r in rows if r["path"] == path and "x_bound" in r
               and r["union_fraction"] >= lo]
        if not got:
            notes.append(f"{path}: not measured here")
            continue
        worst = max(got, key=lambda r: r["x_bound"])
        ok = sum(r["x_bound"] <= limit for r in got)
        notes.append(f"{path}: within {limit}x of the bound in {ok}/{len(got)} cases with "
                     f"|U|/E >= {lo:.0%} (worst {worst['x_bound']:.2f}x at n={worst['n']}, "
                     f"|U|/E={worst['union_fraction']:.2f})")
    return notes[0], notes


def run(cfg: BenchKernelsConfig, run: RunDir) -> dict:
    key = jax.random.key(cfg.seed)
    dev = jax.devices()[0]
    where = f"{dev.platform} ({dev.device_kind})"
    s = cfg.ffn
    ffn_rows = bench_ffn(cfg, jax.random.fold_in(key, 0))
    run.table("ffn", ffn_rows, title=(
        f"(a) BlockFFN experts on a chunk of n tokens, d {s.d_model}, {s.n_experts} experts of "
        f"width {s.d_expert}, {s.activation}, {cfg.precision}, median of {cfg.repeats}, on "
        f"{where}; bound = dense x |U|/E"))
    for n in cfg.chunk_sizes:
        series = {}
        for path in cfg.ffn_paths:
            pts = [(r["union_fraction"], r["ms"]) for r in ffn_rows
                   if r["n"] == n and r["path"] == path and "ms" in r]
            if pts:
                series[path] = tuple(zip(*pts))
        bound = [(r["union_fraction"], r["bound_ms"]) for r in ffn_rows
                 if r["n"] == n and r["path"] == "dense" and "bound_ms" in r]
        if bound:
            series["bound (dense x |U|/E)"] = tuple(zip(*bound))
        if series:
            run.line_plot(f"ffn_n{n}", series, xlabel="union fraction |U|/E",
                          ylabel="ms per call", markers=True,
                          title=f"Expert FFN time, chunk of {n} token(s), {where}")
    parts = union_breakdown(ffn_rows)
    run.table("union_breakdown", parts, title=(
        "Where the union paths' time goes: x_bound = overhead (time / dense_union's: the union "
        "bookkeeping and per-member products) x dense_scaling (dense_union / bound: the dense "
        "computation on |U| experts against dense x |U|/E)"))
    gmm_rows = bench_gmm(cfg, jax.random.fold_in(key, 1))
    run.table("gmm", gmm_rows, title=(
        f"(b) Grouped matmul forward + backward (dX, dW), {cfg.precision}, on {where}; dense = "
        "one matmul of the same active FLOPs"))
    headline, notes = _ffn_summary(ffn_rows)
    for line in notes:
        run.note(f"- {line}")
    run.note("- " + _breakdown_note(parts))
    gm = [r for r in gmm_rows if r["path"] == "gmm" and "speedup_vs_ragged" in r]
    run.note("- gmm: " + ("; ".join(
        f"{r['M']}x{r['K']}x{r['N']} G={r['G']}: {r['speedup_vs_ragged']:.2f}x ragged_dot, "
        f"{r.get('x_dense_equal_flops', float('nan')):.2f}x the dense matmul" for r in gm)
        if gm else "not measured here (needs a GPU: `python -m experiments.bench_kernels "
        "preset=full`)"))
    return {"headline": f"{headline} ({where})",
            **{f"{r['path']}_n{r['n']}_u{r['union']}_ms": round(r["ms"], 3)
               for r in ffn_rows if "ms" in r and r["union_fraction"] in (0.25, 1.0)}}


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run, smoke=SMOKE))
