"""A study (or benchmark) as one declaration: what the runner, the suites and the full-preset
proofs need to know about it, in one frozen value at the end of its module.

    STUDY = Study("ders_upcycling", make_config, run, claims=claims,
                  seed_keys=("train.seed",), quick_repeat=5)

    if __name__ == "__main__":
        raise SystemExit(STUDY.main())

* ``name``: the run directory's and the report's name (``runs/<name>``);
* ``make_config(preset) -> Config`` and ``run(cfg, RunDir) -> dict``: the recipe
  (:mod:`moejax.harness.experiment`);
* ``claims(tables) -> [Claim]``: the paper's claims judged from the run's tables
  (:mod:`moejax.harness.claims`);
* ``seed_keys``: the config keys that seed a run (``repeat=N`` offsets them);
  ``quick_repeat``: how many seed runs ``make studies`` makes of the quick preset;
* ``smoke``: the study's own cuts for ``smoke=true`` (what it counts, :mod:`moejax.harness.smoke`);
  ``smoke_depth``: the reduced depth a smoke run takes where the full preset cannot fit a
  24 GB host (fewer layers, every layer's shape kept; the smoke tables say so);
* ``paper_scale``: the models (and data) the paper measured its claims on, printed beside
  every verdict with the scale the run trained at (:mod:`moejax.train.scale`);
* ``variants``: ``(name, overrides)`` runs of the quick preset that ``make studies`` makes
  after the study's own (e.g. the same recipe on a real pretrained model), each indexed and
  documented as ``<study>[<name>]``;
* ``accelerator_variants``: ``(name, overrides)`` runs that measure what only a GPU or TPU can
  (``scripts/gpu_check.sh``'s stages): run as ``variant=NAME`` at any preset, documented as
  ``<study>[<name>]`` in an accelerator's results document; ``make studies`` does not run them;
* ``derived_keys``: ``(key, what sets it)`` of the config keys the recipe sets itself (a
  sub-config's seed taken from the study's ``seed``, a method taken from the list it runs):
  refused on the command line, where a value would be recorded but never run;
* ``checkpoint_runs(cfg) -> [CapturedStep]``: the full preset's training runs on real
  checkpoints this machine cannot hold, built from their ``config.json`` alone
  (:func:`moejax.train.aot.abstract_run`, :mod:`moejax.io.hf_moe_checkpoints`); ``make
  full-aot`` proves them beside the recipe's own runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moejax.harness.experiment import ClaimsFn, main, run_experiment

__all__ = ["Study"]


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    make_config: Callable[[str], Any]
    run: Callable[..., dict]
    claims: ClaimsFn | None = None
    seed_keys: tuple[str, ...] = ()
    quick_repeat: int = 1
    smoke: tuple[str, ...] = ()
    smoke_depth: tuple[str, ...] = ()
    # the models and data the paper's claims were measured on, printed beside every verdict
    paper_scale: str = ""
    # named runs of the quick preset with overrides that `make studies` makes after the
    # study's own, each its own section of the results documents
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # named runs for a GPU or TPU (the GPU check's measurements), in an accelerator's results
    # document only; `make studies` does not run them
    accelerator_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the full preset's runs on named real checkpoints, from their config.json alone
    checkpoint_runs: Callable[[Any], list] | None = None
    # (key, what sets it): config keys the recipe sets itself, refused on the command line
    derived_keys: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"Study name {self.name!r}: expected a module-like name")
        if self.quick_repeat < 1:
            raise ValueError(f"Study {self.name}: quick_repeat={self.quick_repeat} must be >= 1")
        if self.quick_repeat > 1 and not self.seed_keys:
            raise ValueError(f"Study {self.name}: quick_repeat={self.quick_repeat} needs the "
                             "seed_keys its runs offset")
        names = [name for name, _ in self.all_variants]
        for name in names:
            if not name.isidentifier():
                raise ValueError(f"Study {self.name}: variant {name!r}: expected a name")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"Study {self.name}: variant {', '.join(twice)} declared twice")
        for key, cuts in (("smoke", self.smoke), ("smoke_depth", self.smoke_depth),
                          *((f"variant {n}", o) for n, o in self.all_variants)):
            bad = [c for c in cuts if "=" not in c]
            if bad:
                raise ValueError(f"Study {self.name}: {key}={bad}: expected key=value items")
            derived = [c for c in cuts if c.partition("=")[0] in dict(self.derived_keys)]
            if derived:
                raise ValueError(f"Study {self.name}: {key} sets {derived}, which the recipe "
                                 "sets itself (derived_keys)")

    @property
    def all_variants(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Every named variant: the quick suite's, then the accelerators'."""
        return (*self.variants, *self.accelerator_variants)

    def variant_names(self, accelerator: bool = False) -> list[str]:
        """The variants a results document of this machine class holds: the quick suite's,
        and on an accelerator (``accelerator``) the accelerators' too."""
        return [n for n, _ in (self.all_variants if accelerator else self.variants)]

    @property
    def smoke_cuts(self) -> tuple[str, ...]:
        """What ``smoke=true`` applies after the generic cuts: the study's own cuts, then its
        reduced depth."""
        return (*self.smoke, *self.smoke_depth)

    def run_experiment(self, argv: Sequence[str] = (), *, out: Path | None = None,
                       repeat_quick: bool = False, variant: str = ""):
        """``(summary, RunDir)`` of :func:`moejax.harness.experiment.run_experiment` with this
        study's declaration; ``repeat_quick``: the quick preset makes ``quick_repeat`` runs;
        ``variant``: one of :attr:`all_variants` (as ``variant=NAME`` on the command line)."""
        argv = [*argv, f"variant={variant}"] if variant else list(argv)
        return run_experiment(self.name, self.make_config, self.run, argv, out=out,
                              variants=dict(self.all_variants),
                              seed_keys=self.seed_keys,
                              quick_repeat=self.quick_repeat if repeat_quick else 1,
                              claims=self.claims, smoke=self.smoke_cuts,
                              paper_scale=self.paper_scale,
                              derived_keys=dict(self.derived_keys))

    def main(self, argv: Sequence[str] | None = None) -> int:
        """``python -m experiments.<paper>.<study> key=value ...`` (:func:`.experiment.main`)."""
        return main(self.name, self.make_config, self.run, argv, seed_keys=self.seed_keys,
                    quick_repeat=self.quick_repeat, claims=self.claims, smoke=self.smoke_cuts,
                    paper_scale=self.paper_scale, variants=dict(self.all_variants),
                    derived_keys=dict(self.derived_keys))
