"""The run index: one JSON line per finished study run, wherever its directory lives, so that
each results document is generated from the newest run of every study on its machine class.

The runner (:func:`moejax.experiment.run_experiment`) appends a line when a study's top-level
run has finished: the study, the run directory's absolute path, the preset, the machine class
(``cpu``, ``gpu`` or ``tpu``, from the run's ``run.json``) and when it finished. Smoke runs
(``smoke=true`` in the run's record) are not results and are not indexed. :func:`newest`
reads the index back: per study the newest line whose directory still holds a finished run
(its ``run.json`` in state ``finished``), malformed lines counted and skipped.

The index is ``$MOEJAX_RUN_INDEX``, else ``runs/index.jsonl`` under the working directory.
Each line is appended with one ``write`` on a file opened for appending, so runs finishing at
once do not interleave their lines; a line cut off without its newline (a full disk, a kill)
is closed first, so the next line starts on its own.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

from moejax.run_record import read_run_record

__all__ = ["ENV", "index_path", "machine_class", "record", "newest", "entry_name"]

ENV = "MOEJAX_RUN_INDEX"


def index_path() -> Path:
    """Where the index is: ``$MOEJAX_RUN_INDEX``, else ``runs/index.jsonl``."""
    return Path(os.environ.get(ENV) or Path("runs") / "index.jsonl")


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
            "preset": preset,
            "machine": machine_class(meta.get("machine", {})),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "t": time.time()}
    index = index or index_path()
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


def newest(machine: str, index: Path | None = None, *,
           preset: str | None = None) -> tuple[dict[str, Path], int]:
    """``({study or study[variant]: run directory}, skipped lines)``: per study (and per
    declared variant, :func:`entry_name`) the newest indexed run of
    ``machine`` (and ``preset``, if given) whose directory still holds its ``run.json``."""
    index = index or index_path()
    best: dict[str, tuple[float, Path]] = {}
    skipped = 0
    if not index.is_file():
        return {}, 0
    for raw in index.read_text().splitlines():
        try:
            line = json.loads(raw)
            study = entry_name(line["study"], line.get("variant", ""))
            path, t = Path(line["path"]), float(line["t"])
            if line["machine"] != machine or (preset and line["preset"] != preset):
                continue
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        if _finished(path) and t >= best.get(study, (-1.0, path))[0]:
            best[study] = (t, path)
    return {study: path for study, (_, path) in best.items()}, skipped


def _finished(path: Path) -> bool:
    """Whether ``path`` holds a finished run (:func:`moejax.run_record.read_run_record`: a
    record from before states were kept counts)."""
    record = read_run_record(path)
    return record is not None and record.get("state") == "finished"
