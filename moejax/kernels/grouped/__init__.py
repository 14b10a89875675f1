"""The dropless grouped matmul, ``[M, K] x [G, K, N] -> [M, N]`` with the rows of group ``g``
multiplied by ``w[g]`` (:func:`jax.lax.ragged_dot` semantics, which is also the reference the
tests compare with):

* :mod:`~moejax.kernels.grouped.ragged`: tokamax's kernels (Mosaic GPU, Mosaic TPU), what
  ``dispatch="auto"`` runs on accelerators, and the cross-compilation context its exports need;
* :mod:`~moejax.kernels.grouped.pallas_gmm`: the project's own Pallas kernel (Triton on GPU,
  Mosaic on TPU, interpret mode on CPU) with its ``custom_vjp`` (dX, dW), for what tokamax
  does not take.
* :mod:`~moejax.kernels.grouped.gmm_triton`: its GPU products in Pallas Triton (while jax
  ships it), and :mod:`~moejax.kernels.grouped.gmm_mgpu` / ``gmm_mgpu_ws``: the same as
  Mosaic GPU kernels for Hopper (bf16 / f16), on the same tile metadata.

Its layout metadata stays in ``ops`` (:mod:`moejax.kernels.grouped.layout`): the block-padded
tiles (:func:`~moejax.kernels.grouped.layout.group_tiles`), which the plain-jnp ``grouped``
dispatch path and the TPU kernel share, and the megablox-style visits of rows left in place
(:func:`~moejax.kernels.grouped.layout.group_visits`), which the GPU kernel runs on.
"""

from moejax.kernels.grouped.layout import group_tiles, group_visits
from moejax.kernels.grouped.pallas_gmm import GMM_TILES, gmm, tgmm
from moejax.kernels.grouped.ragged import AVAILABLE, cross_compile, ragged_dot

__all__ = ["gmm", "tgmm", "group_tiles", "group_visits", "GMM_TILES", "ragged_dot", "cross_compile",
           "AVAILABLE"]
