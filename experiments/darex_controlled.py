"""The old name of :mod:`experiments.darex.controlled`, for one release:
``python -m experiments.darex.controlled``."""

from experiments._moved import moved

moved("darex_controlled", __name__)
