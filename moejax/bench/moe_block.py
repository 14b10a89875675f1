"""One MoE block's forward + backward per dispatch path, against a PyTorch expert loop (HF
Mixtral style, where torch is installed) and against the FLOP bound at the best matmul rate
measured here: the block benchmark's rows, for ``bench_dispatch`` and anyone timing a path.

On the CPU the rate is the faster of XLA's and numpy's BLAS (a path cannot beat the faster
library it could call), each a wall time, and a block is timed in wall time (its host paths
call numpy); on an accelerator, XLA's matmul of the block's dtype in device time, and a block
in device time over calls in one jitted loop (so a sub-millisecond block is not timed as
Python dispatch). :func:`block_table` runs it all, and once more after
:func:`moejax.kernels.host_memory.retain_freed_memory` when asked (process-wide: last).
"""

from __future__ import annotations

import platform
from typing import NamedTuple

import jax

from moejax.bench.cpu import (
    NO_CUDA,
    matmul_gflops,
    moe_block_flops,
    moe_block_fwd_bwd,
    torch_moe_block_s,
)
from moejax.bench.timing import (
    device_matmul_gflops,
    kernel_unavailable,
    time_call,
    time_device_loop,
)
from moejax.extras import progress
from moejax.kernels.host_memory import malloc_huge_pages, retain_freed_memory
from moejax.nn.moe import MoEConfig

__all__ = ["BlockShape", "TORCH", "block_bound", "block_times", "block_timer", "block_rows",
           "block_table", "software_versions"]

TORCH = "PyTorch expert loop (HF Mixtral style"  # the row's name: + ", on <device>)"


class BlockShape(NamedTuple):
    """The block: ``tokens`` of width ``d`` through ``experts`` SwiGLU experts of width
    ``f``, top-``top_k``."""

    tokens: int
    d: int
    f: int
    experts: int
    top_k: int


def block_bound(shape: BlockShape) -> tuple[float, dict]:
    """Seconds of the block's expert FLOPs at the best rate a matmul reaches here, and the
    rates (GFLOP/s) by library (module docstring)."""
    mm = (2 * shape.tokens, shape.d, shape.f)
    if jax.default_backend() != "cpu":
        rates = {"XLA (device time)": device_matmul_gflops(*mm)}
    else:
        rates = {lib: matmul_gflops(*mm, backend=lib) for lib in ("xla", "numpy")}
    flops = moe_block_flops(shape.tokens, shape.d, shape.f, shape.top_k)
    return flops / (max(rates.values()) * 1e9), rates


def block_timer():
    """The timer of a block call here (module docstring)."""
    return time_call if jax.default_backend() == "cpu" else time_device_loop


def block_times(shape: BlockShape, paths, repeats: int) -> dict[str, float | str | None]:
    """Median fwd+bwd seconds of the block per dispatch path in ``paths`` (the ones whose
    kernels run here) and of the PyTorch peer (None: torch not installed; a note where its
    time is no peer of the device's)."""
    base = MoEConfig(n_experts=shape.experts, top_k=shape.top_k, d_expert=shape.f,
                     activation="swiglu", balance_loss="none")
    variants = [("capacity cf=1.25", base.replace(dispatch="capacity", capacity_factor=1.25)),
                ("capacity cf=2.0", base.replace(dispatch="capacity", capacity_factor=2.0)),
                ("grouped (dropless)", base.replace(dispatch="grouped")),
                ("bucketed (dropless)", base.replace(dispatch="bucketed")),
                ("host (dropless, fused)", base.replace(dispatch="host")),
                ("host_capacity cf=1.25 (fused)", base.replace(dispatch="host_capacity",
                                                               capacity_factor=1.25)),
                ("ragged (dropless)", base.replace(dispatch="ragged")),
                ("dense (oracle)", base.replace(dispatch="dense"))]
    times: dict = {}
    runnable = [(n, m) for n, m in variants
                if m.dispatch in paths and not kernel_unavailable(m.dispatch)]
    for name, mcfg in progress(runnable, desc="MoE block", leave=False):
        fn, args = moe_block_fwd_bwd(mcfg, shape.d, shape.tokens)
        times[name] = block_timer()(fn, *args, repeats=repeats)["median_s"]
    t, device = torch_moe_block_s(
        shape.tokens, shape.d, shape.f, shape.experts, shape.top_k, repeats=repeats,
        device="cuda" if jax.default_backend() == "gpu" else "cpu")
    if device == NO_CUDA:  # a note, not a time: its CPU time is no peer of a GPU's
        times[f"{TORCH})"] = ("not timed: this torch has no CUDA (a CUDA torch times the "
                              "peer on the GPU)")
    else:
        times[f"{TORCH}, on {device})" if device else f"{TORCH})"] = t
    return times


def block_rows(times: dict, bound: float, rates: dict, suffix: str = "") -> list[dict]:
    """Rows ``impl, ms, vs_torch, vs_flop_bound`` (column names + ``suffix``), then the
    bound's own row."""
    t_torch = next((t for name, t in times.items()
                    if name.startswith(TORCH) and isinstance(t, float)), None)
    rows = []
    for name, t in times.items():
        row = {"impl": name}
        if t is None:
            row["note"] = "not installed (pip install torch)"
        elif isinstance(t, str):
            row["note"] = t
        else:
            row |= {f"ms{suffix}": t * 1e3, f"vs_flop_bound{suffix}": t / bound}
            if t_torch is not None:
                row[f"vs_torch{suffix}"] = t / t_torch
        rows.append(row)
    flops_g = bound * max(rates.values())
    rows.append({"impl": f"FLOP bound ({flops_g:.1f} GFLOP at {max(rates.values()):.0f} "
                         "GFLOP/s)", f"ms{suffix}": bound * 1e3, f"vs_flop_bound{suffix}": 1.0,
                 "note": "matmul rate here: " + ", ".join(
                     f"{'numpy BLAS' if lib == 'numpy' else lib.replace('xla', 'XLA')} "
                     f"{r:.0f}" for lib, r in rates.items()) + " GFLOP/s"})
    return rows


def block_table(shape: BlockShape, paths, repeats: int, retain_memory: bool
                ) -> tuple[list[dict], list[str], float]:
    """``(rows, columns, matmul rate)``: :func:`block_rows` of every path, and with
    ``retain_memory`` the ``*_retained`` columns measured again after
    :func:`moejax.kernels.host_memory.retain_freed_memory` (process-wide from then on)."""
    bound, rates = block_bound(shape)
    rows = block_rows(block_times(shape, paths, repeats), bound, rates)
    columns = ["impl", "ms", "vs_torch", "vs_flop_bound"]
    if retain_memory:
        if retain_freed_memory():
            again = block_rows(block_times(shape, paths, repeats), bound, rates,
                               suffix="_retained")
            for row, other in zip(rows, again):
                row |= {k: v for k, v in other.items() if k.endswith("_retained")}
            columns += ["ms_retained", "vs_torch_retained", "vs_flop_bound_retained"]
        else:
            rows[-1]["note"] += "; retained-memory columns: not glibc, not measured"
    return rows, columns, max(rates.values())


def software_versions() -> str:
    """jax's and torch's versions, the machine, the devices and malloc's huge pages."""
    try:
        import torch  # optional: the peer row's library, never a moejax dependency
        tv = torch.__version__
    except ImportError:
        tv = "not installed"
    thp = "on" if malloc_huge_pages() else "off"
    return (f"jax {jax.__version__}, torch {tv}, {platform.machine()} "
            f"{jax.devices()[0].platform} x{jax.device_count()}, malloc huge pages {thp}")
