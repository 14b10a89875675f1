"""The old name of :mod:`experiments.benchmarks.dispatch`, for one release:
``python -m experiments.benchmarks.dispatch``."""

from experiments._moved import moved

moved("bench_dispatch", __name__)
