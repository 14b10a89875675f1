"""The old name of :mod:`experiments.extraction.moee`, for one release:
``python -m experiments.extraction.moee``."""

from experiments._moved import moved

moved("moee", __name__)
