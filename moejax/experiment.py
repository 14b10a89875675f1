"""Command-line runner shared by every ``experiments/<name>.py`` module.

An experiment module defines

* ``make_config(preset: str) -> Config``: the frozen config of a preset (``"quick"`` for CPU
  minutes, ``"full"`` for GPU and real pretrained weights);
* ``run(cfg, run: RunDir) -> dict``: the study; writes tables/plots into ``run`` and returns a
  small dict of headline numbers;

and ends with ``if __name__ == "__main__": main(NAME, make_config, run)``, so that

    python -m experiments.<name> preset=full model.d_model=512 out=runs/mine

works. ``preset`` and ``out`` are the runner's own keys; every other ``key=value`` goes through
:func:`moejax.config.apply_overrides`, so an unknown key or a bad value fails before any
compute with a message naming the key and the allowed keys/values.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moejax.config import Config, ConfigError, apply_overrides, describe
from moejax.results import RunDir

__all__ = ["parse_cli", "run_experiment", "main", "usage", "PRESETS"]

PRESETS = ("quick", "full")


def usage(name: str, make_config: Callable[[str], Config], preset: str = "quick") -> str:
    """The ``--help`` text: the runner's keys and every config key with its default (of
    ``preset``) and allowed values."""
    head = [f"usage: python -m experiments.{name} [preset=quick|full] [out=DIR] [key=value ...]",
            "", f"runner keys: preset ({' | '.join(PRESETS)}; default quick), "
            f"out (run directory; default runs/{name})", "",
            f"config keys (defaults of preset={preset}):"]
    return "\n".join(head + describe(make_config(preset)))


def parse_cli(
    name: str, make_config: Callable[[str], Config], argv: Sequence[str]
) -> tuple[Config, Path]:
    preset, out, rest = "quick", Path("runs") / name, []
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"bad argument {item!r}: expected key=value (e.g. preset=full)")
        if key == "preset":
            if value not in PRESETS:
                raise ConfigError(f"preset={value!r} is not allowed; allowed values: {PRESETS}")
            preset = value
        elif key == "out":
            out = Path(value)
        else:
            rest.append(item)
    cfg = apply_overrides(make_config(preset), rest)
    return cfg, out


def run_experiment(
    name: str,
    make_config: Callable[[str], Config],
    run_fn: Callable[[Config, RunDir], dict[str, Any]],
    argv: Sequence[str] = (),
    *,
    out: Path | None = None,
) -> tuple[dict[str, Any], RunDir]:
    cfg, default_out = parse_cli(name, make_config, argv)
    run = RunDir.create(out or default_out, cfg, name=name)
    t0 = time.time()
    summary = dict(run_fn(cfg, run) or {})
    summary.setdefault("wall_s", round(time.time() - t0, 1))
    run.finish(summary.pop("headline", ""))
    return summary, run


def main(
    name: str,
    make_config: Callable[[str], Config],
    run_fn: Callable[[Config, RunDir], dict[str, Any]],
    argv: Sequence[str] | None = None,
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        preset = next((a.split("=", 1)[1] for a in argv if a.startswith("preset=")), "quick")
        print(usage(name, make_config, preset if preset in PRESETS else "quick"))
        return 0
    try:
        summary, run = run_experiment(name, make_config, run_fn, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[{name}] wrote {run.path / 'summary.md'}")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    return 0
