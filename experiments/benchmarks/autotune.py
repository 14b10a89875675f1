"""Tune the project's own GPU kernels on the GPU at hand (:mod:`moejax.kernels.tuning`): for
each kernel (``gmm``: the grouped products, forward and dX; ``tgmm``: the weight gradient;
``pairs_mgpu``: BlockFFN's Mosaic GPU pair product, timed as the up-projection of ``rows``
rows in 64-row tiles, each with 4 of ``groups`` experts; ``decode_mgpu``: its Mosaic GPU
decode kernel on a chunk of 8 tokens whose union is a quarter of ``groups`` experts of shape
``(D, F) = (K, N)``), dtype it takes and shape ``(K, N)``, every configuration of the
kernel's space is timed (``gmm`` / ``tgmm``: ``rows`` rows in ``groups`` random groups), and
the fastest is merged into the package's kernel table under this GPU's device kind, where
every later lowering for that device reads it.

    python -m experiments.autotune                                   # the default cases
    python -m experiments.autotune dtypes=(bfloat16,) shapes=((2048,1408),)

A GPU only: on a CPU the kernels run in interpret mode, which is no timing (exit 2).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from moejax.bench.timing import time_call, union_activations
from moejax.config import Config, config
from moejax.kernels.chunk_union.decode_gpu import chunk_union_decode_gpu
from moejax.kernels.chunk_union.pairs import pair_up, union_pairs
from moejax.kernels.grouped.pallas_gmm import gmm, tgmm
from moejax.kernels.tiling import hopper_target, target_device
from moejax.kernels.tuning import DEFAULTS, KERNELS, SPACES, forced, tune, write_entries
from moejax.results import RunDir
from moejax.study import Study


@config
class AutotuneConfig(Config):
    kernels: tuple[str, ...] = KERNELS
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    # (K, N): the full presets' expert products (d 2048 / 256 with expert widths 1408 / 704)
    shapes: tuple[tuple[int, int], ...] = ((2048, 1408), (1408, 2048), (256, 704), (704, 256))
    rows: int = 16384
    groups: int = 64
    repeats: int = 10
    seed: int = 0

    def validate(self):
        r = self._require
        r(set(self.kernels) <= set(KERNELS), f"kernels must be among {KERNELS}")
        r(set(self.dtypes) <= {"bfloat16", "float16", "float32"},
          "dtypes must be among bfloat16, float16, float32")
        r(all(k >= 1 and n >= 1 for k, n in self.shapes) and self.shapes,
          "shapes: one or more (K, N) with K, N >= 1")
        r(self.rows >= self.groups >= 1 and self.repeats >= 1,
          "rows >= groups >= 1 and repeats >= 1")


def make_config(preset: str) -> AutotuneConfig:
    return AutotuneConfig()


def _call(kernel: str, cfg: AutotuneConfig, dt, k: int, n: int, key):
    """``(jitted function, its arguments)`` timed for one case of ``kernel``."""
    kx, kw, kg = jax.random.split(key, 3)
    G = cfg.groups
    if kernel in ("gmm", "tgmm"):
        x = jax.random.normal(kx, (cfg.rows, k)).astype(dt)
        sizes = jnp.bincount(jax.random.randint(kg, (cfg.rows,), 0, G),
                             length=G).astype(jnp.int32)
        other = jax.random.normal(kw, (G, k, n) if kernel == "gmm" else (cfg.rows, n))
        return jax.jit(gmm if kernel == "gmm" else tgmm), (x, other.astype(dt), sizes)
    if kernel == "pairs_mgpu":
        S, U = max(1, cfg.rows // 64), min(4, G)
        ids = jax.vmap(lambda kk: jax.random.permutation(kk, G)[:U])(
            jax.random.split(kg, S)).astype(jnp.int32)
        pairs = union_pairs(ids, jnp.full((S,), U, jnp.int32), G)
        xs = jax.random.normal(kx, (S, 64, k)).astype(dt)
        w = jax.random.normal(kw, (G, k, n)).astype(dt)
        return jax.jit(lambda xs, w: pair_up(xs, w, pairs)), (xs, w)
    x = jax.random.normal(kx, (8, k)).astype(dt)
    a = union_activations(kg, 8, G, max(1, G // 4)).astype(jnp.float32)
    wu, wd = (jax.random.normal(kk, s).astype(dt)
              for kk, s in zip(jax.random.split(kw), ((G, k, n), (G, n, k))))
    return jax.jit(lambda x, a, wu, wd: chunk_union_decode_gpu(
        x, a, a > 0, wu, wd, activation="relu")), (x, a, wu, wd)


def _timer(cfg: AutotuneConfig):
    def time_fn(kernel, dtype, k, n, candidate) -> float:
        key = jax.random.fold_in(jax.random.key(cfg.seed), k * 100_003 + n)
        fn, args = _call(kernel, cfg, jnp.dtype(dtype), k, n, key)
        with forced(candidate):  # traced (and compiled) with this candidate
            return time_call(fn, *args, repeats=cfg.repeats)["median_s"]
    return time_fn


def tune_all(cfg: AutotuneConfig, time_fn) -> dict:
    """Each kernel over its own space (:data:`moejax.kernels.tuning.SPACES`), for the dtypes
    it takes; the Mosaic GPU kernels only on a Hopper GPU (elsewhere their callers run
    Triton, so their timings would tune nothing)."""
    entries: dict = {}
    for kn in cfg.kernels:
        if kn.endswith("_mgpu") and not hopper_target():
            continue
        cases = [(kn, dt, k, n) for dt in cfg.dtypes if (kn, dt) in DEFAULTS
                 for k, n in cfg.shapes]
        if cases:
            entries.update(tune(cases, SPACES[kn], time_fn))
    return entries


def run(cfg: AutotuneConfig, run: RunDir) -> dict:
    kind = target_device()[1]
    entries = tune_all(cfg, _timer(cfg))
    path = write_entries(kind, entries)
    rows = [{"kernel": kn, "dtype": dt, "bucket": b, **e}
            for kn, by_dtype in entries.items() for dt, by_b in by_dtype.items()
            for b, e in by_b.items()]
    run.table("winners", rows, title=f"Fastest launch configuration per case on {kind} "
              f"({cfg.rows} rows in {cfg.groups} groups, median of {cfg.repeats})")
    run.note(f"Written to {path} under {kind!r}; lowerings for this device read it.")
    return {"device": kind, "cases": len(rows), "table": str(path)}


STUDY = Study("autotune", make_config, run)


def cli(argv=None) -> int:
    """Refuse a machine without a GPU before anything is written, then run."""
    platform = target_device()[0]
    if platform not in ("cuda", "rocm"):
        print(f"error: autotune times GPU kernels; this machine lowers for {platform} (its "
              "kernels would run in interpret mode, which is no timing): run it on a GPU",
              file=sys.stderr)
        return 2
    return STUDY.main(argv)


if __name__ == "__main__":
    raise SystemExit(cli())
