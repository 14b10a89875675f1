"""Counter-based keep masks for DARE: a bijective integer hash of (key, element index)
instead of a PRNG stream, so a mask costs a few integer ops per element and runs at close to
memory speed (JAX's threefry / rbg bits dominate DARE's cost on CPU).

For leaf key ``k`` (two uint32 words ``s0, s1`` of ``jax.random.key_data(fold_in(key, i))``)
and flat element index ``j``::

    h = fmix32(fmix32(j ^ s0) + s1)          (fmix32: MurmurHash3's finaliser, a bijection)
    keep_j = h >= round(p * 2^32)            (P(keep) = 1 - p up to 2^-32)

``fmix32`` mixes every input bit into every output bit; keys from ``fold_in`` give
independent streams per leaf. :func:`hash_keep_mask` has :func:`moejax.delta.dare_keep_mask`'s
signature; ``tests/test_delta_hash_mask.py`` checks uniform marginals, independence across
leaves and keys, unbiasedness of DARE and determinism.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moejax.delta.tree import mask_leaves, per_leaf_keys

__all__ = ["fmix32", "hash_bits", "hash_keep_mask"]

PyTree = Any


def fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (uint32 -> uint32, bijective)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _flat_index(shape) -> jax.Array:
    """uint32 row-major element index of ``shape`` (``arange(n).reshape(shape)``), built from
    per-axis iotas, which XLA fuses into the mask's consumer (a reshaped 1-D ``arange`` is
    materialised first), so DARE runs at close to an elementwise pass over the tree."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return jnp.zeros((), jnp.uint32)
    j = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    for axis in range(1, len(shape)):
        j = j * jnp.uint32(shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    return j


def hash_bits(key: jax.Array, shape) -> jax.Array:
    """uint32 ``shape`` of hashed counters (the module docstring's ``h``) for one key."""
    data = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    s0, s1 = data[0], data[-1]
    return fmix32(fmix32(_flat_index(shape) ^ s0) + s1)


def hash_keep_mask(key: jax.Array, delta_tree: PyTree, p: float,
                   mask: PyTree | None = None) -> PyTree:
    """Boolean keep-mask pytree, ``P(keep) = 1 - p`` per entry, leaf ``i`` from
    ``fold_in(key, i)``; unselected leaves get all-True."""
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"p={p} must be in [0, 1) (drop rate)")
    threshold = jnp.uint32(min(int(round(float(p) * 2**32)), 2**32 - 1))
    mask_leaves(mask, delta_tree, "hash_keep_mask")
    keys = per_leaf_keys(key, delta_tree)
    sel = jax.tree_util.tree_map(lambda _: True, delta_tree) if mask is None else mask
    return jax.tree_util.tree_map(
        lambda d, k, m: (hash_bits(k, jnp.shape(d)) >= threshold) if m
        else jnp.ones(jnp.shape(d), bool), delta_tree, keys, sel)
