"""The old name of :mod:`experiments.blockffn.baselines`, for one release:
``python -m experiments.blockffn.baselines``."""

from experiments._moved import moved

moved("blockffn_baselines", __name__)
