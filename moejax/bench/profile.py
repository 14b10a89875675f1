"""Device time from the profiler: how many kernels a jitted call launches and how long they
run on the device, apart from the gaps between them.

A device loop (:func:`moejax.bench.timing.time_device_loop`) measures a call's time as the
device sees it, launch gaps included; a call of a few microseconds (a decode step's expert
kernel) can spend as long in the gaps and in the small XLA kernels around it as in its own
kernel. :func:`trace_kernels` runs a function under ``jax.profiler.trace`` and reads the trace
(``jax.profiler.ProfileData``) back: every event on the accelerator's plane (``/device:GPU:0``,
``/device:TPU:0``...) that is a kernel, a copy or a memset. On a GPU those are the events of its
streams (lines named ``Stream #...``; the other lines summarize the same time per XLA op or
module, and would count it twice); on a TPU the ``XLA Ops`` line. A trace without such events
(a CPU; a GPU whose CUPTI library is missing) gives ``None``: the caller reports "not
measured", never a zero.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
from jax.profiler import ProfileData

__all__ = ["KernelTrace", "device_kernels", "trace_kernels", "sees_device", "top_kernel_rows",
           "kernel_kind", "kernel_kind_rows", "fused_ops", "HloInstruction", "hlo_computations"]

_TPU_OPS = "XLA Ops"


class KernelTrace(NamedTuple):
    """The device events of a traced run: ``launches`` (events), ``busy_s`` (their summed
    durations), ``by_name`` (seconds per kernel name, largest first) and ``counts`` (events
    per kernel name; None where not recorded)."""

    launches: int
    busy_s: float
    by_name: dict[str, float]
    counts: dict[str, int] | None = None


def sees_device() -> bool:
    """Whether a trace here can hold device events: the default backend is an accelerator (a
    CPU trace has no device plane, so tracing there only costs time)."""
    return jax.default_backend() != "cpu"


def _kernel_lines(plane) -> list:
    lines = list(plane.lines)
    streams = [line for line in lines if line.name.startswith("Stream")]
    return streams or [line for line in lines if line.name == _TPU_OPS]


def device_kernels(profile: ProfileData) -> KernelTrace | None:
    """The kernels, copies and memsets on the accelerator planes of ``profile`` (module
    docstring); None where it has none."""
    durations: dict[str, float] = {}
    counts: dict[str, int] = {}
    launches = 0
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in _kernel_lines(plane):
            for event in line.events:
                launches += 1
                durations[event.name] = durations.get(event.name, 0.0) + event.duration_ns * 1e-9
                counts[event.name] = counts.get(event.name, 0) + 1
    if not launches:
        return None
    by_name = dict(sorted(durations.items(), key=lambda kv: -kv[1]))
    return KernelTrace(launches, sum(by_name.values()), by_name, counts)


def _attempt(what: str, fn):
    """``fn()``, or None (and one line on stderr) where the profiler fails: a trace is extra
    evidence, never a reason to lose the measurement it comes with."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - any profiler failure means "not measured"
        print(f"moejax.bench.profile: {what} failed ({type(err).__name__}: {err}); kernel "
              "times not measured", file=sys.stderr)
        return None


def trace_kernels(run: Callable[[], object]) -> KernelTrace | None:
    """``run()`` (its result waited for) under the profiler, and its device events
    (:func:`device_kernels`); None where the trace has none or the profiler fails (``run``
    still runs once; its own errors are raised). Compile ``run`` before: a first call's
    compilation would be traced too (harmless, but slow to write)."""
    with tempfile.TemporaryDirectory(prefix="moejax_trace_") as d:
        started = _attempt("starting a trace", lambda: jax.profiler.start_trace(d) or True)
        try:
            jax.block_until_ready(run())
        finally:
            stopped = started and _attempt("stopping the trace",
                                           lambda: jax.profiler.stop_trace() or True)
        paths = sorted(Path(d).rglob("*.xplane.pb")) if stopped else []
        profile = paths and _attempt("reading the trace",
                                     lambda: ProfileData.from_file(str(paths[-1])))
        return device_kernels(profile) if profile else None


_COMPUTATION = re.compile(r"^(?:(ENTRY) )?%?([\w.\-]+) \(.*\) -> .+ \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_PLUMBING = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}


class HloInstruction(NamedTuple):
    """One line of an optimised HLO computation: ``name = type opcode(rest``."""

    name: str
    type: str
    opcode: str
    rest: str


def hlo_computations(program: str) -> tuple[dict[str, list[HloInstruction]], str]:
    """``(computations, entry)`` of a compiled program's text (``compiled.as_text()``):
    each computation's instructions in order, by the computation's name, and the entry
    computation's name ("" where there is none)."""
    bodies: dict[str, list[HloInstruction]] = {}
    entry, current = "", None
    for line in program.splitlines():
        if current is None:
            if m := _COMPUTATION.match(line):
                current = bodies.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
        elif m := _INSTRUCTION.match(line):
            current.append(HloInstruction(*m.groups()))
    return bodies, entry


def fused_ops(program: str) -> dict[str, str]:
    """What each fusion of a compiled program (``compiled.as_text()``, XLA's optimised HLO)
    computes, by the fusion's name, also as a profile names its kernel (``.`` -> ``_``): the
    fused computation's instructions by opcode and count, parameters, constants and bitcasts
    left out, then the result's type (``"convert, dot -> bf16[1,768]"``), so a kernel per
    token in a trace reads as the work it does."""
    bodies, _ = hlo_computations(program)
    calls = {i.name: c.group(1) for comp in bodies.values() for i in comp
             if i.opcode == "fusion" and (c := _CALLS.search(i.rest))}
    out = {}
    for name, comp in calls.items():
        body = bodies.get(comp, [])
        ops: dict[str, int] = {}
        for i in body:
            if i.opcode not in _PLUMBING:
                ops[i.opcode] = ops.get(i.opcode, 0) + 1
        what = ", ".join(op if n == 1 else f"{op} x{n}" for op, n in sorted(ops.items()))
        result = re.sub(r"\{[^}]*\}", "", body[-1].type) if body else ""
        text = f"{what} -> {result}" if body else ""
        out[name] = out[name.replace(".", "_")] = text
    return out


def top_kernel_rows(rows: list[dict], top: int, keys: tuple[str, ...]) -> list[dict]:
    """Per row with a ``kernels`` mapping (seconds per kernel name, largest first, in some unit
    of work: a train step, a generated token), which it takes out of the row: its ``top``
    longest kernels, then the rest together, each with the row's ``keys``, its milliseconds
    per unit and its share of the unit's device time; where the row has ``fuses``
    (:func:`fused_ops` of the program traced, also taken out), a ``fuses`` column saying what
    each fusion computes."""
    out = []
    for r in rows:
        by_name, fuses = r.pop("kernels", None), r.pop("fuses", None)
        if not by_name:
            continue
        busy = sum(by_name.values())
        items = list(by_name.items())
        rest = sum(t for _, t in items[top:])
        for name, t in items[:top] + ([("(the other kernels)", rest)] if rest else []):
            out.append({**{k: r.get(k, "") for k in keys}, "kernel": name, "ms": t * 1e3,
                        "share": t / busy if busy else 0.0,
                        **({"fuses": fuses.get(name, "")} if fuses is not None else {})})
    return out


def kernel_kind(name: str) -> str:
    """A kernel's name without the numbers XLA appends to tell its instances apart
    (``input_reduce_fusion_83`` -> ``input_reduce_fusion``, ``fusion.1`` -> ``fusion``): the
    kind of work, for counting where a step's many small kernels come from."""
    return re.sub(r"([._]\d+)+$", "", name) or name


def kernel_kind_rows(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Per row with ``kernels`` (seconds per kernel name in some unit of work: a train step, a
    generated token) and ``kernel_counts`` (launches per name in the same unit): its kernels
    grouped by :func:`kernel_kind`, longest first, each with the row's ``keys``, its launches
    and milliseconds per unit and its share of the unit's device time. Rows without counts
    give none."""
    out = []
    for r in rows:
        by_name, counts = r.get("kernels"), r.get("kernel_counts")
        if not by_name or not counts:
            continue
        kinds: dict[str, list[float]] = {}
        for name, t in by_name.items():
            k = kinds.setdefault(kernel_kind(name), [0.0, 0.0])
            k[0] += counts.get(name, 0)
            k[1] += t
        busy = sum(t for _, t in kinds.values())
        for kind, (n, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            out.append({**{k: r.get(k, "") for k in keys}, "kind": kind, "kernels": n,
                        "ms": t * 1e3, "share": t / busy if busy else 0.0})
    return out
