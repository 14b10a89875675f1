"""The flat study modules of the last release (``experiments/<name>.py``), kept for one
release: run, each names its new command on one line and runs it; imported, each is the
study's module itself."""

from __future__ import annotations

import importlib
import runpy
import sys

from experiments import STUDIES, TOOLS


def moved(name: str, module_name: str) -> None:
    """Called by ``experiments/<name>.py`` with its ``__name__``."""
    target = {**STUDIES, **TOOLS}[name]
    if module_name == "__main__":
        print(f"experiments.{name} moved: python -m {target}", file=sys.stderr, flush=True)
        sys.argv[0] = target
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.modules[module_name] = importlib.import_module(target)
