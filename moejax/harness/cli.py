"""A study's command line: the runner's own keys (``preset``, ``out``, ``repeat``, ``smoke``,
``variant``, ``overwrite``) parsed and checked, every other ``key=value`` applied to the
preset's config (:func:`moejax.config_overrides.apply_overrides`), and the ``--help`` text."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from moejax.config import Config, ConfigError
from moejax.config_overrides import apply_overrides, close_names, describe
from moejax.harness.smoke import smoke_config

__all__ = ["HELP_WORDS", "PRESETS", "asks_help", "expand_variant", "flag", "meant",
           "parse_cli", "parse_runner", "preset_of", "run_module", "split_overwrite",
           "study_names", "usage"]

PRESETS = ("quick", "full")
RUNNER_KEYS = ("preset", "out", "repeat", "smoke", "variant", "overwrite")
HELP_WORDS = ("-h", "--help", "help")  # any of them on a command line prints its usage


def asks_help(argv: Sequence[str]) -> bool:
    """Whether a command line asks for its usage (one of :data:`HELP_WORDS`): every moejax
    command then prints it and exits 0, before any check of the machine or the arguments."""
    return any(a in HELP_WORDS for a in argv)


def run_module(name: str, run_fn) -> str:
    """The module ``python -m`` runs a study as: its recipe's (``run_fn``'s; run as
    ``__main__``, the module ``python -m`` ran) where that is a module of ``experiments``,
    else ``experiments.<name>``."""
    module = getattr(run_fn, "__module__", "") or ""
    if module == "__main__":  # run as python -m <module>: the name it was run by
        module = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", "") or ""
    return module if module.startswith("experiments.") else f"experiments.{name}"


def usage(name: str, make_config: Callable[[str], Config], preset: str = "quick",
          variants: Mapping[str, Sequence[str]] | None = None, module: str = "",
          derived: Mapping[str, str] | None = None) -> str:
    """The ``--help`` text: the runner's keys, the study's variants and every config key with
    its default (of ``preset``) and allowed values, and the keys the study sets itself
    (``derived``); ``module``: what ``python -m`` runs (default ``experiments.<name>``)."""
    head = [f"usage: python -m {module or 'experiments.' + name} [preset=quick|full] [out=DIR] "
            "[repeat=N] [smoke=true] [variant=NAME] [overwrite=true] [key=value ...]",
            "", f"runner keys: preset ({' | '.join(PRESETS)}; default quick), "
            f"out (run directory; default runs/{name}), repeat (runs over seeds, mean and "
            "std of every table; default: the study's), smoke (true: every training run and "
            "evaluation cut to a couple of steps and batches, model sizes kept), variant (one "
            "of the study's declared variants: its overrides, its own run directory and "
            "results section), overwrite (true: replace a run of another study or config "
            "in out, deleting its tables, seed runs, plots, a benchmark's kept timings and "
            "traced programs first, checkpoints kept; "
            "default false)", ""]
    head += [f"variant {v}: {' '.join(o)}" for v, o in (variants or {}).items()]
    head += ["" if variants else None, f"config keys (defaults of preset={preset}):"]
    tail = ["", "set by the study itself (refused on the command line):",
            *(f"  {k}: {why}" for k, why in derived.items())] if derived else []
    return "\n".join([h for h in head if h is not None] + describe(make_config(preset)) + tail)


def parse_cli(
    name: str, make_config: Callable[[str], Config], argv: Sequence[str]
) -> tuple[Config, Path]:
    cfg, out, _ = parse_runner(name, make_config, argv)
    return cfg, out


def parse_runner(
    name: str, make_config: Callable[[str], Config], argv: Sequence[str],
    quick_repeat: int = 1, smoke_overrides: Sequence[str] = (),
    derived: Mapping[str, str] | None = None, variant_overrides: Sequence[str] = (),
) -> tuple[Config, Path, int]:
    """``(config, out dir, repeat)`` of a command line; ``repeat`` defaults to
    ``quick_repeat`` with the quick preset and to 1 with the full one or a smoke run.
    ``variant_overrides``: the chosen variant's, part of the preset it runs, so applied
    first (a smoke run cuts the variant's training too). ``smoke_overrides``: the study's own
    cuts for ``smoke=true``, applied after the smoke cut and before the command line's keys
    (which win). ``derived``: the config keys the study sets itself (key -> what sets it),
    refused: their value would be recorded, never run."""
    preset, out, rest, repeat, smoke = "quick", Path("runs") / name, [], None, False
    seen: set[str] = set()
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"bad argument {item!r}: expected key=value (e.g. preset=full)")
        if key in ("preset", "out", "repeat", "smoke"):
            if key in seen:
                raise ConfigError(f"{key} is given twice; give each key once")
            seen.add(key)
        if key == "preset":
            if value not in PRESETS:
                raise ConfigError(f"preset={value!r} is not allowed; allowed values: {PRESETS}")
            preset = value
        elif key == "out":
            if not value.strip():
                raise ConfigError("out= is empty: name the run directory (e.g. out=runs/mine)")
            out = Path(value)
        elif key == "repeat":
            try:
                repeat = int(value)
            except ValueError:
                repeat = 0
            if repeat < 1:
                raise ConfigError(f"repeat={value!r}: expected an int >= 1 (runs over seeds)")
        elif key == "smoke":
            if value not in ("true", "false"):
                raise ConfigError(f"smoke={value!r}: expected true or false")
            smoke = value == "true"
        elif key in (derived or {}):
            raise ConfigError(f"{key} is set by the study itself ({derived[key]}): a value "
                              "given here would be recorded but not run")
        else:
            rest.append(item)
    cfg = apply_overrides(make_config(preset), list(variant_overrides))
    _refuse_misspelt_runner_keys(cfg, rest)
    if smoke:
        cfg = apply_overrides(smoke_config(cfg), list(smoke_overrides))
    cfg = apply_overrides(cfg, rest)
    if repeat is None:
        repeat = quick_repeat if preset == "quick" and not smoke else 1
    return cfg, out, repeat


def _refuse_misspelt_runner_keys(cfg: Config, items: Sequence[str]) -> None:
    """Refuse a ``key=value`` that is no config key but close to a runner key (``prest=full``)
    with the runner key it meant, before the config's own unknown-key error hides it."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    for item in items:
        key = item.partition("=")[0].strip()
        near = close_names(key, RUNNER_KEYS, n=1)
        if key.split(".")[0] not in fields and near:
            raise ConfigError(f"unknown key {key!r} (did you mean the runner key {near[0]!r}?); "
                              f"runner keys: {', '.join(RUNNER_KEYS)}")


def meant(names: Sequence[str], known: Sequence[str]) -> str:
    """`` (did you mean 'x' for 'y'?)`` for each of ``names`` that is a close spelling of one
    of ``known``; "" where none is."""
    pairs = [(close_names(n, known, n=1), n) for n in names]
    said = [f"{near[0]!r} for {n!r}" for near, n in pairs if near]
    return f" (did you mean {', '.join(said)}?)" if said else ""


def study_names(value: str, registry: Sequence[str], key: str = "only") -> list[str]:
    """The studies a suite's ``key=a,b`` names, in its order: each named once and registered
    in ``registry``, or the list is refused in one line (an empty name, a name given twice,
    a name not registered, with the registered names spelt close to it)."""
    names = [n.strip() for n in value.split(",")]
    if "" in names:
        raise ConfigError(f"{key}={value!r} holds an empty name; give study names separated "
                          f"by commas, e.g. {key}={','.join(registry[:2])}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{key}={value} names {', '.join(twice)} twice; name each study "
                          "once")
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ConfigError(f"{key}={unknown} not registered{meant(unknown, registry)}; "
                          f"registered: {', '.join(registry)}")
    return names


def preset_of(argv: Sequence[str]) -> str:
    """The ``preset=`` of a command line (default quick)."""
    return next((a.partition("=")[2] for a in argv if a.startswith("preset=")), "quick")


def flag(argv: Sequence[str], key: str) -> bool:
    """Whether the command line says ``key=true``."""
    return any(a == f"{key}=true" for a in argv)


def split_overwrite(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``(argv without overwrite=..., whether it was true)``."""
    values = [a.partition("=")[2] for a in argv if a.startswith("overwrite=")]
    if len(values) > 1 or (values and values[0] not in ("true", "false")):
        raise ConfigError(f"overwrite={', '.join(values)}: give it once, true or false")
    return [a for a in argv if not a.startswith("overwrite=")], values == ["true"]


def expand_variant(name: str, argv: Sequence[str],
             variants: Mapping[str, Sequence[str]]) -> tuple[list[str], str]:
    """``(argv without variant=NAME, NAME or "")``; NAME is one of ``variants``, whose
    overrides :func:`parse_runner` takes as ``variant_overrides``."""
    picked = [a.partition("=")[2] for a in argv if a.startswith("variant=")]
    if not picked:
        return list(argv), ""
    if len(picked) > 1 or picked[0] not in variants:
        raise ConfigError(f"variant={', '.join(picked)}: give one of the variants {name} "
                          f"declares: {', '.join(variants) or 'none'}")
    return [a for a in argv if not a.startswith("variant=")], picked[0]
