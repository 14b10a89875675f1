"""Tune the project's own GPU kernels on the GPU at hand (:mod:`moejax.kernels.tuning`): for each
kernel (``gmm``: the grouped products, forward and dX; ``tgmm``: the weight gradient; ``gmm_mgpu`` /
``tgmm_mgpu``: the same on Mosaic GPU; ``pairs_mgpu``: BlockFFN's Mosaic GPU pair product, timed as
the up-projection of ``rows`` rows in 64-row tiles, each with 4 of ``groups`` experts;
``decode_mgpu``: its Mosaic GPU decode kernel on a chunk of 8 tokens, called five times, with four
unions of a quarter of ``groups`` experts of shape ``(D, F) = (K, N)`` and one of all of them, so
that the two sizes count alike against their HBM floors: one launch configuration serves every
union, whose size is known only at run time, and a quarter union's few programs may want another
than a full one's many), dtype it takes and shape ``(K, N)``
(``shapes``; the decode kernel's ``(D, F)``: ``decode_shapes``), every
configuration of the kernel's space is run (the grouped products: ``rows`` rows in ``groups`` random
groups), its output checked against a float32 oracle written the slow obvious way (one that differs
is refused, however fast), and timed by its kernels' own device time (the profiler's, less the
kernels of the L2 rewrite between calls; a short call's wall time minus the rewrite's would be
inside the rewrite's noise); the fastest
correct one is merged into the package's kernel table under this GPU's device kind, where every
later lowering for that device reads it. The run's ``trials`` table keeps every configuration's time
or the reason it was refused.

    python -m experiments.benchmarks.autotune                                   # the default cases
    python -m experiments.benchmarks.autotune dtypes=(bfloat16,) shapes=((2048,1408),)
    python -m experiments.benchmarks.autotune kernels=(decode_mgpu,) "decode_shapes=((2048,256),)"

A GPU only: on a CPU the kernels run in interpret mode, which is no timing (exit 2).
"""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moejax.bench.timing import time_device_loop, union_activations
from moejax.config import Config, config
from moejax.harness.cli import asks_help
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.kernels.chunk_union.decode_gpu import TUNED_ROWS, chunk_union_decode_gpu
from moejax.kernels.chunk_union.pairs import pair_up, union_pairs
from moejax.kernels.chunk_union.reference import dense_experts
from moejax.kernels.grouped.gmm_mgpu import gmm_mgpu, tgmm_mgpu
from moejax.kernels.grouped.pallas_gmm import gmm, tgmm
from moejax.kernels.tiling import hopper_target, target_device
from moejax.kernels.tuning import (
    DEFAULTS,
    KERNELS,
    SPACES,
    Tuned,
    check_close,
    forced,
    tune,
    write_entries,
)


@config
class AutotuneConfig(Config):
    kernels: tuple[str, ...] = KERNELS
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    # (K, N): the full presets' expert products (d 2048 / 256 with expert widths 1408 / 704)
    shapes: tuple[tuple[int, int], ...] = ((2048, 1408), (1408, 2048), (256, 704), (704, 256))
    # (D, F) of the decode kernel's cases: BlockFFN's experts at bench_kernels' decode size
    decode_shapes: tuple[tuple[int, int], ...] = ((2048, 256),)
    rows: int = 16384
    groups: int = 64
    iters: int = 20  # calls per timed device loop
    repeats: int = 5  # timed loops per configuration (their median is its time)
    # rewritten between calls (a few times the L2), so the weights come from memory as in a
    # step through many layers
    l2_flush_mb: float = 256.0
    seed: int = 0

    def validate(self):
        r = self._require
        r(set(self.kernels) <= set(KERNELS), f"kernels must be among {KERNELS}")
        r(set(self.dtypes) <= {"bfloat16", "float16", "float32"},
          "dtypes must be among bfloat16, float16, float32")
        for name in ("shapes", "decode_shapes"):
            got = getattr(self, name)
            r(all(k >= 1 and n >= 1 for k, n in got) and got,
              f"{name}: one or more (K, N) with K, N >= 1")
        r(self.rows >= self.groups >= 1 and self.repeats >= 1 and self.iters >= 1,
          "rows >= groups >= 1, repeats >= 1 and iters >= 1")
        r(self.l2_flush_mb >= 0, f"l2_flush_mb={self.l2_flush_mb} must be >= 0")


def make_config(preset: str) -> AutotuneConfig:
    return AutotuneConfig()


_f32 = partial(jnp.asarray, dtype=jnp.float32)


def _group_of_row(sizes_G, rows: int):
    return jnp.repeat(jnp.arange(sizes_G.shape[0]), sizes_G, total_repeat_length=rows)


def _gmm_oracle(x, w, sizes):
    """``x[i] w[group(i)]`` in float32, one group at a time (no [M, G, N] expansion)."""
    gid = _group_of_row(sizes, x.shape[0])
    hi = jax.lax.Precision.HIGHEST
    return jax.lax.fori_loop(0, w.shape[0], lambda g, acc: acc + jnp.where(
        (gid == g)[:, None], jnp.dot(_f32(x), _f32(w[g]), precision=hi), 0.0),
        jnp.zeros((x.shape[0], w.shape[2]), jnp.float32))


def _tgmm_oracle(x, dy, sizes):
    """``sum over rows i of group g: x[i]^T dy[i]`` per group, float32."""
    gid = _group_of_row(sizes, x.shape[0])
    hi = jax.lax.Precision.HIGHEST
    return jax.lax.map(lambda g: jnp.dot(jnp.where((gid == g)[:, None], _f32(x), 0.0).T,
                                         _f32(dy), precision=hi), jnp.arange(sizes.shape[0]))


def _pairs_oracle(xs, w, pairs):
    """``xs[src_p] w[e_p]`` per pair (0 for an empty pair), float32."""
    hi = jax.lax.Precision.HIGHEST
    return jax.lax.map(lambda p: jnp.dot(_f32(xs[p[0]]), _f32(w[p[1]]), precision=hi) * p[2],
                       jnp.stack([pairs.src, pairs.expert, pairs.valid], 1))


_GROUPED = ("gmm", "tgmm", "gmm_mgpu", "tgmm_mgpu")


def _grouped(kernel: str):
    """A grouped product's ``(function, float32 oracle)`` (looked up when called)."""
    return {"gmm": (gmm, _gmm_oracle), "tgmm": (tgmm, _tgmm_oracle),
            "gmm_mgpu": (gmm_mgpu, _gmm_oracle), "tgmm_mgpu": (tgmm_mgpu, _tgmm_oracle)}[kernel]


def _call(kernel: str, cfg: AutotuneConfig, dt, k: int, n: int, key):
    """``(jitted function, its arguments, a jitted float32 oracle of the same arguments)``
    for one case of ``kernel``."""
    kx, kw, kg = jax.random.split(key, 3)
    G = cfg.groups
    if kernel in _GROUPED:
        x = jax.random.normal(kx, (cfg.rows, k)).astype(dt)
        sizes = jnp.bincount(jax.random.randint(kg, (cfg.rows,), 0, G),
                             length=G).astype(jnp.int32)
        fn, oracle = _grouped(kernel)
        forward = oracle is _gmm_oracle
        other = jax.random.normal(kw, (G, k, n) if forward else (cfg.rows, n))
        return jax.jit(fn), (x, other.astype(dt), sizes), jax.jit(oracle)
    if kernel == "pairs_mgpu":
        S, U = max(1, cfg.rows // 64), min(4, G)
        ids = jax.vmap(lambda kk: jax.random.permutation(kk, G)[:U])(
            jax.random.split(kg, S)).astype(jnp.int32)
        pairs = union_pairs(ids, jnp.full((S,), U, jnp.int32), G)
        xs = jax.random.normal(kx, (S, 64, k)).astype(dt)
        w = (jax.random.normal(kw, (G, k, n)) / k ** 0.5).astype(dt)
        return (jax.jit(lambda xs, w: pair_up(xs, w, pairs)), (xs, w),
                jax.jit(lambda xs, w: _pairs_oracle(xs, w, pairs)))
    # four unions of a quarter of the experts, then one of all, each with weights of its own
    # (a call finds none of its weights in the L2 that the calls before it filled), passed as
    # separate arguments (a slice of a stacked one would be a copy in every timed call). A
    # quarter union's HBM floor is a quarter of a full one's, so the five calls' time is the
    # full union's floor times the sum of the two unions' time over their floors: what the
    # decode target judges, each union size counted alike
    x = jax.random.normal(kx, (TUNED_ROWS, k)).astype(dt)
    sizes = (max(1, G // 4),) * 4 + (G,)
    unions = []
    for ka, kk, size in zip(jax.random.split(kg, len(sizes)), jax.random.split(kw, len(sizes)),
                            sizes):
        wu, wd = ((jax.random.normal(kw_, s) / s[1] ** 0.5).astype(dt)
                  for kw_, s in zip(jax.random.split(kk), ((G, k, n), (G, n, k))))
        unions += [union_activations(ka, TUNED_ROWS, G, size), wu, wd]

    def calls(expert_fn):  # [5, rows, D]: each union's output in turn
        def chain(x, *u):
            outs = []
            for i in range(0, len(u), 3):
                # each call takes its x through a barrier on the last one's output: the
                # launches run one after the other, as in a model, not side by side on the
                # GPU's streams
                x_i = jax.lax.optimization_barrier((x, outs[-1]))[0] if outs else x
                outs.append(expert_fn(x_i, *u[i:i + 3]))
            return jnp.stack(outs)
        return jax.jit(chain)

    return (calls(lambda x, a, wu, wd: chunk_union_decode_gpu(x, a, a > 0, wu, wd,
                                                              activation="relu")),
            (x, *unions),
            calls(lambda x, a, wu, wd: dense_experts(_f32(x), a, _f32(wu), _f32(wd), None,
                                                     "relu")))


def _timer(cfg: AutotuneConfig, timer=time_device_loop):
    """``time_fn(kernel, dtype, k, n, candidate)``: the candidate's output checked against
    the case's oracle (:class:`WrongResult` when it differs), then its device time per call
    (``timer``: :func:`moejax.bench.timing.time_device_loop`'s signature)."""
    wants: dict = {}  # the oracle's output per case, computed once

    def time_fn(kernel, dtype, k, n, candidate) -> float:
        key = jax.random.fold_in(jax.random.key(cfg.seed), k * 100_003 + n)
        fn, args, oracle = _call(kernel, cfg, jnp.dtype(dtype), k, n, key)
        case = (kernel, dtype, k, n)
        if case not in wants:
            wants[case] = np.asarray(oracle(*args))
        with forced(candidate):  # traced (and compiled) with this candidate
            check_close(fn(*args), wants[case], dtype)
            timed = timer(fn, *args, iters=cfg.iters, repeats=cfg.repeats,
                          flush_bytes=int(cfg.l2_flush_mb * 2 ** 20), profile=True)
        return _decisive(timed)
    return time_fn


def _decisive(timed: dict) -> float:
    """The time a candidate is judged by: its kernels' own device time per call from the
    profiler (``kernel_s``: the L2 rewrite's kernels taken out by name, so the rewrite's
    timing noise, which can be larger than a short call, does not enter), else the loop's
    median (no device trace: a CPU)."""
    return timed["kernel_s"] if timed.get("kernel_s") is not None else timed["median_s"]


def tune_all(cfg: AutotuneConfig, time_fn, keep=None) -> Tuned:
    """Each kernel over its own space (:data:`moejax.kernels.tuning.SPACES`), for the dtypes
    it takes; the Mosaic GPU kernels only on a Hopper GPU (elsewhere their callers run
    Triton, so their timings would tune nothing). ``keep(entries)``, if given, receives each
    kernel's winners as soon as they are found (the table is written kernel by kernel, so a
    run stopped by a time limit keeps what it tuned)."""
    entries: dict = {}
    trials: list = []
    for kn in cfg.kernels:
        if kn.endswith("_mgpu") and not hopper_target():
            continue
        cases = [(kn, dt, k, n) for dt in cfg.dtypes if (kn, dt) in DEFAULTS
                 for k, n in (cfg.decode_shapes if kn == "decode_mgpu" else cfg.shapes)]
        if cases:
            got = tune(cases, SPACES[kn], time_fn)
            if keep is not None:
                keep(got.entries)
            entries.update(got.entries)
            trials += got.trials
    return Tuned(entries, trials)


def run(cfg: AutotuneConfig, run: RunDir) -> dict:
    kind = target_device()[1]
    written: set = set()
    tuned = tune_all(cfg, _timer(cfg),
                     keep=lambda entries: written.update(write_entries(kind, entries)))
    path = ", ".join(sorted(str(p) for p in written)) or "no file"
    rows = [{"kernel": kn, "dtype": dt, "bucket": b, **e}
            for kn, by_dtype in tuned.entries.items() for dt, by_b in by_dtype.items()
            for b, e in by_b.items()]
    how = (f"the call's kernels' own device time per call, from the profiler over a loop of "
           f"{cfg.iters} (where there is no device trace, the median of {cfg.repeats} loops)"
           + (f", L2 flushed ({cfg.l2_flush_mb:g} MB)" if cfg.l2_flush_mb else ""))
    run.table("winners", rows, title=f"Fastest correct launch configuration per case on "
              f"{kind} ({cfg.rows} rows in {cfg.groups} groups; {how})")
    run.table("trials", tuned.trials, title="Every configuration tried: its time, or why it "
              "was refused (output unlike the float32 oracle's, or it cannot run)")
    won = {(r["kernel"], r["dtype"], r["bucket"]) for r in rows}
    lost = sorted({(t["kernel"], t["dtype"], t["bucket"]) for t in tuned.trials} - won)
    run.note(f"Written to {path} under {kind!r} (each kernel's op's tuned/); lowerings for "
             "this device read it."
             + (f" No configuration ran correctly for {lost}: those keep their defaults."
                if lost else ""))
    return {"device": kind, "cases": len(rows), "cases_without_a_winner": len(lost),
            "wrong_configurations": sum(t["outcome"].startswith("wrong") for t in tuned.trials),
            "table": path}


STUDY = Study("autotune", make_config, run)


def cli(argv=None) -> int:
    """Refuse a machine without a GPU before anything is written, then run (its usage is
    printed on any machine)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    platform = target_device()[0]
    if platform not in ("cuda", "rocm") and not asks_help(argv):
        print(f"error: autotune times GPU kernels; this machine lowers for {platform} (its "
              "kernels would run in interpret mode, which is no timing): run it on a GPU",
              file=sys.stderr)
        return 2
    return STUDY.main(argv)


if __name__ == "__main__":
    raise SystemExit(cli())
