"""The old name of :mod:`experiments.ders.compression`, for one release:
``python -m experiments.ders.compression``."""

from experiments._moved import moved

moved("ders_compression", __name__)
