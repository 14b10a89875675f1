"""The old name of :mod:`experiments.kd.moe_kd`, for one release:
``python -m experiments.kd.moe_kd``."""

from experiments._moved import moved

moved("moe_kd", __name__)
