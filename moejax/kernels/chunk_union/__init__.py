"""BlockFFN's chunk-sparse experts: each tile of tokens computes only the union of the experts
its tokens activate (BlockFFN Sec. 3.3), as one family:

* :mod:`~moejax.kernels.chunk_union.reference`: the plain-jnp oracle and CPU path (the union
  per tile, the experts gathered and run densely), which the kernels are tested against;
* :mod:`~moejax.kernels.chunk_union.pairs`: the (tile, expert) pair products, forward and
  backward, in Pallas (Triton on GPU, Mosaic on TPU, interpret mode on CPU);
* :mod:`~moejax.kernels.chunk_union.pallas`: the layer built from them under a
  ``custom_vjp`` (BlockFFN's ``path="pallas"``, and ``"auto"`` on accelerators);
* :mod:`~moejax.kernels.chunk_union.fused_triton`: the fused forward as one Triton kernel
  through ``jax_triton`` (guarded import; GPU only; BlockFFN's ``path="triton"``);
* :mod:`~moejax.kernels.chunk_union.decode`: one chunk of 1 to 64 tokens at decode in two
  launches (the union, then the experts over (union slot, F block) with early exit; TPU, and
  interpret mode on CPU), forward only;
* :mod:`~moejax.kernels.chunk_union.decode_gpu`: the same chunk on a Hopper GPU in one Mosaic
  GPU launch (programs over (expert, F block) that exit unless their expert is in the union,
  the down-projection summed by TMA reduce-add; Mosaic GPU's interpreter on CPU), forward only.
"""

from moejax.kernels.chunk_union.pallas import chunk_union_pallas

__all__ = ["chunk_union_pallas"]
