"""A run's record, ``run.json`` beside its ``summary.md``: the command that reproduces it,
when it ran and for how long, its seeds and the machine (:func:`machine_info`), read back by
the results documents and the run index."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib

from moejax.files import atomic_write_text

__all__ = ["machine_info", "write_run_record"]


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
                     scale: str = "", variant: str = "") -> Path:
    """``run.json`` beside a run's ``summary.md``: the command that reproduces it, when it
    ran and for how long, its seeds, the scale it trained at (:mod:`moejax.train.scale`),
    the variant it is (``""``: the study's own) and the machine, read back by the results
    document."""
    record = {"study": study, "variant": variant, "scale": scale,
              "command": " ".join(["python -m experiments." + study, *argv]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "wall_s": round(time.time() - started, 1), "repeat": repeat,
              "seeds": {k: list(v) for k, v in seeds.items()}, "machine": machine_info()}
    out = Path(path) / "run.json"
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    return out
