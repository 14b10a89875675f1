"""Pallas kernels (pure array functions; no model code). On CPU they run in Pallas interpret
mode (slow: tests use small shapes); on GPU they lower through Triton.

* :mod:`~moejax.kernels.gmm`: dropless grouped matmul (``jax.lax.ragged_dot`` semantics) on a
  block-padded grouped layout, forward and backward (dX, dW) under a ``custom_vjp``; the MoE
  skeleton's ``dispatch="gmm"``.
* :mod:`~moejax.kernels.chunk_union`: BlockFFN's chunk-sparse experts (each token tile reads
  only its union's expert weights); BlockFFN's ``path="pallas"``.
"""

from moejax.kernels.gmm import gmm, group_tiles, tgmm

__all__ = ["gmm", "tgmm", "group_tiles"]
