"""The old name of :mod:`experiments.blockffn.granularity`, for one release:
``python -m experiments.blockffn.granularity``."""

from experiments._moved import moved

moved("blockffn_granularity", __name__)
