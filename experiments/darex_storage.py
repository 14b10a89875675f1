"""The old name of :mod:`experiments.darex.storage`, for one release:
``python -m experiments.darex.storage``."""

from experiments._moved import moved

moved("darex_storage", __name__)
