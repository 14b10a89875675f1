"""Which of the named core dependencies this Python lacks or has outside pyproject.toml's range.

``scripts/gpu_check.sh`` asks it which of a GPU image's packages to replace by the
wheelhouse's ``floor/`` wheels, so the range has one home, ``pyproject.toml``: an image's flax
below the floor (which does not import on that jax) or past the ceiling is replaced, one in
range is kept. Standard library and ``packaging`` only (it runs before anything is installed).

    python scripts/unmet_deps.py flax optax chex orbax_checkpoint   # prints e.g. "flax chex"
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def core_ranges(pyproject: Path = PYPROJECT) -> dict[str, Requirement]:
    """pyproject.toml's core dependencies by canonical name."""
    deps = tomllib.loads(Path(pyproject).read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


def unmet(names: Iterable[str], version_of: Callable[[str], str] = md.version,
          pyproject: Path = PYPROJECT) -> list[str]:
    """The names (as given) whose installed version is missing or outside the range; raises
    ``ValueError`` for a name that is not a core dependency."""
    ranges = core_ranges(pyproject)
    out = []
    for name in names:
        req = ranges.get(canonicalize_name(name))
        if req is None:
            raise ValueError(f"{name!r} is not a core dependency in {pyproject.name}; those "
                             f"are {', '.join(sorted(ranges))}")
        try:
            ok = req.specifier.contains(version_of(name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            out.append(name)
    return out


if __name__ == "__main__":
    try:
        print(" ".join(unmet(sys.argv[1:])))
    except ValueError as e:
        raise SystemExit(f"unmet_deps: {e}") from None
