"""Launch configurations of the project's own GPU kernels, tuned per device, and read when a
kernel is lowered.

A configuration is a :class:`TritonConfig` (three tiles, warps and pipeline stages; what the
tiles are per kernel: :data:`TILES`; the decode kernel's also which of its weights each program
prefetches into the L2, :data:`L2_PREFETCH`, and in how many programs it splits the model
width). :func:`config_for` returns the one for a kernel
(``"gmm"``: the grouped products, forward and dX; ``"tgmm"``: the weight gradient, both
Triton; ``"gmm_mgpu"`` / ``"tgmm_mgpu"``: the same on Mosaic GPU; ``"pairs_mgpu"``:
BlockFFN's Mosaic GPU pair products; ``"decode_mgpu"``: its Mosaic GPU decode kernel), a
dtype and a shape ``(K, N)`` (contraction, output columns; the decode kernel: ``(D, F)``) on
the device the program is lowered for
(:func:`moejax.kernels.tiling.target_device`): the tuned entry for that device kind, kernel,
dtype and shape bucket (``K`` and ``N`` rounded up to powers of two), else :data:`DEFAULTS`.
The tuned entries live with their op, one JSON file per device kind:
``moejax/kernels/<op>/tuned/<device kind>.json`` (:data:`HOMES`: the grouped products'
kernels in ``grouped/``, BlockFFN's in ``chunk_union/``), each
``{"device_kind": ..., "kernels": {kernel: {dtype: {bucket: entry}}}}``;
``MOEJAX_KERNEL_TABLE`` names one file of every device and kernel instead,
``{device: {kernel: ...}}`` (a tuning run's own, or a test's).

The defaults follow the published H100 configurations of the anchors (tokamax's and
megablox's grouped matmuls): 16-bit inputs take 128 x 64 x 128 tiles with 8 warps and 3
stages, and the weight gradient 128 x 128 output tiles. f32, whose tiles take twice the
shared memory, keeps 64 x 32 x 64 with 4 warps and 2 stages for the forward and dX, and takes
the 128 x 128 weight-gradient tiles with 64-row steps, 8 warps and 2 stages. The Mosaic GPU
kernels (one warpgroup, bf16 / f16 only) take tokamax's sm90 shapes: 64-row wgmma tiles,
64-column contraction steps (one 128-byte swizzle of bf16), 128 output columns, 3 stages;
the grouped products on Mosaic GPU the anchors' 128 x 64 x 128 tiles at 4 stages (dW: 128 x
128 output blocks in 64-row steps), warp-specialized as jax's Hopper matmul is
(``num_warps`` 12: one warpgroup issuing the copies, two computing a block each). The decode
kernel, whose weights are wgmma's M operand and whose chunk of a few tokens is the N, takes
128-row D steps of 64-column F blocks and 128-row D blocks at 6 stages: its few programs per
union member each keep as many weight bytes in flight as shared memory holds; it prefetches
nothing into the L2 and runs one program per F block, until a measurement on the device says
otherwise.

:func:`tune` times a space of configurations per case with a given timer and keeps the
fastest whose output the timer found equal to an oracle's (:func:`check_close`; a wrong
configuration is never stored, however fast); :func:`write_entries` merges the winners into
their ops' files for one device kind, atomically (``python -m experiments.benchmarks.autotune``
on a GPU does both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.files import atomic_write_text
from moejax.kernels.tiling import pow2, target_device

__all__ = ["TritonConfig", "DEFAULTS", "HOMES", "KERNELS", "TILES", "config_for", "forced",
           "is_forced", "bucket", "tune", "Tuned", "WrongResult", "check_close", "write_entries",
           "read_table", "check_table", "table_files", "op_file", "SPACE", "SPACES",
           "L2_PREFETCH"]

KERNELS = ("gmm", "tgmm", "gmm_mgpu", "tgmm_mgpu", "pairs_mgpu", "decode_mgpu")
# what a configuration's three tiles are, per kernel
TILES = {"gmm": ("rows", "contraction", "columns"), "tgmm": ("rows", "K", "N"),
         "gmm_mgpu": ("rows", "contraction", "columns"), "tgmm_mgpu": ("rows", "K", "N"),
         "pairs_mgpu": ("rows", "contraction", "columns"),
         "decode_mgpu": ("D step", "F block", "D block")}
# the op package each kernel's tuned entries live in (moejax/kernels/<op>/tuned/)
HOMES = {"gmm": "grouped", "tgmm": "grouped", "gmm_mgpu": "grouped", "tgmm_mgpu": "grouped",
         "pairs_mgpu": "chunk_union", "decode_mgpu": "chunk_union"}
_KERNELS_DIR = Path(__file__).parent


class TritonConfig(NamedTuple):
    tm: int
    tk: int
    tn: int
    num_warps: int = 4
    num_stages: int = 2
    # the decode kernel only (:data:`L2_PREFETCH`): which of a program's weights it asks the
    # L2 for at its start, ahead of its pipelines
    l2_prefetch: int = 0
    # the decode kernel only: programs per (expert, F block), each computing the
    # up-projection and the down-projection of its 1 / d_splits of the model width
    d_splits: int = 1


# ``l2_prefetch`` of the decode kernel: none; its down-projection's weights (they arrive in
# the L2 while the up-projection streams, so the second pipeline starts from the L2); all of
# its weights (every byte it reads requested at once, however deep its pipelines)
L2_PREFETCH = ("none", "down", "all")


_WIDE = ("bfloat16", "float16")
DEFAULTS: dict[tuple[str, str], TritonConfig] = {
    **{("gmm", d): TritonConfig(128, 64, 128, 8, 3) for d in _WIDE},
    **{("tgmm", d): TritonConfig(128, 128, 128, 8, 3) for d in _WIDE},
    ("gmm", "float32"): TritonConfig(64, 32, 64, 4, 2),
    # dW in 128 x 128 output blocks (the anchors'), 64 rows a step: 2 x 64 KB of float32
    # operands in shared memory at 2 stages
    ("tgmm", "float32"): TritonConfig(64, 128, 128, 8, 2),
    **{("pairs_mgpu", d): TritonConfig(64, 64, 128, 4, 3) for d in _WIDE},
    # decode (weights as wgmma's M, the chunk as N): 128-row D steps of 64 F columns, 6
    # stages: a union of 16 experts keeps only 64 programs busy, each needing ~64 GB/s, which
    # at ~1 us of memory latency is ~64 KB of weight copies in flight (6 x 16 KB); a gated
    # expert or a long chunk gets fewer stages where shared memory runs out (decode_gpu.blocks)
    **{("decode_mgpu", d): TritonConfig(128, 64, 128, 4, 6) for d in _WIDE},
    # the grouped products on Mosaic GPU: the anchors' bf16 H100 tiles (128 x 64 x 128 a
    # computing warpgroup; dW in 128 x 128 output blocks, 64 rows a step), 4 stages
    # (12 warps: warp-specialized, one warpgroup loading and two computing 128 columns each)
    **{("gmm_mgpu", d): TritonConfig(128, 64, 128, 12, 4) for d in _WIDE},
    **{("tgmm_mgpu", d): TritonConfig(64, 128, 128, 12, 4) for d in _WIDE},
}


# the candidates python -m experiments.benchmarks.autotune times: tiles around the defaults,
# 4 or 8 warps; then Triton's usual Hopper matmul configurations (256-row blocks, 4-stage pipelines)
SPACE: tuple[TritonConfig, ...] = tuple(
    TritonConfig(tm, tk, tn, w, st)
    for tm, tk, tn in ((64, 32, 64), (64, 64, 128), (128, 32, 128), (128, 64, 128),
                       (128, 128, 128), (128, 64, 256))
    for w, st in ((4, 2), (8, 3))) + (
    TritonConfig(256, 64, 128, 8, 3), TritonConfig(128, 64, 256, 8, 4),
    TritonConfig(128, 64, 128, 4, 4), TritonConfig(128, 32, 128, 4, 4))
# the Mosaic GPU kernels: one warpgroup; output blocks of 64 to 256 columns, 2 to 4 stages
_MGPU_SPACE = tuple(TritonConfig(64, 64, tn, 4, st) for tn in (64, 128, 256) for st in (2, 3, 4))
_MGPU_ACC = ((64, 128), (64, 256), (128, 128))
# decode: a union of a few experts keeps a few SMs busy, each bound by the bytes it has in
# flight: the default, the tiles an H200 ranked first without a prefetch (longer D steps and
# blocks at 4 to 6 stages; 128-column F blocks), and shallow pipelines, which a prefetch to
# the L2 may make enough (two programs to an SM); each without, and with either, prefetch,
# and split over the model width in two programs (twice the SMs busy; the up-projection's
# weights read twice, the second time from the L2) without a prefetch and with all of it,
# and in four without a prefetch (a quarter union of 64 experts then has 128 to 256 programs
# for the H200's 132 SMs, where two splits of 128-column F blocks gave it 64)
_DECODE_TILES = ((128, 64, 128, 6), (256, 64, 256, 4), (128, 128, 128, 4),
                 (256, 64, 128, 4), (128, 64, 128, 3), (256, 64, 256, 2))
_DECODE_PROGRAMS = ((0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 4))  # (l2_prefetch, d_splits)
SPACES: dict[str, tuple[TritonConfig, ...]] = {
    "gmm": SPACE, "tgmm": SPACE, "pairs_mgpu": _MGPU_SPACE,
    # the grouped products on Mosaic GPU, one warpgroup: accumulators of 64 x 128, 64 x 256 or
    # 128 x 128 (128 x 256 needs more registers than a thread has), contraction steps of 64 or
    # 128, 2 to 4 stages; also warp-specialized (12 warps: two computing warpgroups of 64 or
    # 128 columns, or rows of dW, each)
    "gmm_mgpu": tuple(TritonConfig(tm, tk, tn, 4, st) for tm, tn in _MGPU_ACC for tk in (64, 128)
                      for st in (2, 3, 4)) + tuple(
        TritonConfig(tm, 64, tn, 12, st) for tm in (64, 128) for tn in (64, 128)
        for st in (3, 4)),
    "tgmm_mgpu": tuple(TritonConfig(64, tk, tn, 4, st) for tk, tn in _MGPU_ACC
                       for st in (2, 3, 4)) + tuple(
        TritonConfig(64, tk, tn, 12, st) for tk in (64, 128) for tn in (64, 128)
        for st in (3, 4)),
    "decode_mgpu": tuple(TritonConfig(bk, bf, bd, 4, st, pf, sp) for bk, bf, bd, st in _DECODE_TILES
                         for pf, sp in _DECODE_PROGRAMS)}


def bucket(k: int, n: int) -> str:
    """The shape bucket of a product with contraction ``k`` and ``n`` output columns."""
    return f"k{pow2(k)}_n{pow2(n)}"


def _slug(device_kind: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in device_kind)


def op_file(kernel: str, device_kind: str) -> Path:
    """The file holding ``kernel``'s tuned entries for ``device_kind``, in its op package."""
    return _KERNELS_DIR / HOMES[kernel] / "tuned" / f"{_slug(device_kind)}.json"


def _named_table() -> Path | None:
    named = os.environ.get("MOEJAX_KERNEL_TABLE")
    return Path(named) if named else None


def table_files() -> list[Path]:
    """The files the lowerings read: ``MOEJAX_KERNEL_TABLE``'s, else every op's per-device
    files (module docstring)."""
    named = _named_table()
    if named is not None:
        return [named]
    return sorted(p for op in sorted(set(HOMES.values()))
                  for p in (_KERNELS_DIR / op / "tuned").glob("*.json"))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a kernel table ({e}); delete it or rerun "
                         "python -m experiments.benchmarks.autotune") from e


def read_table(path: Path | None = None) -> dict:
    """The tuned table ``{device: {kernel: {dtype: {bucket: entry}}}}``: one file of them
    (``path``, else ``MOEJAX_KERNEL_TABLE``), else the ops' per-device files merged (``{}``
    when there are none); every entry checked against the kernels' constraints
    (:func:`check_table`), and each op file's kernels against its op. A malformed file, a bad
    entry or a named file that does not exist is an error naming it."""
    path = _named_table() if path is None else Path(path)
    if path is not None:
        if not path.is_file():
            raise ValueError(f"{path}: no kernel table there (MOEJAX_KERNEL_TABLE or the path "
                             "given); fix the path, or unset it for the ops' own tables")
        table = _read_json(path)
        check_table(table, path)
        return table
    table: dict = {}
    for f in table_files():
        doc = _read_json(f)
        if not (isinstance(doc, dict) and isinstance(doc.get("device_kind"), str)
                and isinstance(doc.get("kernels"), dict)):
            raise ValueError(f"{f}: not an op's kernel table ({{\"device_kind\": ..., "
                             "\"kernels\": ...}}); delete it or rerun python -m "
                             "experiments.benchmarks.autotune")
        check_table({doc["device_kind"]: doc["kernels"]}, f)
        strays = [k for k in doc["kernels"] if op_file(k, doc["device_kind"]) != f]
        if strays:
            raise ValueError(f"{f}: kernels {strays} belong in their own op's tuned/ "
                             "(moejax.kernels.tuning.HOMES); move them there")
        for kernel, by_dtype in doc["kernels"].items():
            table.setdefault(doc["device_kind"], {})[kernel] = by_dtype
    return table


_POW2_TILE = (8, 1024)  # tiles: powers of two in this range
_WARPS = (4, 8, 12, 16)


def check_table(table, path) -> None:
    """Raise a ValueError naming the first entry that no kernel can launch: the layout
    ``{device: {kernel: {dtype: {bucket: entry}}}}``, a known kernel, a ``k<2^i>_n<2^j>``
    bucket, power-of-two tiles of 8 to 1024, 4 / 8 / 12 / 16 warps, 1 to 8 stages, a known
    L2 prefetch and at least one split of the model width."""
    def bad(where, what):
        raise ValueError(f"{path}: {where}: {what}; fix or delete the entry (python -m "
                         "experiments.benchmarks.autotune rewrites it)")

    if not isinstance(table, dict):
        bad("top level", "not a JSON object by device kind")
    for dev, kernels in table.items():
        if not isinstance(kernels, dict):
            bad(dev, "not an object by kernel")
        for kernel, dtypes in kernels.items():
            if kernel not in KERNELS or not isinstance(dtypes, dict):
                bad(f"{dev}/{kernel}", f"not a kernel's object (kernels: {', '.join(KERNELS)})")
            for dtype, buckets in dtypes.items():
                if not isinstance(buckets, dict):
                    bad(f"{dev}/{kernel}/{dtype}", "not an object by shape bucket")
                for b, entry in buckets.items():
                    _check_entry(f"{dev}/{kernel}/{dtype}/{b}", b, entry, bad)


def _check_entry(where, b, entry, bad) -> None:
    k, _, n = b.partition("_")
    if not (k[:1] == "k" and n[:1] == "n" and k[1:].isdigit() and n[1:].isdigit()
            and pow2(int(k[1:])) == int(k[1:]) and pow2(int(n[1:])) == int(n[1:])):
        bad(where, "the bucket is not k<power of two>_n<power of two>")
    if not isinstance(entry, dict) or any(f not in entry for f in ("tm", "tk", "tn")):
        bad(where, "not an object with tm, tk and tn")
    try:
        cfg = TritonConfig(**{f: int(entry[f]) for f in TritonConfig._fields if f in entry})
    except (TypeError, ValueError) as e:
        bad(where, f"a field is not an integer ({e})")
    lo, hi = _POW2_TILE
    for f in ("tm", "tk", "tn"):
        v = getattr(cfg, f)
        if not (lo <= v <= hi and v & (v - 1) == 0):
            bad(where, f"{f}={v}: a tile is a power of two from {lo} to {hi}")
    if cfg.num_warps not in _WARPS:
        bad(where, f"num_warps={cfg.num_warps}: one of {_WARPS}")
    if not 1 <= cfg.num_stages <= 8:
        bad(where, f"num_stages={cfg.num_stages}: 1 to 8")
    if not 0 <= cfg.l2_prefetch < len(L2_PREFETCH):
        bad(where, f"l2_prefetch={cfg.l2_prefetch}: 0 to {len(L2_PREFETCH) - 1} "
                   f"({', '.join(L2_PREFETCH)})")
    if cfg.d_splits < 1:
        bad(where, f"d_splits={cfg.d_splits}: at least 1")


# a jit-cache-sensitive context: the configuration every lowering inside uses (autotuning)
_FORCED = jax.make_user_context(None)


def forced(config: TritonConfig):
    """Lower every kernel inside this block with ``config`` (how :func:`tune`'s timer tries
    a candidate); part of jax's tracing cache key, so each candidate is traced anew."""
    return _FORCED(TritonConfig(*config))


def is_forced() -> bool:
    """Whether a :func:`forced` configuration is in effect (a kernel lowers it as given)."""
    return _FORCED.value is not None


def config_for(kernel: str, dtype, k: int, n: int, device_kind: str | None = None
               ) -> TritonConfig:
    """The launch configuration of ``kernel`` for ``dtype`` and shape ``(k, n)`` on
    ``device_kind`` (default: the device being lowered for): a :func:`forced` one, else the
    tuned one, else the default."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; known: {', '.join(KERNELS)}")
    if _FORCED.value is not None:
        return _FORCED.value
    name = jnp.dtype(dtype).name
    key = (kernel, name if (kernel, name) in DEFAULTS else "float32")
    if key not in DEFAULTS:
        raise ValueError(f"{kernel} takes {' / '.join(d for k, d in DEFAULTS if k == kernel)}, "
                         f"not {name}")
    kind = target_device()[1] if device_kind is None else device_kind
    entry = read_table().get(kind, {}).get(kernel, {}).get(name, {}).get(bucket(k, n))
    if entry is None:
        return DEFAULTS[key]
    # an entry written before a field existed takes that field's default
    return TritonConfig(**{f: int(entry[f]) for f in TritonConfig._fields if f in entry})


class WrongResult(Exception):
    """A configuration's output differs from the oracle's (raised by a :func:`tune` timer)."""


class Tuned(NamedTuple):
    """What :func:`tune` found: ``entries`` ``{kernel: {dtype: {bucket: winner}}}`` (each
    winner's fields and ``ms``) and ``trials``, one row per case and configuration tried
    (``ms`` None where it did not run or was wrong; ``outcome``: ``ok``, ``wrong: ...`` or
    ``cannot run: ...``)."""

    entries: dict
    trials: list


def check_close(got, want, dtype) -> float:
    """The largest error of ``got`` against the float32 oracle ``want``, relative to the
    oracle's largest value; raises :class:`WrongResult` past the dtype's tolerance (16-bit:
    2^-6, four bf16 steps; float32: 2^-7, for TF32 products) or on a shape mismatch. An
    empty oracle (nothing to compare: no row in any group) checks the shape only."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        raise WrongResult(f"shape {got.shape}, the oracle's {want.shape}")
    if want.size == 0:
        return 0.0
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max()) / (scale if scale > 0 else 1.0)
    tol = 2.0 ** -6 if jnp.dtype(dtype).itemsize == 2 else 2.0 ** -7
    if not err <= tol:  # NaN is wrong too
        raise WrongResult(f"error {err:.3g} of the oracle's largest value (allowed {tol:.3g})")
    return err


def tune(cases: Iterable[tuple[str, str, int, int]], space: Sequence[TritonConfig],
         time_fn: Callable[[str, str, int, int, TritonConfig], float]) -> Tuned:
    """For each case ``(kernel, dtype, k, n)`` the configuration of ``space`` with the
    smallest ``time_fn(kernel, dtype, k, n, config)`` (seconds), with its time in ``ms``. A
    configuration for which ``time_fn`` raises :class:`WrongResult` (its output is not the
    oracle's) or any other error (it does not fit the device or the shape) is skipped and
    recorded in the trials; a case that no configuration ran correctly has no entry (its
    trials say why), so the cases that did are kept."""
    out: dict = {}
    trials: list = []
    for kernel, dtype, k, n in cases:
        best = None
        for cfg in space:
            row = {"kernel": kernel, "dtype": dtype, "bucket": bucket(k, n), **cfg._asdict()}
            try:
                t = float(time_fn(kernel, dtype, k, n, cfg))
            except WrongResult as e:
                trials.append({**row, "ms": None, "outcome": f"wrong: {e}"})
                continue
            except Exception as e:  # does not fit the device or the shape  # noqa: BLE001
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                trials.append({**row, "ms": None, "outcome": f"cannot run: {msg}"})
                continue
            trials.append({**row, "ms": round(t * 1e3, 4), "outcome": "ok"})
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is None:
            continue
        entry = {**best[1]._asdict(), "ms": round(best[0] * 1e3, 4)}
        out.setdefault(kernel, {}).setdefault(dtype, {})[bucket(k, n)] = entry
    return Tuned(out, trials)


def write_entries(device_kind: str, entries: dict, path: Path | None = None) -> list[Path]:
    """Merge ``entries`` (from :func:`tune`) under ``device_kind`` into each kernel's op file
    (:func:`op_file`), or into the one file ``path`` (else ``MOEJAX_KERNEL_TABLE``) names;
    atomic per file. Returns the files written."""
    path = _named_table() if path is None else Path(path)
    if path is not None:
        table = read_table(path) if path.is_file() else {}
        dev = table.setdefault(device_kind, {})
        for kernel, by_dtype in entries.items():
            for dtype, by_bucket in by_dtype.items():
                dev.setdefault(kernel, {}).setdefault(dtype, {}).update(by_bucket)
        atomic_write_text(path, json.dumps(table, indent=1, sort_keys=True) + "\n")
        return [path]
    written = []
    for f in sorted({op_file(k, device_kind) for k in entries}):
        doc = ({"device_kind": device_kind, "kernels": {}} if not f.is_file()
               else _read_json(f))
        for kernel, by_dtype in entries.items():
            if op_file(kernel, device_kind) != f:
                continue
            for dtype, by_bucket in by_dtype.items():
                doc["kernels"].setdefault(kernel, {}).setdefault(dtype, {}).update(by_bucket)
        check_table({device_kind: doc["kernels"]}, f)
        f.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f, json.dumps(doc, indent=1, sort_keys=True) + "\n")
        written.append(f)
    return written
