"""The old name of :mod:`experiments.darex.encoder`, for one release:
``python -m experiments.darex.encoder``."""

from experiments._moved import moved

moved("darex_encoder", __name__)
