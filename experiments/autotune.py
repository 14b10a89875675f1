"""The old name of :mod:`experiments.benchmarks.autotune`, for one release:
``python -m experiments.benchmarks.autotune``."""

from experiments._moved import moved

moved("autotune", __name__)
