"""Expert kernels (pure array functions; no model code), one package per kernel family: each
holds its reference, its per-backend kernels, their ``custom_vjp`` and their layout. On CPU
the Pallas kernels run in Pallas interpret mode (slow: tests use small shapes).

* :mod:`~moejax.kernels.grouped`: the dropless grouped matmul (tokamax's kernels, the
  project's Pallas gmm);
* :mod:`~moejax.kernels.chunk_union`: BlockFFN's chunk-union experts (reference, pair
  products, the Pallas layer, the fused Triton forward);
* :mod:`~moejax.kernels.host`: the fused host expert FFN for the CPU backend
  (``dispatch="host"`` / ``"host_capacity"``);
* :mod:`~moejax.kernels.moe_dispatch`: every MoE dispatch path by name (jnp and kernel
  paths) and ``"auto"``; :mod:`~moejax.kernels.expert_parallel`: the all-to-all paths;
* :mod:`~moejax.kernels.tiling`: block sizes and the per-platform kernel choice;
  :mod:`~moejax.kernels.targets`: the devices exports are lowered for.
"""

from moejax.kernels.grouped import gmm, group_tiles, tgmm

__all__ = ["gmm", "tgmm", "group_tiles"]
