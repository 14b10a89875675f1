"""Kernels and ops below the models (pure array functions; no model code), one package per op
as tokamax arranges them: each holds its API, its reference, its per-backend kernels, their
``custom_vjp`` and their layout. On CPU the Pallas kernels run in Pallas interpret mode (slow:
tests use small shapes).

* :mod:`~moejax.kernels.moe_ffn`: the MoE FFN op: every dispatch path by name and ``"auto"``
  (:mod:`~moejax.kernels.moe_ffn.api`), the jnp paths (:mod:`~moejax.kernels.moe_ffn.
  reference`), the fused host expert FFN of the CPU backend and the all-to-all paths;
* :mod:`~moejax.kernels.grouped`: the dropless grouped matmul (tokamax's kernels, the
  project's Pallas gmm) with its layout;
* :mod:`~moejax.kernels.chunk_union`: BlockFFN's chunk-union experts (reference, pair
  products, the Pallas layer, the fused Triton forward, the decode kernels);
* :mod:`~moejax.kernels.flash_attention`: attention on tokamax's flash kernel, picked when lowered;
* :mod:`~moejax.kernels.activation_forms`: the one activation table (jax, kernel, numpy);
* :mod:`~moejax.kernels.tiling`: block sizes and the per-platform kernel choice;
  :mod:`~moejax.kernels.targets`: the devices exports are lowered for;
  :mod:`~moejax.kernels.host_memory`: the host memory settings of the CPU backend.
"""

from moejax.kernels.grouped import gmm, group_tiles, tgmm

__all__ = ["gmm", "tgmm", "group_tiles"]
