"""The old name of :mod:`experiments.ders.upcycling`, for one release:
``python -m experiments.ders.upcycling``."""

from experiments._moved import moved

moved("ders_upcycling", __name__)
