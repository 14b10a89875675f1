"""Expert kernels (pure array functions; no model code). On CPU the Pallas kernels run in
Pallas interpret mode (slow: tests use small shapes).

* :mod:`~moejax.kernels.dispatch`: every MoE dispatch path by name (jnp and kernel paths).
* :mod:`~moejax.kernels.host`: the fused host expert FFN for the CPU backend
  (``dispatch="host"`` / ``"host_capacity"``).

* :mod:`~moejax.kernels.gmm`: dropless grouped matmul (``jax.lax.ragged_dot`` semantics) on a
  block-padded grouped layout, forward and backward (dX, dW) under a ``custom_vjp``; the MoE
  skeleton's ``dispatch="gmm"``.
* :mod:`~moejax.kernels.chunk_union`: BlockFFN's chunk-sparse experts (each token tile reads
  only its union's expert weights), forward and backward, from the (tile, expert) pair
  products of :mod:`~moejax.kernels.pair_matmul` (Triton on GPU, Mosaic on TPU); BlockFFN's
  ``path="pallas"`` (and ``"auto"`` on accelerators).
* :mod:`~moejax.kernels.chunk_union_triton`: the fused forward as a Triton kernel through
  ``jax_triton`` (guarded imports; GPU and the ``gpu`` extra); BlockFFN's ``path="triton"``.
* :mod:`~moejax.kernels.tiling`: block sizes and the per-platform kernel choice.
"""

from moejax.kernels.gmm import gmm, group_tiles, tgmm

__all__ = ["gmm", "tgmm", "group_tiles"]
