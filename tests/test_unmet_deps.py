"""scripts/unmet_deps.py: which of a GPU image's core packages gpu_check.sh replaces by the
wheelhouse's floor/ wheels, judged by pyproject.toml's ranges; the floor/ pins meet them."""

import importlib.metadata as md
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("unmet_deps", ROOT / "scripts/unmet_deps.py")
unmet_deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unmet_deps)

NAMES = ("flax", "optax", "chex", "orbax_checkpoint")


def _versions(**have):
    def version_of(name):
        if name not in have:
            raise md.PackageNotFoundError(name)
        return have[name]
    return version_of


def test_a_package_below_the_floor_past_the_ceiling_or_missing_is_unmet():
    ok = dict(flax="0.12.12", optax="0.2.8", chex="0.1.92", orbax_checkpoint="0.12.8")
    assert unmet_deps.unmet(NAMES, _versions(**ok)) == []
    # flax 0.12.8 does not import on jax 0.11: below pyproject's floor, so replaced
    assert unmet_deps.unmet(NAMES, _versions(**{**ok, "flax": "0.12.8"})) == ["flax"]
    assert unmet_deps.unmet(NAMES, _versions(**{**ok, "optax": "0.3.0"})) == ["optax"]
    missing = {k: v for k, v in ok.items() if k != "chex"}
    assert unmet_deps.unmet(NAMES, _versions(**missing)) == ["chex"]


def test_a_name_outside_the_core_dependencies_is_refused():
    with pytest.raises(ValueError, match="'torch' is not a core dependency in pyproject.toml"):
        unmet_deps.unmet(["torch"], _versions(torch="2.4"))


def test_the_wheelhouse_floor_pins_meet_the_ranges():
    text = (ROOT / "scripts/gpu_wheelhouse.sh").read_text()
    line = next(x for x in text.splitlines() if x.startswith('get "$dir/floor"'))
    pins = dict(re.findall(r"([\w-]+)==([\w.]+)", line))
    assert {k.replace("-", "_") for k in pins} == set(NAMES), pins
    have = {k.replace("-", "_"): v for k, v in pins.items()}
    assert unmet_deps.unmet(NAMES, _versions(**have)) == []
