"""The studies, one package per paper, and the benchmarks apart; each module is its paper's
recipe and ends with its :class:`moejax.harness.study.Study` declaration.

    experiments/
      main.py  full_smoke.py  results_doc.py    the suites, the full-preset proofs, the results
      lm_demo.py  substrate_build.py            the tour's MoE LM, the cached starting points
      ders/        DeRS: compression, upcycling
      darex/       DAREx: controlled, storage, decoder, encoder
      blockffn/    BlockFFN: baselines, ablations, granularity
      kd/          MoE knowledge distillation: moe_kd
      extraction/  MoEE vs MoEfication: moee
      benchmarks/  dispatch, kernels, grouped, speculative, parallel, extracted, ders, autotune

A study is named by its flat name everywhere (``runs/<name>``, ``make studies ARGS=only=<name>``,
the results documents): :data:`STUDIES` maps each name to its module, and
``python -m experiments.<name>`` (like ``import experiments.<name>``) runs that module, so the
commands users know keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# Order matters: cheap, foundational studies first (``make studies`` runs them in this order).
STUDIES: dict[str, str] = {
    "lm_demo": "experiments.lm_demo",  # a trained MoE LM
    "bench_dispatch": "experiments.benchmarks.dispatch",  # dispatch paths, train step
    "bench_kernels": "experiments.benchmarks.kernels",  # expert kernels against their bounds
    "bench_grouped": "experiments.benchmarks.grouped",  # the dropless grouped matmul
    "bench_speculative": "experiments.benchmarks.speculative",  # speculative decoding
    "bench_parallel": "experiments.benchmarks.parallel",  # expert parallelism, 8 devices
    "bench_extracted": "experiments.benchmarks.extracted",  # extracted experts' layouts
    "bench_ders": "experiments.benchmarks.ders",  # DeRS experts at decode
    "substrate_build": "experiments.substrate_build",  # the cached pretrained starting points
    "darex_controlled": "experiments.darex.controlled",
    "darex_storage": "experiments.darex.storage",
    "darex_decoder": "experiments.darex.decoder",
    "darex_encoder": "experiments.darex.encoder",
    "ders_compression": "experiments.ders.compression",
    "ders_upcycling": "experiments.ders.upcycling",
    "blockffn_baselines": "experiments.blockffn.baselines",
    "blockffn_ablations": "experiments.blockffn.ablations",
    "blockffn_granularity": "experiments.blockffn.granularity",
    "moe_kd": "experiments.kd.moe_kd",
    "moee": "experiments.extraction.moee",
}
# not a study of the suites, yet run the same way (``python -m experiments.autotune``)
TOOLS: dict[str, str] = {"autotune": "experiments.benchmarks.autotune"}


def load_study(name: str):
    """The :class:`moejax.harness.study.Study` registered as ``name``."""
    return importlib.import_module(STUDIES[name]).STUDY


class _Alias(importlib.abc.Loader):
    """``experiments.<name>`` as the module it names: imported, the same module object; run
    with ``python -m``, that module's code."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec  # importlib set the alias's spec; the module keeps its own

    def get_code(self, fullname: str):
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _Aliases(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        module = STUDIES.get(name) or TOOLS.get(name)
        if package != __name__ or module is None or module == fullname:
            return None
        origin = importlib.util.find_spec(module).origin
        return importlib.util.spec_from_loader(fullname, _Alias(module), origin=origin)


if not any(isinstance(f, _Aliases) for f in sys.meta_path):
    sys.meta_path.insert(0, _Aliases())  # first: a flat name is an alias, never another file
