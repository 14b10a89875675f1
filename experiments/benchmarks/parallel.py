"""Benchmark: one MoE layer's forward + backward under data x expert meshes, per dispatch path:
step time and collective bytes per device (read from the compiled HLO), plus a scaling model
for 64-256 experts on a GPU node and a TPU slice.

Paths: ``capacity`` and ``grouped`` (plain jnp, sharded by XLA's SPMD partitioner: expert
weights over ``"expert"``, tokens over both axes), ``expert_parallel`` (dropless all-to-all;
its bytes are those of the capacity rung the routing takes, its static HLO holds every rung)
and ``expert_parallel_capacity``. The measurement runs in a subprocess with ``devices``
simulated CPU devices (``JAX_NUM_CPU_DEVICES``), or on the real
devices when the machine has that many; simulated devices share this machine's cores, so the
times compare paths, not interconnects.

    python -m experiments.benchmarks.parallel                  # quick: T 2048, D 256, F 512
    python -m experiments.benchmarks.parallel preset=full      # T 4096, D 512, F 1024, E 16, k 2
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.bench.timing import time_call
from moejax.config import Config, config
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.kernels.moe_ffn.api import dispatch
from moejax.kernels.moe_ffn.expert_parallel import capacity_rungs, dropless_need
from moejax.train.budget import lowered_fitting
from moejax.train.collectives import collective_bytes
from moejax.train.distributed import cpu_devices_env
from moejax.train.mesh import make_mesh

Path_ = Literal["capacity", "grouped", "expert_parallel", "expert_parallel_capacity"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@config
class ParallelConfig(Config):
    NONEMPTY = ("meshes", "paths")

    devices: int = 8
    meshes: tuple[str, ...] = ("8x1", "4x2", "2x4", "1x8")  # data x expert
    paths: tuple[Path_, ...] = ("capacity", "grouped", "expert_parallel",
                                "expert_parallel_capacity")
    tokens: int = 2048
    d_model: int = 256
    d_expert: int = 512
    n_experts: int = 16
    top_k: int = 2
    capacity_factor: float = 1.25
    repeats: int = 5
    seed: int = 0

    @property
    def mesh_shapes(self) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in m.split("x")) for m in self.meshes]

    def validate(self) -> None:
        r = self._require
        bad = [m for m in self.meshes if len(m.split("x")) != 2
               or not all(v.isdigit() and int(v) > 0 for v in m.split("x"))]
        r(not bad, f"meshes={bad}: write each as DATAxEXPERT, e.g. 2x4")
        for d, e in self.mesh_shapes:
            r(d * e == self.devices, f"mesh {d}x{e} must use devices={self.devices}")
            r(self.n_experts % e == 0, f"mesh {d}x{e}: the expert axis {e} must divide "
              f"n_experts={self.n_experts}")
        r(self.tokens % self.devices == 0,
          f"tokens={self.tokens} must divide over devices={self.devices}")
        r(1 <= self.top_k <= self.n_experts, f"top_k={self.top_k} must be in [1, n_experts]")
        r(self.capacity_factor > 0 and self.repeats >= 1, "capacity_factor > 0, repeats >= 1")


def make_config(preset: str) -> ParallelConfig:
    if preset == "quick":
        return ParallelConfig()
    return ParallelConfig(tokens=4096, d_model=512, d_expert=1024, repeats=10)


def _layer_grad(path: str, cf: float, *, ids_NK, shardings):
    """Jitted gradient of one MoE layer (SwiGLU experts) through dispatch ``path``."""
    def layer(x, w, wu, wd, wg):
        out = dispatch(path, x, ids_NK, w, wu, wd, wg, activation="swiglu", capacity_factor=cf)
        return jnp.sum(out.y_ND.astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(layer, argnums=(0, 1, 2, 3, 4)), in_shardings=shardings)


def measure(cfg_json: str) -> list[dict]:
    """The measurement (runs where ``jax.device_count() == cfg.devices``): one row per mesh and
    path."""
    fields = json.loads(cfg_json)
    c = ParallelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    assert jax.device_count() == c.devices, jax.devices()
    T, D, F, E, K = c.tokens, c.d_model, c.d_expert, c.n_experts, c.top_k
    keys = jax.random.split(jax.random.key(c.seed), 5)
    x = jax.random.normal(keys[0], (T, D), jnp.float32)
    logits = jax.random.normal(keys[1], (T, E), jnp.float32)
    w_NK, ids_NK = jax.lax.top_k(jax.nn.softmax(logits), K)
    wu, wg = (jax.random.normal(k, (E, D, F)) / math.sqrt(D) for k in keys[2:4])
    wd = jax.random.normal(keys[4], (E, F, D)) / math.sqrt(F)
    volume = 4 * K * (T // c.devices) * D * 4  # all-to-all bytes per device, balanced
    rows = []
    for d, e in c.mesh_shapes:
        mesh = make_mesh(d, e)
        tok, ws = NamedSharding(mesh, P(("data", "expert"))), NamedSharding(mesh, P("expert"))
        rung = None
        if e > 1:
            rows_local = (T // c.devices) * K
            need = dropless_need(np.asarray(ids_NK), c.devices, e, E // e)
            rung = next(r for r in capacity_rungs(rows_local, e) if r >= need)
        shardings = (tok, tok, ws, ws, ws)
        for path in c.paths:
            grad_fn = functools.partial(_layer_grad, ids_NK=ids_NK, shardings=shardings)
            args = (x, w_NK, wu, wd, wg)
            with jax.set_mesh(mesh):
                fn = grad_fn(path, c.capacity_factor)
                compiled = lowered_fitting(  # checked before the first timed call
                    fn.lower(*args), what=f"the {path} layer gradient on a {d}x{e} mesh",
                    fix=f"lower tokens (now {T}), d_model, d_expert or n_experts")
                moved = static = collective_bytes(compiled.as_text())
                timing = time_call(fn, *args, repeats=c.repeats)
                if path == "expert_parallel" and rung is not None:  # the taken rung's bytes
                    cf_rung = rung * e / ((T // c.devices) * K)
                    moved = collective_bytes(grad_fn("expert_parallel_capacity", cf_rung)
                                             .lower(*args).compile().as_text())
            total = sum(moved.values())
            rows.append({"mesh": f"{d}x{e}", "path": path,
                         "step_ms": timing["median_s"] * 1e3,
                         "collective_mb": total / 1e6,
                         "all_to_all_mb": moved.get("all-to-all", 0) / 1e6,
                         "all_reduce_mb": moved.get("all-reduce", 0) / 1e6,
                         "all_gather_mb": moved.get("all-gather", 0) / 1e6,
                         "vs_a2a_volume": total / volume,
                         "static_hlo_mb": sum(static.values()) / 1e6,
                         "note": (f"dropless rung C={rung} rows per destination"
                                  if path == "expert_parallel" and rung is not None else "")})
    return rows


def _fields_json(cfg: ParallelConfig) -> str:
    return json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


def _measure_here_or_in_subprocess(cfg: ParallelConfig) -> list[dict]:
    if jax.device_count() == cfg.devices:
        return measure(_fields_json(cfg))
    env = cpu_devices_env(cfg.devices)
    code = (f"import sys, json; sys.path.insert(0, {ROOT!r}); from experiments.benchmarks.parallel "
            "import measure; print('ROWS' + json.dumps(measure(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", code, _fields_json(cfg)], env=env,
                       capture_output=True, text=True, check=False)
    out = [ln for ln in r.stdout.splitlines() if ln.startswith("ROWS")]
    if r.returncode != 0 or not out:
        raise RuntimeError(f"bench_parallel worker failed:\n{r.stderr[-4000:]}")
    return json.loads(out[-1][4:])


# -- the scaling model -----------------------------------------------------------------------
# Vendor peak figures (assumptions of the model, not measurements): per-device one-way
# interconnect bandwidth and dense bf16 matmul rate.
SYSTEMS = {"8x H100 SXM node (NVLink 4, 450 GB/s per direction, 989 TFLOP/s bf16)":
           (450e9, 989e12, 8),
           "TPU v5p slice of 64 chips (ICI 4 x 100 GB/s per direction, 459 TFLOP/s bf16)":
           (400e9, 459e12, 64)}


def scaling_rows(tokens_per_device: int = 8192, d: int = 4096, f: int = 1408, k: int = 8,
                 bytes_per: int = 2) -> list[dict]:
    """Bytes per device and the all-to-all time the interconnect implies, per step, for 64,
    128 and 256 experts spread over every device of each system, vs the expert FFN's
    compute time at peak."""
    rows = []
    for name, (bw, flops, n) in SYSTEMS.items():
        for E in (64, 128, 256):
            a2a = 4 * k * tokens_per_device * d * bytes_per  # dispatch + combine, fwd + bwd
            a2a_s = a2a * (n - 1) / n / bw
            compute_s = 3 * 2 * k * tokens_per_device * 3 * d * f / flops  # fwd + bwd, SwiGLU
            expert_bytes = E * 3 * d * f * bytes_per / n
            rows.append({"system": name, "experts": E, "experts_per_device": E / n,
                         "expert_weight_gb_per_device": expert_bytes / 1e9,
                         "adam_state_gb_per_device": expert_bytes * 6 / 1e9,
                         "a2a_gb_per_step": a2a / 1e9, "a2a_ms": a2a_s * 1e3,
                         "expert_compute_ms": compute_s * 1e3,
                         "a2a_over_compute": a2a_s / compute_s})
    return rows


def run(cfg: ParallelConfig, run: RunDir) -> dict:
    rows = _measure_here_or_in_subprocess(cfg)
    T, D, K = cfg.tokens, cfg.d_model, cfg.top_k
    volume_mb = 4 * K * (T // cfg.devices) * D * 4 / 1e6
    run.table("layer", rows, title=(
        f"One MoE layer fwd+bwd on {cfg.devices} simulated CPU devices: T {T}, D {D}, "
        f"{cfg.n_experts} SwiGLU experts of width {cfg.d_expert}, top-{K}, capacity factor "
        f"{cfg.capacity_factor}, median of {cfg.repeats}; collective MB per device; "
        f"all-to-all volume 4 k (T / devices) D 4 B = {volume_mb:.2f} MB"),
        columns=["mesh", "path", "step_ms", "collective_mb", "all_to_all_mb",
                 "all_reduce_mb", "all_gather_mb", "vs_a2a_volume", "static_hlo_mb", "note"])
    meshes = list(cfg.meshes)
    xs = list(range(len(meshes)))
    by = {p: {r["mesh"]: r for r in rows if r["path"] == p} for p in cfg.paths}
    run.line_plot("collective_mb", {p: (xs, [max(by[p][m]["collective_mb"], 1e-3)
                                             for m in meshes]) for p in cfg.paths},
                  xlabel="mesh (data x expert): " + ", ".join(meshes),
                  ylabel="MB per device per step", logy=True, markers=True,
                  hlines={"1.5x all-to-all volume": 1.5 * volume_mb},
                  title="Collective bytes per device vs mesh shape")
    run.line_plot("step_ms", {p: (xs, [by[p][m]["step_ms"] for m in meshes])
                              for p in cfg.paths},
                  xlabel="mesh (data x expert): " + ", ".join(meshes), ylabel="ms",
                  markers=True, title="Layer fwd+bwd time vs mesh shape (simulated devices)")
    scale = scaling_rows()
    run.table("scaling_model", scale, title=(
        "Scaling model (not measured): 8192 tokens per device, D 4096, SwiGLU experts of width "
        "1408, top-8, bf16, experts spread over every device, all-to-all over every device; "
        "vendor peak bandwidth and matmul rate"))
    ep = by.get("expert_parallel_capacity", {}).get(meshes[-1])
    grouped = by.get("grouped", {}).get(meshes[-1])
    headline = ""
    if ep is not None:
        headline = (f"mesh {meshes[-1]}: expert_parallel_capacity moves "
                    f"{ep['collective_mb']:.2f} MB per device = {ep['vs_a2a_volume']:.2f}x the "
                    f"all-to-all volume")
        if grouped is not None:
            headline += f"; grouped moves {grouped['collective_mb']:.1f} MB"
    return {"headline": headline,
            **{f"{r['mesh']} {r['path']} MB": round(r["collective_mb"], 2) for r in rows},
            **{f"{r['mesh']} {r['path']} ms": round(r["step_ms"], 1) for r in rows}}


STUDY = Study(
    "bench_parallel", make_config, run,
    smoke=("repeats=1",),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
