"""Benchmark: steady train-step time and tokens/s of an MoE LM for each dispatch path.

Default model: 4 layers, d 256, 8 experts, top-2, SwiGLU experts of width 704
(~18M params), seq 128, batch 16, on the CPython-stdlib byte corpus. Each path runs
``warmup`` untimed steps (compilation) and then ``steps`` timed steps
(``block_until_ready`` after each). The capacity path's dropped-assignment fraction is
reported too.

    python -m experiments.bench_dispatch
    python -m experiments.bench_dispatch preset=full           # GPU: batch 64, seq 512
    python -m experiments.bench_dispatch paths=capacity,ragged steps=20
    python -m experiments.bench_dispatch "paths=(capacity,ragged,gmm)"   # gmm: GPU only
"""

from __future__ import annotations

import time
from typing import Literal

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from moejax.bench import kernel_unavailable
from moejax.config import Config, config
from moejax.data.corpora import corpus_bytes
from moejax.data.lm_batches import WindowBatches
from moejax.experiment import main
from moejax.nn.decoder import DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.ops.dispatch import DispatchMethod
from moejax.pytree import count_params
from moejax.results import RunDir
from moejax.train.optim import TrainConfig, make_optimizer, make_schedule
from moejax.train.step import init_train_state, lm_loss_fn, make_train_step

NAME = "bench_dispatch"
Path_ = DispatchMethod


@config
class BenchConfig(Config):
    model: MoELMConfig = MoELMConfig(
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=704, capacity_factor=1.25),
    )
    paths: tuple[DispatchMethod, ...] = ("dense", "capacity", "ragged", "grouped")
    batch_size: int = 16
    seq_len: int = 128
    warmup: int = 2
    steps: int = 8
    precision: Literal["float32", "bfloat16"] = "float32"

    def validate(self):
        allowed = ("dense", "capacity", "ragged", "gmm", "grouped")
        bad = [p for p in self.paths if p not in allowed]
        self._require(not bad, f"paths={bad} unknown; allowed: {', '.join(allowed)}")
        self._require(self.steps >= 1 and self.warmup >= 1, "steps and warmup must be >= 1")


def make_config(preset: str) -> BenchConfig:
    if preset == "quick":
        return BenchConfig()
    return BenchConfig(batch_size=64, seq_len=512, warmup=5, steps=50, precision="bfloat16")


def _bench_path(cfg: BenchConfig, path: str, source) -> dict:
    mcfg = cfg.model.replace(
        moe=cfg.model.moe.replace(dispatch=path),
        max_seq_len=max(cfg.seq_len, cfg.model.max_seq_len),
        dtype=cfg.precision,
    )
    model = DecoderLM(mcfg.decoder_config(), rngs=nnx.Rngs(0))
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
    n_params = count_params(state.params)
    step = make_train_step(graphdef, lm_loss_fn, tx, tcfg, schedule=schedule, donate=True)
    t0 = time.perf_counter()
    for i in range(cfg.warmup):
        state, m = step(state, source.batch(i))
        jax.block_until_ready(m["loss"])
        if i == 0:
            compile_s = time.perf_counter() - t0
    times, losses = [], []
    for i in tqdm(range(cfg.steps), desc=f"bench {path}", leave=False):
        batch = source.batch(cfg.warmup + i)
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
        losses.append(float(m["ce"]))
    # Dropped (token, expert) assignments, measured on one more batch with the trained params.
    trained = nnx.merge(graphdef, state.params, state.rest)
    _, aux = trained(source.batch(cfg.warmup + cfg.steps)["inputs"], train=False)
    dropped = [float(a["dropped_fraction"]) for a in aux["layers"] if "dropped_fraction" in a]
    step_s = float(np.median(times))
    tokens = cfg.batch_size * cfg.seq_len
    return {
        "path": path,
        "params": n_params,
        "compile_plus_first_step_s": compile_s,
        "step_s_median": step_s,
        "step_s_min": float(np.min(times)),
        "tokens_per_s": tokens / step_s,
        "final_ce": losses[-1],
        "dropped_fraction": float(np.mean(dropped)),
    }


def run(cfg: BenchConfig, run: RunDir) -> dict:
    source = WindowBatches(
        corpus_bytes("stdlib_code", "train", max_bytes=4_000_000),
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        seed=0,
    )
    rows = [{"path": p, "note": why} if (why := kernel_unavailable(p)) else
            _bench_path(cfg, p, source) for p in cfg.paths]
    dev = jax.devices()[0]
    title = (
        f"Train step, {cfg.model.n_layers}-layer d={cfg.model.d_model} "
        f"{cfg.model.moe.n_experts}-expert top-{cfg.model.moe.top_k} MoE LM, seq {cfg.seq_len}, "
        f"batch {cfg.batch_size}, {cfg.precision}, on {dev.platform} ({dev.device_kind}, "
        f"{jax.device_count()} device(s))"
    )
    run.table("dispatch", rows, title=title)
    timed = [r for r in rows if "tokens_per_s" in r]
    run.bar_plot(
        "tokens_per_s",
        [r["path"] for r in timed],
        [r["tokens_per_s"] for r in timed],
        ylabel="tokens / s",
        title="Train throughput by dispatch path",
    )
    best = max(timed, key=lambda r: r["tokens_per_s"])
    ref = {r["path"]: r for r in timed}
    extra = ""
    if "capacity" in ref and "ragged" in ref:
        ratio = ref["ragged"]["step_s_median"] / ref["capacity"]["step_s_median"]
        extra = f"; capacity is {ratio:.2f}x faster than ragged_dot"
    return {
        "headline": f"fastest path: {best['path']} at {best['tokens_per_s']:.0f} tokens/s "
        f"({best['step_s_median'] * 1e3:.0f} ms/step){extra}",
        **{f"{r['path']}_ms": round(r["step_s_median"] * 1e3, 1) for r in timed},
    }


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run))
