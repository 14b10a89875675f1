"""The old name of :mod:`experiments.benchmarks.parallel`, for one release:
``python -m experiments.benchmarks.parallel``."""

from experiments._moved import moved

moved("bench_parallel", __name__)
