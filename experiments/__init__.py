"""The studies, one package per paper with its benchmarks, and the benchmarks of the MoE FFN
op apart; each module is its paper's recipe and ends with its
:class:`moejax.harness.study.Study` declaration.

    experiments/
      main.py  full_smoke.py  results_doc.py    the suites, the full-preset proofs, the results
      results_carried.py                        a rebuilt document's carried-over sections
      lm_demo.py  substrate_build.py            the tour's MoE LM, the cached starting points
      ders/        DeRS: compression, upcycling, bench (DeRS experts at decode)
      darex/       DAREx: controlled, storage, decoder, encoder
      blockffn/    BlockFFN: baselines, ablations, granularity, kernels, speculative
      kd/          MoE knowledge distillation: moe_kd, sweeps
      extraction/  MoEE vs MoEfication: moee, bench (extracted experts' layouts)
      benchmarks/  the MoE FFN op: dispatch, grouped, parallel, autotune

A paper package's ``common.py`` holds what its studies share. Run a study as
``python -m experiments.<paper>.<study>`` (e.g. ``python -m experiments.ders.upcycling``).
A study keeps its flat name everywhere else (``runs/<name>``, ``make studies
ARGS=only=<name>``, the results documents): :data:`STUDIES` maps each name to its module. The
flat module names of the last release (``python -m experiments.ders_upcycling``) still run, for
one release, through thin modules that name the new command.
"""

from __future__ import annotations

import importlib

# Order matters: cheap, foundational studies first (``make studies`` runs them in this order).
STUDIES: dict[str, str] = {
    "lm_demo": "experiments.lm_demo",  # a trained MoE LM
    "bench_dispatch": "experiments.benchmarks.dispatch",  # dispatch paths, train step
    "bench_kernels": "experiments.blockffn.kernels",  # expert kernels against their bounds
    "bench_grouped": "experiments.benchmarks.grouped",  # the dropless grouped matmul
    "bench_speculative": "experiments.blockffn.speculative",  # speculative decoding
    "bench_parallel": "experiments.benchmarks.parallel",  # expert parallelism, 8 devices
    "bench_extracted": "experiments.extraction.bench",  # extracted experts' layouts
    "bench_ders": "experiments.ders.bench",  # DeRS experts at decode
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
# not a study of the suites, yet run the same way (``python -m experiments.benchmarks.autotune``)
TOOLS: dict[str, str] = {"autotune": "experiments.benchmarks.autotune"}


def load_study(name: str):
    """The :class:`moejax.harness.study.Study` registered as ``name``."""
    return importlib.import_module(STUDIES[name]).STUDY


def study_module(name: str):
    """The module of the study (or tool) registered as ``name``."""
    return importlib.import_module({**STUDIES, **TOOLS}[name])
