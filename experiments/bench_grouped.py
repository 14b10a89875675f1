"""The old name of :mod:`experiments.benchmarks.grouped`, for one release:
``python -m experiments.benchmarks.grouped``."""

from experiments._moved import moved

moved("bench_grouped", __name__)
