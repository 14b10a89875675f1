"""What a program launches on a GPU, counted from its compilation on any host.

jax's CUDA plugin compiles for a GPU it is only told about: a topology made from an XLA
target description (:data:`GPUS`: compute capability, SMs, memory, caches) compiles a jitted
function to the optimised program XLA would run on that GPU, with no GPU and no driver
present. The program names every kernel it launches (each fusion, each custom call: a
Pallas or Mosaic kernel, a library call), so :func:`launches` counts a decode step's kernels
and :func:`loop_launches` what one round of a decoding loop launches: a generated token's
kernels as a profile of the loop counts them, less the profile's memsets and copies.

The plugin is no dependency of moejax: ``make setup`` puts the one matching the installed
jaxlib in a folder of its own (:func:`compiler_path`, ``scripts/install_gpu_compiler.sh``).
jax finds plugins when it first starts a backend, so a process that compiles for the GPU has
that folder on its path from its start: :func:`gpu_compile_env` is the environment of such a
subprocess.
"""

from __future__ import annotations

import collections
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec, use_abstract_mesh

from moejax.bench.profile import HloInstruction, hlo_computations, kernel_kind
from moejax.kernels.grouped.ragged import cross_compile
from moejax.kernels.targets import COMPUTE_CAPABILITY

__all__ = ["GPUS", "compiler_path", "gpu_compile_env", "gpu_program", "launches",
           "loop_launches", "reductions"]

# XLA's GpuTargetConfigProto (text) of the GPUs a decode is measured on
GPUS = {"h200": """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H200"
"""}


def compiler_path() -> Path:
    """The folder ``make setup`` installs jax's CUDA plugin in, one per jaxlib version (the
    plugin must be the running jaxlib's): ``gpu-compiler-<version>`` in the virtualenv."""
    return Path(sys.prefix) / f"gpu-compiler-{importlib.metadata.version('jaxlib')}"


def _missing() -> str:
    return (f"jax's CUDA plugin is not installed in {compiler_path()}; run `make setup` (or "
            "scripts/install_gpu_compiler.sh) to compile for a GPU on this host")


def gpu_compile_env(env: dict | None = None) -> dict:
    """``env`` (default this process's) for a subprocess that compiles for a GPU: the plugin's
    folder first on ``PYTHONPATH``, the CPU as jax's platform (the plugin is only asked to
    compile), its CUDA library check off (no CUDA libraries are installed; none is run).
    Refused where the running jaxlib's plugin is not installed."""
    path = compiler_path()
    if not path.is_dir():
        raise FileNotFoundError(_missing())
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return env


def gpu_program(jitted, *args, gpu: str = "h200", **static) -> str:
    """The optimised program (``compiled.as_text()``) of ``jitted(*args, **static)`` compiled
    for ``gpu`` (a key of :data:`GPUS`) with no GPU present; ``args`` are arrays or
    ``jax.ShapeDtypeStruct`` s (only their shapes and dtypes are read). Runs in a process
    started with :func:`gpu_compile_env`."""
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r}; known: {', '.join(GPUS)}")
    try:
        topology = topologies.get_topology_desc("moejax", "cuda", target_config=GPUS[gpu],
                                                topology="1x1x1")
    except NotImplementedError as e:
        raise RuntimeError(f"{_missing()}, and start this process with its folder on the path "
                           "(moejax.bench.gpu_program.gpu_compile_env)") from e
    mesh = topologies.make_mesh(topology, (1,), ("gpu",))
    sharding = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    # the kernels are chosen for the described GPU (moejax.kernels.tiling.target_device)
    with use_abstract_mesh(mesh.abstract_mesh), cross_compile(COMPUTE_CAPABILITY["cuda"]):
        lowered = jitted.lower(*abstract, **static)
    return lowered.compile().as_text()


_FREE = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all",
         "opt-barrier", "partition-id", "replica-id", "add-dependency"}


def _computations(program: str) -> tuple[dict[str, list[HloInstruction]], str]:
    bodies, entry = hlo_computations(program)
    if not entry:
        raise ValueError("not an optimised HLO program (no ENTRY computation): pass "
                         "compiled.as_text()")
    return bodies, entry


def _kind(op: str, rest: str) -> str:
    if op == "fusion":
        kind = re.search(r"kind=k(\w+)", rest)
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        name = re.sub(r"^fused_", "", kernel_kind(calls.group(1))) if calls else ""
        return f"{kind.group(1).lower() if kind else 'fusion'}_{name}_fusion"
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        return f"custom-call {target.group(1) if target else ''}".strip()
    return op


def _count(bodies, name: str, out: collections.Counter, loops: list) -> collections.Counter:
    for _, _, op, rest in bodies[name]:
        if op in _FREE:
            continue
        if op == "while":
            loops.append(tuple(re.search(rf"{part}=%?([\w.\-]+)", rest).group(1)
                               for part in ("condition", "body")))
            out["while"] += 1
        elif op == "conditional":  # each branch's kernels, as if every branch ran
            out["conditional"] += 1
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            names = (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else
                     re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest))
            for b in names:
                _count(bodies, b, out, loops)
        else:
            out[_kind(op, rest)] += 1
    return out


def launches(program: str) -> collections.Counter:
    """The kernels the program's entry launches once, by kind (a fusion by its kind and root,
    e.g. ``input_reduce_fusion``; a custom call by its target, e.g. ``custom-call
    mosaic_gpu_v2``; other ops by name); a ``while`` counts once as ``"while"``, its rounds
    not included; a conditional's branches all counted."""
    bodies, entry = _computations(program)
    return _count(bodies, entry, collections.Counter(), [])


def loop_launches(program: str) -> collections.Counter:
    """What one round of the program's busiest top-level ``while`` loop launches, its
    condition's kernels included (by kind, as :func:`launches`; loops inside it count once
    each, as ``"while"``). A profile of the round counts one event more: the condition's
    result copied to the host."""
    bodies, entry = _computations(program)
    loops: list[tuple[str, str]] = []
    _count(bodies, entry, collections.Counter(), loops)
    if not loops:
        raise ValueError("the program has no while loop; count its launches() instead")
    rounds = [_count(bodies, body, _count(bodies, cond, collections.Counter(), []), [])
              for cond, body in loops]
    return max(rounds, key=lambda c: sum(c.values()))


_SHAPE = re.compile(r"^\w+\[([\d,]*)\](?:\{([\d,]*)[^}]*\})?")


def _orientation(operand_type: str, dims: list[int]) -> str:
    m = _SHAPE.match(operand_type)
    if m is None:
        return "unknown"
    shape = [int(d) for d in m.group(1).split(",") if d]
    minor_to_major = ([int(d) for d in m.group(2).split(",") if d] if m.group(2) is not None
                      else list(range(len(shape)))[::-1])
    real = [d for d in minor_to_major if shape[d] > 1]  # size-1 dimensions take no stride
    reduced = [d for d in real if d in dims]
    if len(reduced) == len(real):
        return "whole"
    return "row" if real[:len(reduced)] == reduced else "column"


def reductions(program: str) -> collections.Counter:
    """The program's reductions by how they read memory, as XLA's GPU emitter tells them
    apart: ``"row"`` where the reduced dimensions are the operand's minor-most in its layout
    (each output's inputs contiguous: a one-row product whose weight is ``[N, K]``),
    ``"column"`` where they are not (its weight ``[K, N]``), ``"whole"`` where every dimension
    of more than one element is reduced (a norm's sum of squares over one token)."""
    bodies, _ = _computations(program)
    out: collections.Counter = collections.Counter()
    for body in bodies.values():
        types = {i.name: i.type for i in body}
        for i in body:
            if i.opcode != "reduce":
                continue
            operand = re.match(r"\s*%?([\w.\-]+)", i.rest)
            dims = re.search(r"dimensions=\{([\d,]*)\}", i.rest)
            if operand is None or dims is None or operand.group(1) not in types:
                out["unknown"] += 1
                continue
            out[_orientation(types[operand.group(1)],
                             [int(d) for d in dims.group(1).split(",") if d])] += 1
    return out
