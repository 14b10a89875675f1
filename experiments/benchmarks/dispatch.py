"""Benchmark: steady train-step time and tokens/s of an MoE LM for each dispatch path, plus
(a one-run table of ratios) one MoE block's fwd+bwd per path against a PyTorch expert
loop and against the FLOP bound at this machine's matmul rate, and each delta operation over a
SmolLM2-135M-shaped tree against a jitted ``x * 2`` and a numpy copy of the same bytes. The
FLOP bound is taken at the faster of XLA's and numpy's measured matmul rates on the CPU, at
XLA's matmul rate in device time on an accelerator; the block is
timed again, last, after :func:`moejax.kernels.host_memory.retain_freed_memory` (process-wide).
``make bench`` runs it with glibc's huge-page malloc on (:mod:`moejax.kernels.host_memory`); the
tables' titles say whether it was. On a GPU or TPU one more step per path runs under the
profiler (``profile``): the device's busy fraction of the step and its longest kernels
(``step_kernels``), so a path's distance to another reads off the kernels that make it.

Default model: 4 layers, d 256, 8 experts, top-2, SwiGLU experts of width 704
(~18M params), seq 128, batch 16, on the CPython-stdlib byte corpus. Each path runs
``warmup`` untimed steps (compilation) and then ``steps`` timed steps
(``block_until_ready`` after each). The capacity path's dropped-assignment fraction is
reported too. ``attentions=(auto,jax)`` times each path's step on the flash kernel and on
XLA's attention in the same run, the headline giving the ratio of the two steps.

On a GPU or TPU (an accelerator's variants): ``xla_attention`` is the full preset on XLA's
attention; ``train_step`` is the full preset's train step alone, on the project's grouped
matmul (``gmm``), timed on the flash kernel and on XLA's attention, without the block and
delta tables.

    make bench                                 # = the next line, malloc huge pages on
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python -m experiments.benchmarks.dispatch
    python -m experiments.benchmarks.dispatch preset=full           # GPU: d 1024, seq 2048
    python -m experiments.benchmarks.dispatch preset=full variant=train_step   # GPU
    python -m experiments.benchmarks.dispatch paths=capacity,ragged steps=20
    python -m experiments.benchmarks.dispatch "paths=(capacity,ragged,gmm)"   # gmm: GPU only
    pip install torch   # optional: fills the PyTorch peer row (never a moejax dependency;
                        # on a CPU-only machine: pip install "torch==2.13.0+cpu")
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from flax import nnx

from moejax.bench.cpu import delta_op_times, tree_of_shapes
from moejax.bench.moe_block import BlockShape, block_table, block_timer, software_versions
from moejax.bench.profile import fused_ops, top_kernel_rows
from moejax.bench.timing import kernel_unavailable, time_call
from moejax.bench.train_steps import time_train_steps
from moejax.capture import active_capture, record_step
from moejax.config import Config, config
from moejax.data.corpora import corpus_bytes
from moejax.data.lm_batches import WindowBatches
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.kernels.host_memory import malloc_huge_pages
from moejax.kernels.moe_ffn.api import PATHS, describe_dispatch
from moejax.kernels.moe_ffn.jnp_paths import DispatchMethod
from moejax.nn.decoder import DecoderLM, param_shapes, smollm2_135m_config
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.pytree import count_params
from moejax.train.budget import compile_fitting
from moejax.train.hparams import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import init_train_state, lm_loss_fn, make_train_step

Path_ = DispatchMethod


@config
class BenchConfig(Config):
    NONEMPTY = ("paths",)

    model: MoELMConfig = MoELMConfig(
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=704, capacity_factor=1.25),
    )
    paths: tuple[DispatchMethod, ...] = ("dense", "capacity", "ragged", "grouped", "bucketed",
                                         "host", "host_capacity")
    batch_size: int = 16
    seq_len: int = 128
    warmup: int = 2
    steps: int = 8
    precision: Literal["float32", "bfloat16"] = "float32"
    # the attentions each path's train step is timed on in this run (e.g. (auto, jax): the
    # flash kernel against XLA's attention, one after the other); () = model.attention alone
    attentions: tuple[Literal["auto", "flash", "jax", "einsum"], ...] = ()
    # one MoE block, fwd+bwd: tokens, d_model, expert width, experts, k (block_paths=():
    # none)
    block_tokens: int = 2048
    block_d: int = 256
    block_f: int = 1024
    block_experts: int = 8
    block_top_k: int = 2
    block_repeats: int = 10
    block_paths: tuple[Literal["capacity", "grouped", "bucketed", "host", "host_capacity",
                               "ragged", "dense"], ...] = (
        "capacity", "grouped", "bucketed", "host", "host_capacity", "ragged", "dense")
    # measure the block again after moejax.kernels.host_memory.retain_freed_memory() (glibc keeps
    # freed memory: fewer page faults; process-wide, so it runs last)
    block_retain_memory: bool = True
    # delta ops over a SmolLM2-135M-shaped tree (134.5M float32 params); "none" = skip
    delta_tree: Literal["smollm2_135m", "tiny", "none"] = "smollm2_135m"
    # on a GPU or TPU, one more step per path traced by the profiler: the device's busy
    # fraction of the step and its longest kernels (table "step_kernels")
    profile: bool = True
    profile_top: int = 8

    def unread_fields(self) -> dict[str, str]:
        unread = self._read_only_with("profile", {"profile_top": (True,)})
        if not self.block_paths:
            unread.update({f: "read only with block_paths (this config has block_paths=(): "
                              "no MoE block timed)" for f in (
                "block_tokens", "block_d", "block_f", "block_experts", "block_top_k",
                "block_repeats", "block_retain_memory")})
        return unread

    def validate(self):
        allowed = ("auto", *PATHS)
        bad = [p for p in self.paths if p not in allowed]
        self._require(not bad, f"paths={bad} unknown; allowed: {', '.join(allowed)}")
        self._require(self.steps >= 1 and self.warmup >= 1, "steps and warmup must be >= 1")
        self._require(self.profile_top >= 1, f"profile_top={self.profile_top} must be >= 1")
        self._require(self.block_top_k <= self.block_experts,
                      f"block_top_k={self.block_top_k} must be <= block_experts="
                      f"{self.block_experts}")


def make_config(preset: str) -> BenchConfig:
    if preset == "quick":
        return BenchConfig()
    # a train step at a realistic size: d 1024, 16 experts of width 1408, seq 2048, bf16
    cfg = BenchConfig()
    return cfg.replace(
        model=cfg.model.replace(d_model=1024, n_heads=8, n_kv_heads=8,
                                moe=cfg.model.moe.replace(n_experts=16, d_expert=1408)),
        paths=("auto", "capacity", "tokamax", "gmm", "bucketed", "ragged", "dense"),
        batch_size=8, seq_len=2048, warmup=2, steps=10, precision="bfloat16")


def _build_step(cfg: BenchConfig, path: str, source):
    """``(graphdef, state, step, n_params)`` of the LM on dispatch ``path``; inside
    :func:`moejax.capture.capture_steps` the step is recorded at its real shapes."""
    mcfg = cfg.model.replace(
        moe=cfg.model.moe.replace(dispatch=path),
        max_seq_len=max(cfg.seq_len, cfg.model.max_seq_len),
        dtype=cfg.precision,
    )
    model = DecoderLM(mcfg.decoder_config(), rngs=nnx.Rngs(0))
    what = path if mcfg.attention == "auto" else f"{path}, attention {mcfg.attention}"
    tcfg = TrainConfig(
        steps=cfg.warmup + cfg.steps,
        batch_size=cfg.batch_size,
        lr=1e-3,
        warmup_steps=0,
        schedule="constant",
        precision=cfg.precision,
    )
    schedule = make_schedule(tcfg)
    tx = make_optimizer(tcfg, schedule)
    graphdef, state = init_train_state(model, tx, seed=0)
    step = make_train_step(graphdef, lm_loss_fn, tx, tcfg, schedule=schedule, donate=True)
    record_step(f"train step ({what})", step, state, source.batch(0), tcfg, program=path)
    return graphdef, state, step, count_params(state.params)


def _bench_path(cfg: BenchConfig, path: str, source) -> dict:
    graphdef, state, step, n_params = _build_step(cfg, path, source)
    t0 = time.perf_counter()
    if active_capture() is None:  # (a captured step is recorded, not compiled here)
        step = compile_fitting(  # the estimate before the first call
            step, state, source.batch(0), what=f"the {path} train step",
            fix=f"lower batch_size (now {cfg.batch_size}) or seq_len (now {cfg.seq_len}), "
            "or the model's d_model / moe.d_expert / n_layers")
    fitted_s = time.perf_counter() - t0
    timed = time_train_steps(step, state, source.batch, warmup=cfg.warmup, steps=cfg.steps,
                             profile=cfg.profile, desc=f"bench {path}")
    state, kernels = timed.state, timed.kernels
    # Dropped (token, expert) assignments, measured on one more batch with the trained params.
    trained = nnx.merge(graphdef, state.params, state.rest)
    _, aux = trained(source.batch(cfg.warmup + cfg.steps)["inputs"], train=False)
    dropped = [float(a["dropped_fraction"]) for a in aux["layers"] if "dropped_fraction" in a]
    step_s = timed.median_s
    tokens = cfg.batch_size * cfg.seq_len
    return {
        "path": path,
        "attention": cfg.model.attention,
        "runs": describe_dispatch(path),
        "params": n_params,
        "compile_plus_first_step_s": fitted_s + timed.compile_s,
        "step_s_median": step_s,
        "step_s_min": float(np.min(timed.times_s)),
        "tokens_per_s": tokens / step_s,
        "final_ce": float(timed.metrics["ce"]),
        "dropped_fraction": float(np.mean(dropped)),
        **({} if kernels is None else {
            "kernels_per_step": kernels.launches, "device_busy": kernels.busy_s / step_s,
            "kernels": kernels.by_name,
            # what each kernel fuses, from the program compile_fitting compiled
            **({"fuses": fused_ops(step.as_text())} if hasattr(step, "as_text") else {})}),
    }


def run(cfg: BenchConfig, run: RunDir) -> dict:
    timed = _train_steps(cfg, run)
    block, rate = _block_table(cfg, run)
    summary_delta = _delta_ops(cfg, run)
    blk = {r["impl"]: r for r in block}
    attentions = _attentions(cfg)
    several = len(attentions) > 1
    if timed:
        best = max(timed, key=lambda r: r["tokens_per_s"])
        first = [r for r in timed if r["attention"] == attentions[0]]
        head = (f"fastest path: {_label(best, several)} at {best['tokens_per_s']:.0f} "
                f"tokens/s ({best['step_s_median'] * 1e3:.3g} ms/step)"
                f"{_attention_ratios(timed, attentions)}{_ratios(first, blk)}")
    else:
        head = f"no train step timed here: {'; '.join(f'{p}: {n}' for p, n in _untimed(cfg))}"
    return {
        "headline": head,
        **({"matmul_gflops": round(rate, 1)} if block else {}),
        "malloc_huge_pages": malloc_huge_pages(),
        **{f"block {k}": round(r["ms"], 1) for k, r in blk.items() if "ms" in r},
        **{f"block {k}, retained": round(r["ms_retained"], 1) for k, r in blk.items()
           if "ms_retained" in r},
        **{f"delta {k} vs x*2": v for k, v in summary_delta.items()},
        **{(f"{r['path']}_ms" if r["attention"] == attentions[0] else
            f"{r['path']}_{r['attention']}_ms"): round(r["step_s_median"] * 1e3, 1)
           for r in timed},
    }


def _attention_ratios(timed: list[dict], attentions: Sequence[str]) -> str:
    """The headline's step time on each further attention over the first's, per path that
    both timed (e.g. XLA's attention over the flash kernel's: above 1, the kernel is
    faster)."""
    by = {(r["path"], r["attention"]): r["step_s_median"] for r in timed}
    parts = []
    for other in attentions[1:]:
        paths = [p for p, a in by if a == other and (p, attentions[0]) in by]
        if paths:
            parts.append(f"train step on {other} / on {attentions[0]}: " + ", ".join(
                f"{p} {by[p, other] / by[p, attentions[0]]:.2f}" for p in paths))
    return "".join(f"; {t}" for t in parts)


def _untimed(cfg: BenchConfig) -> list[tuple[str, str]]:
    """``(path, why)`` of each path this machine cannot time."""
    return [(p, why) for p in cfg.paths if (why := kernel_unavailable(p))]


def _train_steps(cfg: BenchConfig, run: RunDir) -> list[dict]:
    """The train-step table and plot, one row per dispatch path; the timed rows."""
    source = WindowBatches(corpus_bytes("stdlib_code", "train", max_bytes=4_000_000),
                           batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=0)
    rows = []
    for p in cfg.paths:
        why = kernel_unavailable(p)
        for attention in _attentions(cfg):
            c = cfg.replace(model=cfg.model.replace(attention=attention))
            if why and active_capture() is not None:  # ahead of time: recorded, not timed
                _build_step(c, p, source)
            rows.append({"path": p, "attention": attention, "note": why} if why
                        else _bench_path(c, p, source))
    dev = jax.devices()[0]
    # takes them out of the rows
    top = top_kernel_rows(rows, cfg.profile_top, ("path", "attention"))
    run.table("dispatch", rows, title=(
        f"Train step, {cfg.model.n_layers}-layer d={cfg.model.d_model} "
        f"{cfg.model.moe.n_experts}-expert top-{cfg.model.moe.top_k} MoE LM, seq {cfg.seq_len}, "
        f"batch {cfg.batch_size}, {cfg.precision}, attention {', '.join(_attentions(cfg))} "
        f"(auto: the platform's flash kernel, XLA's on a CPU; jax: XLA's), on {dev.platform} "
        f"({dev.device_kind}, {jax.device_count()} device(s))"))
    if top:
        run.table("step_kernels", top, title=(
            f"Where one train step's device time goes, per dispatch path: its {cfg.profile_top} "
            "longest kernels (profiler; device_busy in the table above: the kernels' time over "
            f"the step's wall time) on {dev.platform} ({dev.device_kind})"))
    timed = [r for r in rows if "tokens_per_s" in r]
    if timed:
        several = len(_attentions(cfg)) > 1
        run.bar_plot("tokens_per_s", [_label(r, several) for r in timed],
                     [r["tokens_per_s"] for r in timed], ylabel="tokens / s",
                     title="Train throughput by dispatch path")
    return timed


def _attentions(cfg: BenchConfig) -> tuple[str, ...]:
    return cfg.attentions or (cfg.model.attention,)


def _label(row: dict, several: bool) -> str:
    """A timed row's name: its path, and its attention where the run timed several."""
    return f"{row['path']} ({row['attention']})" if several else row["path"]


def _block_table(cfg: BenchConfig, run: RunDir) -> tuple[list[dict], float]:
    """One MoE block forward + backward per implementation against PyTorch and the FLOP
    bound (again with freed memory retained, when asked); the rows and the matmul rate
    (none, without ``block_paths``)."""
    if not cfg.block_paths:
        return [], 0.0
    shape = BlockShape(cfg.block_tokens, cfg.block_d, cfg.block_f, cfg.block_experts,
                       cfg.block_top_k)
    block, columns, rate = block_table(shape, cfg.block_paths, cfg.block_repeats,
                                       cfg.block_retain_memory)
    how = ("wall time per call" if block_timer() is time_call else
           "device time per call (20 calls in one jitted loop)")
    retained = ("; *_retained: measured again after moejax.kernels.host_memory."
                "retain_freed_memory()" if "ms_retained" in columns else "")
    run.table("block", block, title=f"One MoE block fwd+bwd: {cfg.block_tokens} tokens, d "
              f"{cfg.block_d}, {cfg.block_experts} SwiGLU experts of width {cfg.block_f}, "
              f"top-{cfg.block_top_k}, float32 operands at each library's default matmul "
              f"precision, {how}, median of {cfg.block_repeats} ({software_versions()}); "
              "PyTorch: wall time of a step ending in a device synchronisation"
              f"{retained}", columns=columns + ["note"])
    return block, rate


def _delta_ops(cfg: BenchConfig, run: RunDir) -> dict:
    """The delta ops over a SmolLM2-shaped tree against ``x * 2``; ``{op: ratio}``."""
    if cfg.delta_tree == "none":
        return {}
    tree = tree_of_shapes(param_shapes(smollm2_135m_config(tiny=cfg.delta_tree == "tiny")))
    n = sum(x.size for x in jax.tree.leaves(tree))
    delta = delta_op_times(tree)
    run.table("delta_ops", delta, title=f"Delta ops over a {n / 1e6:.1f}M-parameter "
              f"float32 tree ({cfg.delta_tree}), 8 bytes per parameter "
              f"({software_versions()})", columns=["op", "seconds", "min_seconds", "gb_s",
                                           "vs_x2", "vs_numpy_copy"])
    return {r["op"]: round(r["vs_x2"], 2) for r in delta}


def _ratios(timed: list[dict], blk: dict) -> str:
    """The headline's comparisons: each dropless path's step against the capacity step, and
    the MoE block against its FLOP bound and PyTorch."""
    ref = {r["path"]: r for r in timed}
    extra = ""
    dropless = [p for p in DROPLESS if p in ref]
    if "capacity" in ref and dropless:
        cap = ref["capacity"]["step_s_median"]
        extra = "; dropless step / capacity step: " + ", ".join(
            f"{p} {ref[p]['step_s_median'] / cap:.2f}" for p in dropless)
    for name in ("grouped (dropless)", "host (dropless, fused)", "capacity cf=1.25",
                 "host_capacity cf=1.25 (fused)"):
        g = blk.get(name)
        if g is None:
            continue
        extra += (f"; MoE block: {name} {g['ms']:.3g} ms = {g['vs_flop_bound']:.2f}x the "
                  f"FLOP bound" + (f", {g['vs_torch']:.2f}x PyTorch's time"
                                   if "vs_torch" in g else ""))
        if "ms_retained" in g:
            extra += (f" (freed memory retained: {g['ms_retained']:.3g} ms = "
                      f"{g['vs_flop_bound_retained']:.2f}x the bound" +
                      (f", {g['vs_torch_retained']:.2f}x PyTorch's time)"
                       if "vs_torch_retained" in g else ")"))
    return extra


# the dropless one-device paths, the default first
DROPLESS = ("auto", "tokamax", "gmm", "grouped", "bucketed", "ragged", "host")


# the train step alone on one dropless path (the project's grouped-matmul kernel), on the
# flash kernel and on XLA's attention: what the kernel changes, in a fraction of the full
# benchmark's time
TRAIN_STEP = ("paths=(gmm,)", "attentions=(auto,jax)", "block_paths=()", "delta_tree=none")

STUDY = Study(
    "bench_dispatch", make_config, run,
    smoke=("batch_size=4", "warmup=1", "steps=2", "block_repeats=1"),
    # the full preset's 4 layers do not fit a 24 GB host with the dense paths on the CPU (XLA's
    # ragged_dot and the dense oracle compute every expert for every token): its smoke run takes
    # one layer, every other size full
    smoke_depth=("model.n_layers=1",),
    derived_keys=(("model.moe.dispatch", "each of paths"), ("model.dtype", "precision")),
    # on a GPU or TPU: every path on XLA's attention instead of the flash kernel, and the
    # train step alone on the flash kernel and on XLA's
    accelerator_variants=(("xla_attention", ("model.attention=jax",)),
                          ("train_step", TRAIN_STEP)),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
