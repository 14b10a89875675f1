"""Tune the project's own GPU kernels on the GPU at hand (:mod:`moejax.kernels.tuning`): for
each kernel (``gmm``: the grouped products, forward and dX; ``tgmm``: the weight gradient),
dtype and shape ``(K, N)``, every configuration of the space is timed on ``rows`` rows in
``groups`` random groups, and the fastest is merged into the package's kernel table under
this GPU's device kind, where every later lowering for that device reads it.

    python -m experiments.autotune                                   # the default cases
    python -m experiments.autotune dtypes=(bfloat16,) shapes=((2048,1408),)

A GPU only: on a CPU the kernels run in interpret mode, which is no timing (exit 2).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from moejax.bench.timing import time_call
from moejax.config import Config, config
from moejax.kernels.grouped.pallas_gmm import gmm, tgmm
from moejax.kernels.tiling import target_device
from moejax.kernels.tuning import KERNELS, SPACE, forced, tune, write_entries
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


def _timer(cfg: AutotuneConfig):
    def time_fn(kernel, dtype, k, n, candidate) -> float:
        key = jax.random.fold_in(jax.random.key(cfg.seed), k * 100_003 + n)
        kx, kw, kg = jax.random.split(key, 3)
        dt = jnp.dtype(dtype)
        x = jax.random.normal(kx, (cfg.rows, k)).astype(dt)
        sizes = jnp.bincount(jax.random.randint(kg, (cfg.rows,), 0, cfg.groups),
                             length=cfg.groups).astype(jnp.int32)
        if kernel == "gmm":
            fn, other = jax.jit(gmm), jax.random.normal(kw, (cfg.groups, k, n)).astype(dt)
        else:
            fn, other = jax.jit(tgmm), jax.random.normal(kw, (cfg.rows, n)).astype(dt)
        with forced(candidate):  # traced (and compiled) with this candidate
            return time_call(fn, x, other, sizes, repeats=cfg.repeats)["median_s"]
    return time_fn


def run(cfg: AutotuneConfig, run: RunDir) -> dict:
    kind = target_device()[1]
    cases = [(kn, dt, k, n) for kn in cfg.kernels for dt in cfg.dtypes for k, n in cfg.shapes]
    entries = tune(cases, SPACE, _timer(cfg))
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
