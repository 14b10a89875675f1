"""Collective traffic of a compiled XLA program, read from its HLO text: the bytes each device
sends through all-to-all, all-gather, all-reduce, reduce-scatter and collective-permute (the
result shapes of the per-device program), skipping collectives whose replica groups are
single devices (nothing moves). For checking what a sharding or a dispatch path costs."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["collective_bytes", "COLLECTIVES"]

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
             "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_OP = re.compile(r"=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\]")
# the three notations XLA prints replica groups in: explicit lists {{0,1},{2,3}}; iota tiles
# [groups,size]<=[n] (optionally transposed); mesh axes mesh['data'=2,'expert'=4] {'expert'}
_GROUPS = re.compile(r"replica_groups=\{((?:\{[^}]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _moves(line: str) -> bool:
    """Whether the collective's replica groups hold more than one device."""
    if groups := _GROUPS.search(line):
        members = re.findall(r"\{([^}]*)\}", groups.group(1))
        return not members or any("," in m for m in members)
    if iota := _IOTA.search(line):
        return int(iota.group(2)) > 1
    if mesh := _MESH.search(line):
        sizes = {k.strip("' "): int(v) for k, v in
                 (a.split("=") for a in mesh.group(1).split(",") if "=" in a)}
        axes = [a.strip("' ") for a in mesh.group(2).split(",") if a.strip("' ")]
        return int(np.prod([sizes[a] for a in axes])) > 1
    return True


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """``{collective: bytes}`` per device over every collective instruction of ``hlo_text``
    (``compiled.as_text()``); instructions in conditional branches are all counted."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None or not _moves(line):
            continue
        nbytes = sum(_ITEMSIZE[t] * int(np.prod([int(v) for v in dims.split(",") if v] or [1]))
                     for t, dims in _SHAPE.findall(m.group(1)))
        out[m.group(2)] = out.get(m.group(2), 0) + nbytes
    return out
