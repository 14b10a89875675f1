"""Expert kernels (pure array functions; no model code). On CPU the Pallas kernels run in
Pallas interpret mode (slow: tests use small shapes).

* :mod:`~moejax.kernels.dispatch`: every MoE dispatch path by name (jnp and kernel paths).
* :mod:`~moejax.kernels.host`: the fused host expert FFN for the CPU backend
  (``dispatch="host"`` / ``"host_capacity"``).

* :mod:`~moejax.kernels.gmm`: dropless grouped matmul (``jax.lax.ragged_dot`` semantics) on a
  block-padded grouped layout, forward and backward (dX, dW) under a ``custom_vjp``; the MoE
  skeleton's ``dispatch="gmm"``.
* :mod:`~moejax.kernels.chunk_union`: BlockFFN's chunk-sparse experts (each token tile reads
  only its union's expert weights) as Pallas kernels (a loop over the union, GPU; a
  scalar-prefetch grid over it, TPU); BlockFFN's ``path="pallas"``.
* :mod:`~moejax.kernels.chunk_union_triton`: the same computation as a Triton kernel through
  ``jax_triton`` (guarded imports; GPU and the ``gpu`` extra); BlockFFN's ``path="triton"``.
"""

from moejax.kernels.gmm import gmm, group_tiles, tgmm

__all__ = ["gmm", "tgmm", "group_tiles"]
