"""The old name of :mod:`experiments.blockffn.ablations`, for one release:
``python -m experiments.blockffn.ablations``."""

from experiments._moved import moved

moved("blockffn_ablations", __name__)
