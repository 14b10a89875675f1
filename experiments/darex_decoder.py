"""The old name of :mod:`experiments.darex.decoder`, for one release:
``python -m experiments.darex.decoder``."""

from experiments._moved import moved

moved("darex_decoder", __name__)
