"""Softmax attention on a maintained flash kernel: tokamax's, chosen when the program is lowered.

:func:`flash_attention` runs ``[B, T, H, J]`` queries against ``[B, S, G, J]`` keys and values
(grouped kv heads) under a boolean ``[B, T, S]`` mask, the contract of
:func:`moejax.nn.attention.dot_product_attention`:

* ``cuda``: tokamax's Pallas Triton flash attention (its VJP too), one kernel for training
  sequences and for a decode step's 1 to 64 new tokens over the KV cache: given each row's
  valid length (``kv_lengths_B``), the kernel's loop over key blocks stops at the longest, so
  a step reads the cache's filled slots, not all of it (the mask gives each new token its
  own slots among them; one new token per row needs no mask beside the lengths);
* ``tpu``: tokamax's Pallas Mosaic TPU flash attention, whose query and key blocks are 128
  long: a training sequence of another length (a shifted 512-token row's 511) is padded up to
  a multiple of 128, the padded keys masked out and the padded queries' rows dropped from the
  output; a call of at most 64 queries (a decode step's new tokens, or a training sequence
  that short, whose scores are at most 64 x 64 a head: nothing for a flash kernel to save) is
  not padded, and runs XLA's attention where the kernel's blocks do not tile it;
* anything else (the CPU): ``fallback``, XLA's attention.

The platform is the one the program is built for (:func:`moejax.kernels.tiling.target_device`:
the abstract device of :func:`moejax.kernels.targets.lowering_target`, else the default
device), and only its branch is traced beside the fallback
(:func:`jax.lax.platform_dependent`), as for the grouped matmul
(:mod:`moejax.kernels.grouped.ragged`): tokamax cannot trace one platform's kernel on
another's device. Where tokamax declines a call (``NotImplementedError``, or the
``ValueError`` of a shape its kernel does not tile: a TPU decode step's few queries), or is not
installed, the fallback runs.

A fully masked query row gets finite values: the einsum oracle's on a GPU (uniform over the
keys), on a TPU uniform over the keys of its first block of 128 (padded ones included). The
TPU kernel sends no gradient through such a row (the einsum sends ``1/S`` of its output
gradient to every value). Such rows are padding, which the models' losses leave out, so
training is unchanged (tests: values and gradients equal the oracle's in Pallas's
interpreters, with a fully masked row outside the loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels.grouped.ragged import AVAILABLE, tokamax
from moejax.kernels.tiling import pad_to, target_device

__all__ = ["KERNELS", "TPU_BLOCK", "flash_attention", "flash_kernel"]

# tokamax's implementation per lowering platform
KERNELS = {"cuda": "triton", "tpu": "mosaic_tpu"}
# the TPU kernel's query and key block length; a training call of more than DECODE_QUERIES
# queries (a decode step's most new tokens) is padded up to a multiple of it, a shorter one not
TPU_BLOCK = 128
DECODE_QUERIES = 64


def flash_kernel(q_BTHJ, k_BSGJ, v_BSGJ, mask_BTS, platform: str, kv_lengths_B=None):
    """tokamax's flash attention of ``platform`` (:data:`KERNELS`), called directly (the
    tests run the kernels in Pallas's interpreters); raises ``NotImplementedError`` where
    it declines. ``kv_lengths_B``: each row's keys past it are masked (``mask_BTS`` enables
    none of them), and with one query per row the mask is those lengths alone. On a TPU, a
    training length of more than :data:`DECODE_QUERIES` its blocks do not tile is padded to
    :data:`TPU_BLOCK` (module docstring)."""
    if not AVAILABLE:
        raise NotImplementedError("tokamax is not installed")
    B, T = q_BTHJ.shape[:2]
    S = k_BSGJ.shape[1]
    if (platform == "tpu" and kv_lengths_B is None and T > DECODE_QUERIES
            and (T % TPU_BLOCK or S % TPU_BLOCK)):
        mask = pad_to(pad_to(jnp.broadcast_to(mask_BTS, (B, T, S)), 1, TPU_BLOCK), 2, TPU_BLOCK)
        q, k, v = (pad_to(x, 1, TPU_BLOCK) for x in (q_BTHJ, k_BSGJ, v_BSGJ))
        return flash_kernel(q, k, v, mask, platform)[:, :T]
    mask = None
    if kv_lengths_B is None or T > 1:
        mask = jnp.broadcast_to(mask_BTS, (B, T, S))[:, None]
    dt = q_BTHJ.dtype
    return tokamax().dot_product_attention(q_BTHJ, k_BSGJ.astype(dt), v_BSGJ.astype(dt),
                                           mask=mask, key_value_seq_lengths=kv_lengths_B,
                                           implementation=KERNELS[platform])


def flash_attention(q_BTHJ, k_BSGJ, v_BSGJ, mask_BTS, *, fallback, kv_lengths_B=None):
    """Attention on the target platform's flash kernel, ``fallback(q, k, v, mask)`` elsewhere
    or where the kernel declines (module docstring). ``kv_lengths_B`` (optional, int32
    ``[B]``): each row's valid keys are its first ``kv_lengths_B`` and ``mask_BTS`` enables
    none past them (a KV cache's filled slots; module docstring). Returns ``[B, T, H, J]`` in
    ``q``'s dtype."""
    platform = target_device()[0]
    if platform not in KERNELS or not AVAILABLE:
        return fallback(q_BTHJ, k_BSGJ, v_BSGJ, mask_BTS)
    lengths = None if kv_lengths_B is None else kv_lengths_B.astype(jnp.int32)

    def kernel(q, k, v, m):
        try:
            return flash_kernel(q, k, v, m, platform, lengths).astype(q.dtype)
        except (NotImplementedError, ValueError):  # a shape or dtype it does not take
            return fallback(q, k, v, m)

    mask = jnp.broadcast_to(mask_BTS, (q_BTHJ.shape[0], q_BTHJ.shape[1], k_BSGJ.shape[1]))
    return jax.lax.platform_dependent(q_BTHJ, k_BSGJ, v_BSGJ, mask, default=fallback,
                                      **{platform: kernel})
