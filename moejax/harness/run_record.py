"""A run's record, ``run.json`` beside its ``summary.md``: which study ran there with which
config (its hash), its state (``running``, ``finished`` or ``interrupted``), the command that
reproduces it (shell-quoted), when it ran and for how long, its seeds, the tables it wrote
(and each seed run's) and the machine (:func:`machine_info`), read back by the results
documents and the run index.

A run directory holds one run. :func:`claim_run_dir` decides, before anything is written,
whether a study may start in a directory: not over another study's run, nor over the same
study's finished run of another config, unless told to overwrite; then it clears the old
run's results (:func:`clear_results`) and marks the directory ``running``."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib

from moejax.files import atomic_write_text

__all__ = ["machine_info", "write_run_record", "config_hash", "read_run_record",
           "claim_run_dir", "mark_run_state", "clear_results", "RUN_STATES", "RunOwnerError"]

RUN_STATES = ("running", "finished", "interrupted")
RESULT_SUFFIXES = (".csv", ".md", ".png")  # what a run writes beside run.json and config.json
# a benchmark's kept measurements (moejax.bench.resume.MeasurementStore): results too, so a
# run that replaces this one measures everything again
MEASUREMENT_FILES = "measured*.json"
# folders of a run's results besides its tables: the compiled programs a benchmark traced
RESULT_DIRS = ("programs",)


class RunOwnerError(ValueError):
    """A run directory holds a run the new one must not replace; the message names the
    directory, what it holds and the fix."""


def config_hash(cfg_dict: Mapping[str, Any]) -> str:
    """A short hash of a resolved config (its JSON with sorted keys)."""
    text = json.dumps(cfg_dict, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_run_record(path: str | os.PathLike) -> dict | None:
    """The ``run.json`` of a run directory; ``None`` if there is none; ``{"unreadable":
    reason}`` if it cannot be parsed. A record from before states were kept counts as
    finished, and its config hash is that of the directory's ``config.json``."""
    path = Path(path)
    try:
        record = json.loads((path / "run.json").read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}
    record.setdefault("state", "finished")
    if "config_hash" not in record:
        try:
            record["config_hash"] = config_hash(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError):
            record["config_hash"] = ""
    return record


def _entry(study: str, variant: str) -> str:
    return f"{study}[{variant}]" if variant else study


def claim_run_dir(path: str | os.PathLike, *, study: str, variant: str, cfg_hash: str,
                  argv: Sequence[str], overwrite: bool = False,
                  resume_force: bool = False, module: str = "") -> None:
    """Take ``path`` for a run of ``study`` (``variant``) with config hash ``cfg_hash``.

    Refused (:class:`RunOwnerError`, before anything is written) when the directory holds
    another study's run, an unreadable record, or this study's finished run of another
    config, unless ``overwrite``: then the old run's results are cleared first. This study's
    running or interrupted run (a resume), its finished run of the same config (a rerun), or,
    with ``resume_force`` (the config's ``resume=force``: continue it under the changed
    config), its finished run of another config, is taken as it is. The record is then
    written with state ``running``."""
    path = Path(path)
    old = read_run_record(path)
    if old is not None and not overwrite:
        who = _entry(old.get("study", "?"), old.get("variant", ""))
        what = (f"an unreadable run.json ({old['unreadable']})" if "unreadable" in old else
                f"a {old.get('state')} run of {who}")
        fix = ("choose another out=, or add overwrite=true to replace it (its tables, seed runs, "
               "plots, measurements and traced programs are deleted first; checkpoints are "
               "kept)")
        if "unreadable" in old or (old.get("study"), old.get("variant", "")) != (study, variant):
            raise RunOwnerError(f"out={path} holds {what}; {fix}")
        if old["state"] == "finished" and old.get("config_hash") != cfg_hash and not resume_force:
            raise RunOwnerError(f"out={path} holds {what} with another config "
                                f"(config.json differs); {fix}")
    if old is not None and overwrite:
        clear_results(path)
    path.mkdir(parents=True, exist_ok=True)
    record = {"study": study, "variant": variant, "config_hash": cfg_hash, "state": "running",
              "command": _command(study, argv, module), "started": _now(time.time())}
    atomic_write_text(path / "run.json", json.dumps(record, indent=2) + "\n")


def mark_run_state(path: str | os.PathLike, state: str) -> None:
    """Set the state of the run recorded in ``path`` (e.g. ``interrupted`` when it stops
    early); nothing when it has no readable record."""
    if state not in RUN_STATES:
        raise ValueError(f"state={state!r}: one of {', '.join(RUN_STATES)}")
    record = read_run_record(path)
    if record is None or "unreadable" in record:
        return
    record["state"] = state
    atomic_write_text(Path(path) / "run.json", json.dumps(record, indent=2) + "\n")


def clear_results(path: str | os.PathLike) -> list[str]:
    """Delete what a run reports in ``path``: its record, summary, tables, notes and plots
    (``run.json`` and the ``*.csv``, ``*.md``, ``*.png`` beside it), its kept measurements
    (:data:`MEASUREMENT_FILES`), its result folders (:data:`RESULT_DIRS`) and its seed runs
    (``seed_<i>/``). Checkpoints, caches and anything else stay (a trained model is reused
    when its config allows, :mod:`moejax.train.loop`). Returns the names removed."""
    path, removed = Path(path), []
    for entry in sorted(path.iterdir()) if path.is_dir() else []:
        name = entry.name
        if entry.is_dir() and not entry.is_symlink() and (
                name in RESULT_DIRS or name.startswith("seed_") and name[5:].isdigit()):
            shutil.rmtree(entry)
        elif entry.is_file() and (name == "run.json" or entry.suffix in RESULT_SUFFIXES
                                  or entry.match(MEASUREMENT_FILES)):
            entry.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _command(study: str, argv: Sequence[str], module: str = "") -> str:
    """The command that reproduces the run: ``python -m <module>`` (default
    ``experiments.<study>``) with its arguments, shell-quoted."""
    return shlex.join(["python", "-m", module or "experiments." + study, *argv])


def _now(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What a result was measured on: CPU model and cores, OS, Python and library versions,
    the accelerator jax sees (``"none"`` on a CPU-only machine), the ``XLA_FLAGS`` it ran
    under and the load average when the record was written (other work on the machine slows
    timings)."""
    dev = jax.devices()[0]
    accel = "none" if dev.platform == "cpu" else f"{jax.device_count()} x {dev.device_kind}"
    return {"cpu": _cpu_model(), "cores": os.cpu_count(),
            "os": f"{platform.system()} {platform.machine()}",
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "accelerator": accel,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


def write_run_record(path: str | os.PathLike, *, study: str, argv: Sequence[str],
                     started: float, repeat: int, seeds: Mapping[str, Sequence[int]],
                     scale: str = "", variant: str = "", cfg_hash: str = "",
                     tables: Sequence[str] = (),
                     seed_runs: Mapping[str, Sequence[str]] | None = None,
                     preset: str = "quick", smoke: bool = False,
                     kind: str = "preset", module: str = "", resumed: bool = False) -> Path:
    """``run.json`` of a finished run beside its ``summary.md``: the command that reproduces
    it (shell-quoted), when it ran and for how long, its seeds, the scale it trained at
    (:mod:`moejax.train.scale`), the variant it is (``""``: the study's own), its config hash,
    the tables it wrote (``tables``: CSV stems; ``seed_runs``: each seed run's directory and
    stems), its preset, whether it was a smoke run, its ``kind`` (``"preset"``: the study's
    preset config, variants included, at its default repeat; ``"trial"``: anything else), and
    the machine; read back by the results documents and the run index. ``module``: the
    study's module, which the command runs (default ``experiments.<study>``); ``resumed``:
    the run continued a stopped run in its directory, so its wall time leaves out the stopped
    run's (recorded only where true)."""
    record = {"study": study, "variant": variant, "config_hash": cfg_hash,
              "state": "finished", "scale": scale, "preset": preset, "smoke": smoke,
              "kind": kind,
              "command": _command(study, argv, module), "started": _now(started),
              "wall_s": round(time.time() - started, 1), "repeat": repeat,
              "seeds": {k: list(v) for k, v in seeds.items()}, "tables": list(tables),
              "seed_runs": {k: list(v) for k, v in (seed_runs or {}).items()},
              "machine": machine_info()}
    if resumed:
        record["resumed"] = True
    out = Path(path) / "run.json"
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    return out
