"""The old name of :mod:`experiments.blockffn.speculative`, for one release:
``python -m experiments.blockffn.speculative``."""

from experiments._moved import moved

moved("bench_speculative", __name__)
