"""The old name of :mod:`experiments.extraction.bench`, for one release:
``python -m experiments.extraction.bench``."""

from experiments._moved import moved

moved("bench_extracted", __name__)
