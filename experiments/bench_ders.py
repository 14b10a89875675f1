"""The old name of :mod:`experiments.ders.bench`, for one release:
``python -m experiments.ders.bench``."""

from experiments._moved import moved

moved("bench_ders", __name__)
