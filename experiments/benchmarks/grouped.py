"""Benchmark of the dropless grouped matmul ``[M, K] x [G, K, N]``, one product at a time.

Each of the three products of a grouped layer (``fwd``: ``x w_g``; ``dlhs``: ``dy w_g^T``;
``drhs``: ``x_g^T dy_g``, see :mod:`moejax.kernels.grouped.ragged`) is timed per
implementation in device time (:func:`moejax.bench.timing.time_device_loop`: calls inside one
jitted loop, no host dispatch between them; on a CPU, blocking calls timed from the host):

* ``dense``: one ``[M, K] x [K, N]`` matmul of the same FLOPs (the speed the grouped product
  aims at);
* ``xla``: :func:`jax.lax.ragged_dot_general`;
* ``mosaic_gpu`` / ``triton`` / ``mosaic_tpu``: tokamax's kernels (accelerators only);
* ``gmm``: the project's own Pallas kernels (accelerators only; on a CPU Pallas runs in
  interpret mode, which is no speed measurement);
* ``gmm_mgpu``: the same products as the project's Mosaic GPU kernels (a Hopper GPU, bf16 /
  f16).

``train`` times forward and both gradients through :func:`moejax.kernels.grouped.ragged.
ragged_dot`, the implementation per pass that ``dispatch="auto"`` runs on this platform;
``train[gmm]`` / ``train[gmm_mgpu]`` the same with all three passes on that own kernel, and
``train[dense]`` the same loss around one dense matmul of the same FLOPs: ``x_dense`` holds a
train row against the three dense products, ``x_dense_step`` against that dense step (the
loss's element-wise work, which reads and writes the whole ``[M, N]`` output twice, then
counted on both sides). The ``choice`` table names the fastest implementation of each pass
and whether it is the one ``ragged_dot`` uses. Every grouped product's output is checked
against a sampled float32 oracle (:func:`moejax.bench.oracles.grouped_pass_sample`) before
its time is kept: a wrong one is a row saying ``wrong: ...``, with no time; a ``train`` row's
dX and dW are checked against the same oracles as the dX and dW products.

    python -m experiments.benchmarks.grouped                 # CPU: dense and xla, small shapes
    python -m experiments.benchmarks.grouped preset=full     # accelerator: every path, bf16
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from moejax.bench.oracles import grouped_pass_sample
from moejax.bench.timing import how_timed, time_device_loop
from moejax.config import Config, config
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.kernels.grouped import ragged
from moejax.kernels.grouped.pallas_gmm import gmm, gmm_t, tgmm
from moejax.kernels.tiling import hopper_target, peak_flops, target_device
from moejax.kernels.tuning import WrongResult, check_close
from moejax.train.budget import MemoryBudgetError

Path_ = Literal["dense", "xla", "gmm", "gmm_mgpu", "mosaic_gpu", "triton", "mosaic_tpu"]
ACCELERATOR_PATHS = ("gmm", "gmm_mgpu", "mosaic_gpu", "triton", "mosaic_tpu")
OWN_PATHS = ("gmm", "gmm_mgpu")  # the project's kernels: no tokamax needed
TRAIN_PASS = "fwd+dlhs+drhs"


@config
class BenchGroupedConfig(Config):
    NONEMPTY = ("paths", "shapes")

    paths: tuple[Path_, ...] = ("dense", "xla", "gmm", "gmm_mgpu", "mosaic_gpu", "triton",
                                "mosaic_tpu")
    # (M rows, K, N, G groups)
    shapes: tuple[tuple[int, int, int, int], ...] = ((512, 64, 128, 4), (2048, 128, 256, 8))
    precision: Literal["float32", "bfloat16"] = "float32"
    iters: int = 10
    repeats: int = 3
    # rewrite this many MB between timed calls (a few times the L2), so operands come from
    # memory; 0 = no flush
    l2_flush_mb: float = 0.0
    seed: int = 0

    def validate(self):
        r = self._require
        r(all(len(s) == 4 and min(s) >= 1 for s in self.shapes),
          f"shapes={self.shapes}: each must be (M, K, N, G) >= 1")
        r(self.iters >= 1 and self.repeats >= 1, "iters and repeats must be >= 1")
        r(self.l2_flush_mb >= 0, f"l2_flush_mb={self.l2_flush_mb} must be >= 0")


def make_config(preset: str) -> BenchGroupedConfig:
    if preset == "quick":
        return BenchGroupedConfig()
    return BenchGroupedConfig(
        shapes=((4096, 256, 704, 8), (16384, 1024, 1408, 16), (65536, 2048, 1408, 64)),
        precision="bfloat16", iters=20, repeats=5, l2_flush_mb=256)


def _unavailable(path: str) -> str | None:
    platform = target_device()[0]
    if path in ACCELERATOR_PATHS and platform not in ("cuda", "rocm", "tpu"):
        return f"not measured: needs an accelerator ({platform} runs Pallas in interpret mode)"
    if path in ("mosaic_gpu", "triton", "gmm_mgpu") and platform == "tpu" or \
            path == "mosaic_tpu" and platform != "tpu":
        return f"not measured: not a {platform} kernel"
    if path == "gmm_mgpu" and not hopper_target():
        return "not measured: needs a Hopper GPU (wgmma)"
    if path != "dense" and not ragged.AVAILABLE and path not in OWN_PATHS:
        return "not measured: tokamax is not installed"
    return None


def _pass_fn(path: str, which: str):
    """``(a, b, group_sizes) -> product`` of pass ``which`` with implementation ``path``."""
    if path == "dense":
        return {"fwd": lambda x, w, gs: x @ w[0],
                "dlhs": lambda dy, w, gs: dy @ w[0].T,
                "drhs": lambda x, dy, gs: (x.T @ dy)[None]}[which]
    if path == "gmm":
        return {"fwd": gmm, "dlhs": gmm_t, "drhs": tgmm}[which]
    return lambda a, b, gs: ragged.ragged_pass(which, a, b, gs, path, fallback=False)


def _train_fn(kernel: str):
    """Forward and both gradients through :func:`~moejax.kernels.grouped.ragged.ragged_dot`
    with its ``kernel`` choice (``"dense"``: one dense matmul of the same FLOPs, ``x w_0``,
    under the same loss: the train rows' like-for-like reference)."""
    def product(x, w, gs):
        if kernel == "dense":
            return x @ w[0]
        return ragged.ragged_dot(x, w, gs, kernel=kernel)

    def fn(x, w, gs, ct):
        def loss(x, w):
            return jnp.sum(product(x, w, gs).astype(jnp.float32) * ct)
        return jax.value_and_grad(loss, (0, 1))(x, w)
    return fn


def _train_paths(cfg) -> tuple[str, ...]:
    """``train[dense]`` (where ``cfg.paths`` has dense), ``train`` (ragged_dot's measured
    choice) and ``train[K]`` for each own kernel ``K`` of ``cfg.paths`` that runs here (all
    three passes on it, at every size)."""
    return (*(("train[dense]",) if "dense" in cfg.paths else ()), "train",
            *(f"train[{p}]" for p in cfg.paths if p in OWN_PATHS and _unavailable(p) is None))


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"


def _time(fn, *args, cfg, flops: float, path: str = "", oracles=()
          ) -> tuple[float | None, str]:
    """Device time per call of ``fn`` (``flops`` of work), or ``None`` and why not. A kernel
    path (``ACCELERATOR_PATHS``) that fails to compile or run is recorded as failed, so the
    other paths' rows are kept; the dense and XLA products fail the run. ``oracles``:
    ``(pick, (take, want))`` pairs, ``(take, want)`` of
    :func:`moejax.bench.oracles.grouped_pass_sample` for the part ``pick(output)`` of the
    output: an output whose sampled entries differ from one is recorded as wrong, with no
    time. A time inside the timing's noise, or one that puts the rate above the device's
    peak (:func:`moejax.kernels.tiling.peak_flops`: the L2 rewrite subtracted from a call much
    shorter than it), is unresolved: no time, and the choice does not count it."""
    try:
        timed = time_device_loop(fn, *args, iters=cfg.iters, repeats=cfg.repeats,
                                 flush_bytes=int(cfg.l2_flush_mb * 2**20),
                                 what=f"the {path or 'timed'} grouped matmul",
                                 fix="smaller shapes (the shapes key, (M, K, N, G) each)")
        for pick, (take, want) in oracles:
            check_close(take(pick(timed["output"])), want, args[0].dtype)
        s, noise = timed["median_s"], timed["noise_s"]
        peak = peak_flops(jax.devices()[0].device_kind, args[0].dtype)
        measured = (f"unresolved: {s * 1e3:.4f} ms (± {noise * 1e3:.4f} ms) once the L2 "
                    f"flush's {timed['flush_s'] * 1e3:.4f} ms is subtracted")
        if s <= noise:
            return None, measured + ": inside the timing's noise"
        if peak and flops / s > peak:
            return None, (measured + f": {flops / s / 1e12:.0f} TFLOP/s, above the device's "
                          f"{peak / 1e12:.0f}")
        return s, ""
    except WrongResult as err:
        return None, f"wrong: {err}"
    except MemoryBudgetError as err:  # XLA's estimate, before the call: the next shape runs
        return None, f"out of device memory: {_first_line(err)}"
    except jax.errors.JaxRuntimeError as err:  # xla's dense expansion on a large shape
        if "RESOURCE_EXHAUSTED" in str(err):
            return None, "out of device memory"
        if path not in ACCELERATOR_PATHS:
            raise
        return None, f"failed: {_first_line(err)}"
    except (NotImplementedError, ValueError, KeyError) as err:  # not this dtype / shape, or
        # an implementation this tokamax build lacks (its Triton kernels need Pallas Triton)
        return None, f"not taken: {_first_line(err)}"
    except Exception as err:  # a kernel that does not compile or run here  # noqa: BLE001
        if path not in ACCELERATOR_PATHS:
            raise
        return None, f"failed: {_first_line(err)}"


def bench(cfg: BenchGroupedConfig, key) -> list[dict]:
    dt = jnp.dtype(cfg.precision)
    rows = []
    jobs = [(s, p) for s in cfg.shapes for p in (*cfg.paths, *_train_paths(cfg))]
    oracles: dict = {}  # per shape and pass: the sampled float32 oracle
    for (M, K, N, G), path in tqdm(jobs, desc="grouped matmul", leave=False):
        kx, kw, kg, kc = jax.random.split(jax.random.fold_in(key, M * K + N), 4)
        x = jax.random.normal(kx, (M, K)).astype(dt)
        w = (jax.random.normal(kw, (G, K, N)) / np.sqrt(K)).astype(dt)
        gs = jnp.bincount(jax.random.randint(kg, (M,), 0, G), length=G).astype(jnp.int32)
        dy = jax.random.normal(kc, (M, N)).astype(dt)
        base = {"M": M, "K": K, "N": N, "G": G, "path": path}
        train = path.startswith("train")
        why = None if train else _unavailable(path)
        if train and path != "train[dense]" and not ragged.AVAILABLE:
            why = "not measured: tokamax is not installed"
        if why:
            rows.append({**base, "note": why})
            continue
        if train:  # its gradients checked against the dX and dW products' oracles
            kernel = path[len("train["):-1] if path != "train" else "measured"
            checks = [(lambda out, i=i: out[1][i], oracles[(M, K, N, G, which)])
                      for i, which in enumerate(("dlhs", "drhs"))
                      if (M, K, N, G, which) in oracles and kernel != "dense"]
            # the dense step gets w[:1] (its gradient w_0's alone, not zeros for every group)
            s, note = _time(_train_fn(kernel), x, w[:1] if kernel == "dense" else w, gs,
                            dy.astype(jnp.float32), cfg=cfg, flops=3 * 2 * M * K * N,
                            path=kernel, oracles=checks)
            rows.append({**base, "pass": TRAIN_PASS, "ms": s and s * 1e3,
                         "tflops": s and 3 * 2 * M * K * N / s / 1e12, "note": note})
            continue
        operands = {"fwd": (x, w), "dlhs": (dy, w), "drhs": (x, dy)}
        for which, (a, b) in operands.items():
            checks = []
            if path != "dense":  # the grouped products are checked before they are timed
                case = (M, K, N, G, which)
                if case not in oracles:
                    oracles[case] = grouped_pass_sample(which, a, b, gs, jax.random.fold_in(
                        kc, ragged.PASSES.index(which)))
                checks = [(lambda out: out, oracles[case])]
            s, note = _time(_pass_fn(path, which), a, b, gs, cfg=cfg, flops=2 * M * K * N,
                            path=path, oracles=checks)
            rows.append({**base, "pass": which, "ms": s and s * 1e3,
                         "tflops": s and 2 * M * K * N / s / 1e12, "note": note})
    dense = {(r["M"], r["K"], r["N"], r["pass"]): r["ms"] for r in rows
             if r["path"] in ("dense", "train[dense]") and r.get("ms")}
    for r in rows:  # a train row against the three dense products together, and against
        # the dense train step (the same loss around one dense matmul of the same FLOPs)
        shape = (r["M"], r["K"], r["N"])
        passes = ragged.PASSES if r.get("pass") == TRAIN_PASS else (r.get("pass"),)
        refs = [dense.get((*shape, p)) for p in passes]
        if r.get("ms") and all(refs):
            r["x_dense"] = r["ms"] / sum(refs)
        step = dense.get((*shape, TRAIN_PASS))
        if r.get("ms") and step and r.get("pass") == TRAIN_PASS:
            r["x_dense_step"] = r["ms"] / step
    return rows


def choice(rows: list[dict]) -> list[dict]:
    """Per shape and pass: the fastest grouped implementation (not ``dense``) and the one
    :func:`~moejax.kernels.grouped.ragged.ragged_dot` uses on this platform
    (:func:`~moejax.kernels.grouped.ragged.implementation`), or the own ``gmm`` where
    tokamax's kernel declines the call (``NotImplementedError``, e.g. float32 on
    Mosaic GPU), as :func:`~moejax.kernels.grouped.ragged.ragged_pass` falls back; ``used``
    ends in ``WRONG`` where that implementation's output failed the oracle."""
    platform = target_device()[0]
    out, shapes = [], sorted({(r["M"], r["K"], r["N"], r["G"]) for r in rows})
    for M, K, N, G in shapes:
        for which in ragged.PASSES:
            here = [r for r in rows if (r["M"], r["K"], r["N"], r["G"]) == (M, K, N, G)
                    and r.get("pass") == which]
            got = [r for r in here if r.get("ms") and r["path"] != "dense"]
            if not got:
                continue
            best = min(got, key=lambda r: r["ms"])
            impl = planned = ragged.implementation(platform, which, M, K, N)
            declined = any(r["path"] == impl and r.get("note", "").startswith(
                "not taken: NotImplementedError") for r in here)
            if declined:  # ragged_pass runs the own kernel where tokamax's declines the call
                impl = "gmm"
            mine = next((r for r in got if r["path"] == impl), None)
            wrong = any(r["path"] == impl and r.get("note", "").startswith("wrong")
                        for r in here)
            out.append({"M": M, "K": K, "N": N, "G": G, "pass": which,
                        "fastest": best["path"], "fastest_ms": best["ms"],
                        "used": impl + (f" ({planned} declines)" if declined else "")
                        + (" WRONG" if wrong else ""),
                        "used_ms": mine and mine["ms"],
                        "used_x_fastest": mine and mine["ms"] / best["ms"]})
    return out


def run(cfg: BenchGroupedConfig, run: RunDir) -> dict:
    dev = jax.devices()[0]
    where = f"{dev.platform} ({dev.device_kind})"
    rows = bench(cfg, jax.random.key(cfg.seed))
    run.table("passes", rows, title=(
        f"Grouped matmul [M, K] x [G, K, N], one product per row, {cfg.precision}, "
        f"{how_timed(cfg.iters, cfg.repeats, bool(cfg.l2_flush_mb))}, on {where}; x_dense = "
        "time over one dense matmul of the same FLOPs (train: over the three); train = forward "
        "and both gradients through moejax's ragged_dot (train[K]: all three on kernel K), "
        "under a loss sum(y * ct); train[dense]: the same loss around one dense matmul of the "
        "same FLOPs, and x_dense_step = a train row's time over it (the loss's own element-wise "
        "work on both sides)"))
    picks = choice(rows)
    run.table("choice", picks, title=(
        f"Fastest implementation per pass against the one ragged_dot uses on {where}"))
    off = [p for p in picks if p["used_x_fastest"] and p["used_x_fastest"] > 1.05]
    train = [r for r in rows if r["path"] == "train" and r.get("ms")]
    headline = "; ".join(
        f"{r['M']}x{r['K']}x{r['N']} G={r['G']}: train {r['ms']:.3f} ms = "
        f"{r['tflops']:.3g} TFLOP/s" + (f", {r['x_dense']:.2f}x dense" if r.get("x_dense")
                                        else "")
        + (f", {r['x_dense_step']:.2f}x the dense step" if r.get("x_dense_step") else "")
        for r in train) or "train: not measured"
    wrong = [p for p in picks if p["used"].endswith("WRONG")]
    if wrong:
        run.note(f"- **ragged_dot's implementation failed the oracle** in {len(wrong)} (shape, "
                 "pass) cases: " + ", ".join(f"{p['M']}x{p['K']}x{p['N']} {p['pass']} "
                                             f"({p['used']})" for p in wrong))
    run.note(f"- {len(off)} of {len(picks)} (shape, pass) cases run more than 5% slower than "
             "the fastest implementation measured" + (": " + ", ".join(
                 f"{p['M']}x{p['K']}x{p['N']} {p['pass']} ({p['used']} "
                 f"{p['used_x_fastest']:.2f}x {p['fastest']})" for p in off) if off else ""))
    return {"headline": f"{headline} ({where})"}


STUDY = Study(
    "bench_grouped", make_config, run,
    # smoke=true: one call per loop, and the accelerator shapes' smaller two (on a CPU the
    # largest one's jax.lax.ragged_dot_general expands to 17 GB)
    smoke=("iters=1", "repeats=1", "shapes=((4096,256,704,8),(16384,1024,1408,16))"),
    # float32, which tokamax's Mosaic GPU kernels do not take: the own gmm against
    # jax.lax.ragged_dot and dense there (on a GPU: preset=full variant=f32)
    variants=(("f32", ("precision=float32",)),),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
