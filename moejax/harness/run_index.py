"""The run index: one JSON line per finished study run, wherever its directory lives, so that
each results document is generated from the newest run of every study on its machine class.

The runner (:func:`.experiment.run_experiment`) appends a line when a study's top-level
run has finished: the study, the run directory's absolute path, the preset, its kind
(``preset``: the study's preset config at its default repeat, the only runs the results
documents publish; ``trial``: anything overridden), the machine class (``cpu``, ``gpu`` or
``tpu``, from the run's ``run.json``) and when it finished. Smoke runs (``smoke=true`` in the
run's record) are not results and are not indexed. :func:`newest` reads the index back: per
study the newest line of a kind whose directory still holds the finished run it recorded (its
``run.json`` in state ``finished``, of the line's study, variant, kind, machine class and
start time: a directory another run was since written over holds that run, not this line's),
malformed lines counted and skipped. A run directory moved together
with its index (a GPU machine's ``runs/gpu`` copied back here) is found beside the index
under its own name.

The index lives beside the runs it indexes: ``index.jsonl`` in the run directory's parent
(``runs/index.jsonl`` for the default ``out=runs/<study>``), or ``$MOEJAX_RUN_INDEX`` when
set. :func:`index_paths` lists what a reader reads: ``$MOEJAX_RUN_INDEX``, else every
``index.jsonl`` under ``runs/``.
Each line is appended with one ``write`` on a file opened for appending, so runs finishing at
once do not interleave their lines; a line cut off without its newline (a full disk, a kill)
is closed first, so the next line starts on its own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from moejax.harness.run_record import read_run_record

__all__ = ["ENV", "KINDS", "index_path", "index_paths", "machine_class", "record", "newest",
           "entry_name"]

ENV = "MOEJAX_RUN_INDEX"
KINDS = ("preset", "trial")


def index_path(run_dir: str | os.PathLike | None = None) -> Path:
    """Where a run's line goes: ``$MOEJAX_RUN_INDEX``, else ``index.jsonl`` beside the run
    directory (in its parent), else ``runs/index.jsonl``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if run_dir is not None:
        return Path(run_dir).resolve().parent / "index.jsonl"
    return Path("runs") / "index.jsonl"


def index_paths(root: str | os.PathLike = "runs") -> list[Path]:
    """The indexes a reader reads: ``$MOEJAX_RUN_INDEX``, else every ``index.jsonl`` under
    ``root``."""
    if os.environ.get(ENV):
        return [Path(os.environ[ENV])]
    return sorted(Path(root).glob("**/index.jsonl"))


def entry_name(study: str, variant: str = "") -> str:
    """What the index and the documents call a run: the study, or ``study[variant]``."""
    return f"{study}[{variant}]" if variant else study


def machine_class(machine: Mapping) -> str:
    """``cpu``, ``gpu`` or ``tpu`` from a ``run.json`` machine record's accelerator."""
    accel = str(machine.get("accelerator", "none")).lower()
    if accel in ("", "none"):
        return "cpu"
    return "tpu" if "tpu" in accel else "gpu"


def record(run_dir: str | os.PathLike, index: Path | None = None) -> dict | None:
    """Append the finished run in ``run_dir`` (its ``run.json``) to the index; returns the
    line written, or None for a smoke run (not a result)."""
    run_dir = Path(run_dir).resolve()
    meta = json.loads((run_dir / "run.json").read_text())
    if "smoke" in meta:  # the recorded config, never a search of the command line
        smoke, preset = bool(meta["smoke"]), str(meta.get("preset", "quick"))
    else:  # a record from before these were kept
        command = str(meta.get("command", ""))
        smoke = bool(re.search(r"(^|\s)smoke=(true|1|yes)(\s|$)", command))
        found = re.search(r"(^|\s)preset=(\w+)", command)
        preset = found.group(2) if found else "quick"
    if smoke:
        return None
    line = {"study": meta["study"], "variant": meta.get("variant", ""), "path": str(run_dir),
            "preset": preset, "kind": str(meta.get("kind") or _legacy_kind(run_dir)),
            "machine": machine_class(meta.get("machine", {})),
            "started": str(meta.get("started", "")),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "t": time.time()}
    index = index or index_path(run_dir)
    index.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(index, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        cut = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        os.write(fd, (("\n" if cut else "") + json.dumps(line) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return line


def newest(machine: str, index: Path | Sequence[Path] | None = None, *,
           preset: str | None = None, kind: str = "preset") -> tuple[dict[str, Path], int]:
    """``({study or study[variant]: run directory}, skipped lines)``: per study (and per
    declared variant, :func:`entry_name`) the newest run of ``machine`` and ``kind`` (and
    ``preset``, if given) in the indexes (default :func:`index_paths`) whose directory still
    holds its ``run.json``. A line from before kinds were kept takes its run's recorded
    command: any config key on it makes a trial."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {KINDS}")
    indexes = (index_paths() if index is None else [index] if isinstance(index, Path | str)
               else list(index))
    best: dict[str, tuple[float, Path]] = {}
    skipped = 0
    raws = [(i, raw) for i in map(Path, indexes) if i.is_file()
            for raw in i.read_text().splitlines()]
    for index_file, raw in raws:
        try:
            line = json.loads(raw)
            study = entry_name(line["study"], line.get("variant", ""))
            path = _located(Path(line["path"]), index_file, line["study"])
            t = float(line["t"])
            if line["machine"] != machine or (preset and line["preset"] != preset):
                continue
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        if (t >= best.get(study, (-1.0, path))[0] and _holds(path, line)
                and (line.get("kind") or _legacy_kind(path)) == kind):
            best[study] = (t, path)
    return {study: path for study, (_, path) in best.items()}, skipped


def _located(path: Path, index_file: Path, study: str) -> Path:
    """The run directory an index line names: its recorded path, or, where that is gone, the
    directory of the same name beside the index holding a run of the same study (the runs and
    their index moved together, e.g. brought back from a GPU machine)."""
    if path.is_dir():
        return path
    moved = index_file.parent / path.name
    record = read_run_record(moved) if moved.is_dir() else None
    return moved if record is not None and record.get("study") == study else path


def _holds(path: Path, line: Mapping) -> bool:
    """Whether ``path`` still holds the finished run ``line`` recorded
    (:func:`moejax.harness.run_record.read_run_record`: a record from before states were kept
    counts): the same study, variant and kind, machine class and start time where the record
    keeps them. A directory another run has since been written over (``overwrite=true``, or
    a rerun) holds that run, which its own line names."""
    record = read_run_record(path)
    if record is None or record.get("state") != "finished":
        return False
    same = [(record.get("study"), line["study"]), (record.get("variant", ""),
                                                    line.get("variant", ""))]
    if record.get("kind") and line.get("kind"):
        same.append((record["kind"], line["kind"]))
    if record.get("machine"):
        same.append((machine_class(record["machine"]), line["machine"]))
    if line.get("started"):
        same.append((str(record.get("started", "")), line["started"]))
    return all(a == b for a, b in same)


_RUNNER_KEYS = ("preset", "out", "variant", "overwrite")


def _legacy_kind(path: Path) -> str:
    """The kind of a run indexed before kinds were kept: ``trial`` when its recorded command
    sets any key besides the runner's own (``preset``, ``out``, ``variant``, ``overwrite``)."""
    record = read_run_record(path) or {}
    if record.get("kind") in KINDS:
        return record["kind"]
    try:
        argv = shlex.split(str(record.get("command", "")))[3:]
    except ValueError:
        return "trial"
    return "trial" if any(a.partition("=")[0] not in _RUNNER_KEYS for a in argv) else "preset"
