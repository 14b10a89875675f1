"""The old name of :mod:`experiments.blockffn.kernels`, for one release:
``python -m experiments.blockffn.kernels``."""

from experiments._moved import moved

moved("bench_kernels", __name__)
