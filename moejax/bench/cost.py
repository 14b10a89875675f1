"""A union path's time as a fixed part and a cost per union member.

A chunk-union kernel reads each member's weights once, so its time over the union sizes it
was measured at is close to a line, ``t(U) = fixed + per_member * U``: ``fixed`` is what every
call pays whatever its union (launches, pipeline fill, the output's zeroing and conversion),
``per_member`` the time a member's weights take to stream (their bytes over it are the rate the
path reaches). Against the HBM floor, ``floor_per_member * U``, the ratio ``t(U) / floor(U)``
falls with ``U`` towards ``per_member / floor_per_member``, and :func:`smallest_union_within`
is the union size from which the line is within a limit of the floor: ``None`` when the
per-member cost alone is beyond it (no union is large enough; only a faster stream helps),
else ``fixed / (limit * floor_per_member - per_member)`` (a smaller fixed part moves it down).
:func:`union_cost` fits the line per path and chunk size of ``experiments.blockffn.kernels``'
rows; :func:`cost_note` says the decode kernel's in words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["fixed_plus_per_member", "smallest_union_within", "union_cost", "cost_note"]


def fixed_plus_per_member(unions: Sequence[float], times: Sequence[float]
                          ) -> tuple[float, float]:
    """``(fixed, per_member)``: the least-squares line through ``(union size, time)``; at
    least two distinct union sizes."""
    u, t = np.asarray(unions, float), np.asarray(times, float)
    if u.shape != t.shape or len(set(u.tolist())) < 2:
        raise ValueError(f"need times at two or more distinct union sizes; got unions "
                         f"{u.tolist()} and {t.size} times")
    per_member, fixed = np.polyfit(u, t, 1)
    return float(fixed), float(per_member)


def smallest_union_within(fixed: float, per_member: float, floor_per_member: float,
                          limit: float) -> float | None:
    """The union size from which ``fixed + per_member * U <= limit * floor_per_member * U``
    (0 when every size is: a fixed part of at most 0); None when none is."""
    if floor_per_member <= 0 or limit <= 0:
        raise ValueError(f"floor_per_member={floor_per_member} and limit={limit} must be > 0")
    room = limit * floor_per_member - per_member
    if room <= 0:
        return None
    return max(0.0, fixed / room) if math.isfinite(fixed) else None


def union_cost(rows: list[dict], paths=("decode", "pallas", "chunk_union_gather"),
               limit: float = 1.5) -> list[dict]:
    """Per path and chunk size (at least two union sizes measured) of a union benchmark's
    rows (``n``, ``union``, ``path``, ``ms``, ``floor_ms``, ``gbps``; ``kernel_ms`` where
    profiled): its time as a fixed part and a cost per union member, from the call's time
    and, where the profiler saw them, its kernels' own; the rate the per-member cost streams
    a member's weights at, and the union size from which the line is within ``limit`` x the
    HBM floor (``none``: the per-member cost alone is beyond it)."""
    out = []
    for path in paths:
        for n in sorted({r["n"] for r in rows if r["path"] == path}):
            got = [r for r in rows if r["path"] == path and r["n"] == n and "floor_ms" in r
                   and "ms" in r]
            for time, key in (("call", "ms"), ("kernels", "kernel_ms")):
                pts = [r for r in got if r.get(key) is not None]
                if len({r["union"] for r in pts}) < 2:
                    continue
                fixed, per = fixed_plus_per_member([r["union"] for r in pts],
                                                   [r[key] * 1e3 for r in pts])
                floor_per = pts[0]["floor_ms"] * 1e3 / pts[0]["union"]
                member_bytes = pts[0]["gbps"] * 1e9 * pts[0]["ms"] * 1e-3 / pts[0]["union"]
                reach = smallest_union_within(fixed, per, floor_per, limit)
                out.append({"path": path, "n": n, "time": time, "fixed_us": fixed,
                            "per_member_us": per, "member_gbps": member_bytes / per / 1e3
                            if per > 0 else None, "floor_per_member_us": floor_per,
                            "per_member_x_floor": per / floor_per,
                            f"within_{limit:g}x_from_union": "none" if reach is None
                            else math.ceil(reach), "unions": len(pts)})
    return out


def cost_note(costs: list[dict], limit: float = 1.5) -> str | None:
    """The decode kernel's line per chunk size, in words (None where it has none)."""
    lines = [f"n={c['n']}: {c['fixed_us']:.1f} us + {c['per_member_us']:.2f} us a member "
             f"({c['member_gbps']:.0f} GB/s; the floor {c['floor_per_member_us']:.2f} us), "
             f"within {limit:g}x of the floor from |U| = {c[f'within_{limit:g}x_from_union']}"
             for c in costs if c["path"] == "decode" and c["time"] == "call"
             and c["member_gbps"] is not None]
    return "decode as fixed + per-member time: " + "; ".join(lines) if lines else None
