"""Importance-based and structural delta-parameter pruning (DAREx paper, Sec. 3.3 and App. A).

Per weight matrix of size ``m x n`` keep exactly ``k = round((1-p) m n)`` deltas with
the largest score, no rescaling:
* magnitude:  ``s_ij = |Delta_ij|``
* WANDA:      ``s_ij = |Delta_ij| * ||x_j||_2``  (``j`` = input feature)

Structural DPP: per matrix pick ``round(a * d_in)`` input features at random, keep each
delta inside them w.p. ``b`` (``E[kept fraction] = a b``, paper a=0.05, b=0.2 ->
p = 0.99) and rescale survivors by ``1/q`` (``q = a b`` is DARE; tune ``q`` with
``search_q_v/e(..., pruner=structural_pruner(a, b))``).

Matrices follow ``[..., d_in, d_out]`` (``in_axis=-2``); leading axes (stacked
experts) are independent matrices. 1-D leaves, if selected, count as one "matrix".
Ties in the score are broken by flat index (lower index kept first).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from moejax.delta.dare import check_rescaled, rescale
from moejax.delta.tree import leaf_paths, map_selected, mask_leaves, per_leaf_keys, per_leaf_values

__all__ = [
    "num_kept",
    "topk_keep_mask",
    "topk_keep_mask_sort",
    "magnitude_prune",
    "wanda_prune",
    "structural_dpp",
    "structural_pruner",
]

PyTree = Any


def num_kept(size: int, p: float) -> int:
    """``k = round((1 - p) * size)`` entries kept out of ``size`` at drop rate ``p``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p={p} must be in [0, 1].")
    return int(round((1.0 - p) * size))


def _blocks(score, matrix_ndim: int):
    score = jnp.asarray(score)
    nd = min(matrix_ndim, score.ndim)
    lead, block = score.shape[: score.ndim - nd], score.shape[score.ndim - nd :]
    size = 1
    for s in block:
        size *= s
    return score.reshape((-1, size)), lead + block, size


def topk_keep_mask_sort(score, p: float, matrix_ndim: int = 2):
    """The sorting oracle of :func:`topk_keep_mask` (two stable argsorts per block)."""
    flat, shape, size = _blocks(score, matrix_ndim)
    k = num_kept(size, p)
    order = jnp.argsort(-flat, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)  # rank of each entry
    return (rank < k).reshape(shape)


def topk_keep_mask(score, p: float, matrix_ndim: int = 2):
    """Keep the top ``k = round((1-p) * size)`` scores in each trailing ``matrix_ndim`` block,
    ties broken by flat index (lower kept first); scores must be >= 0 (negative ones count
    as 0).

    Selection without sorting: the k-th largest score of each block is found by a bitwise
    search over the float32 bit pattern (non-negative floats order as their int32 bits):
    31 fused compare-and-count passes, then one pass to build the mask; a cumulative count
    over the entries equal to the threshold runs only when ties straddle it. Equal to
    :func:`topk_keep_mask_sort`, several times faster on large matrices."""
    flat, shape, size = _blocks(score, matrix_ndim)
    k = num_kept(size, p)
    if k == 0 or k == size:
        return jnp.full(shape, k == size)
    return _select_top_k(flat, k).reshape(shape)


@functools.partial(jax.jit, static_argnums=1)
def _select_top_k(flat, k: int):
    """``[n, size]`` bool: the top ``k`` of each row (jitted once per shape and ``k``, so
    eager callers do not re-trace the search loop on every call)."""
    x = flat.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x > 0, x, 0.0), jnp.int32)  # [n, size]

    def step(i, t):  # t: [n, 1], the largest value with count(bits >= t) >= k so far
        cand = t | jnp.left_shift(jnp.int32(1), 30 - i)
        ok = jnp.sum(bits >= cand, axis=-1, keepdims=True, dtype=jnp.int32) >= k
        return jnp.where(ok, cand, t)

    t = jax.lax.fori_loop(0, 31, step, jnp.zeros((flat.shape[0], 1), jnp.int32))
    above = bits > t
    eq = bits == t
    need = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    n_eq = jnp.sum(eq, axis=-1, keepdims=True, dtype=jnp.int32)
    ties = jax.lax.cond(
        jnp.all(n_eq == need),
        lambda: eq,
        lambda: eq & (jnp.cumsum(eq, axis=-1, dtype=jnp.int32) <= need))
    return above | ties


def magnitude_prune(delta_tree: PyTree, p: float, *, mask: PyTree | None = None) -> PyTree:
    """Magnitude DPP: keep the ``round((1-p) m n)`` largest ``|Delta_ij|`` per matrix."""
    return map_selected(
        lambda d: jnp.where(topk_keep_mask(jnp.abs(d), p), d, jnp.zeros((), d.dtype)),
        delta_tree,
        mask,
    )


def _wanda_leaf(d, norm, p, in_axis, per_output):
    d = jnp.asarray(d)
    if d.ndim < 2:
        raise ValueError(f"WANDA needs matrix leaves, got shape {d.shape}; deselect it via mask.")
    norm = jnp.asarray(norm, jnp.float32)
    dm = jnp.moveaxis(d, in_axis, -1)  # [..., d_out, d_in]
    if norm.shape[-1] != dm.shape[-1]:
        raise ValueError(
            f"WANDA: input norm has {norm.shape[-1]} features but the matrix has d_in="
            f"{dm.shape[-1]} along in_axis={in_axis}; pass this matrix's input norms."
        )
    if norm.ndim > 1:
        norm = norm.reshape(norm.shape[:-1] + (1,) * (dm.ndim - norm.ndim) + norm.shape[-1:])
    score = jnp.abs(dm).astype(jnp.float32) * norm
    keep = topk_keep_mask(score, p, matrix_ndim=1 if per_output else 2)
    return jnp.moveaxis(jnp.where(keep, dm, jnp.zeros((), d.dtype)), -1, in_axis)


def wanda_prune(
    delta_tree: PyTree,
    input_norms,
    p: float,
    *,
    mask: PyTree | None = None,
    in_axis: int = -2,
    per_output: bool = False,
) -> PyTree:
    """WANDA DPP: keep the top ``(1-p)`` of ``|Delta_ij| * ||x_j||_2`` per matrix.

    ``input_norms``: per-leaf ``||x_j||_2`` vectors (``[d_in]``, or ``[E, d_in]`` for
    stacked experts), as a ``{path: array}`` dict or a pytree aligned with the deltas
    (see :mod:`moejax.delta.input_stats`). ``per_output=True`` compares within each
    output unit (original WANDA) instead of the whole matrix (the DAREx paper, App. A).
    """
    norms = per_leaf_values(_fill_paths(input_norms, delta_tree, mask), delta_tree, "input_norms")
    leaves, treedef = jax.tree_util.tree_flatten(delta_tree)
    sel = mask_leaves(mask, delta_tree, "wanda_prune")
    out = []
    for d, n, s in zip(leaves, norms, sel):
        if s and n is None:
            raise ValueError(
                "wanda_prune: a selected leaf has no input norm; supply it or deselect it."
            )
        out.append(_wanda_leaf(d, n, p, in_axis, per_output) if s else d)
    return jax.tree_util.tree_unflatten(treedef, out)


def _fill_paths(values, tree, mask):
    """Allow a ``{path: array}`` dict covering only the selected leaves."""

    if isinstance(values, dict) and all(isinstance(k, str) for k in values):
        paths = leaf_paths(tree)
        if set(values) <= set(paths):
            return {p: values.get(p) for p in paths}
    return values


def _structural_leaf(key, d, a, b, q, in_axis):
    d = jnp.asarray(d)
    if d.ndim < 2:
        raise ValueError(f"structural DPP needs matrix leaves, got shape {d.shape}; deselect it.")
    dm = jnp.moveaxis(d, in_axis, -1)  # [..., d_out, d_in]
    lead, d_in = dm.shape[:-2], dm.shape[-1]
    n_lead = 1
    for s in lead:
        n_lead *= s
    n_cols = int(round(a * d_in))
    k_cols, k_keep = jax.random.split(key)
    col_scores = jax.random.uniform(k_cols, (n_lead, d_in))
    cols = topk_keep_mask(col_scores, 1.0 - n_cols / d_in, matrix_ndim=1)  # [n_lead, d_in]
    cols = cols.reshape(lead + (1, d_in))
    keep = cols & jax.random.bernoulli(k_keep, b, dm.shape)
    out = jnp.where(keep, rescale(dm, q), jnp.zeros((), d.dtype))
    return jnp.moveaxis(out, -1, in_axis)


def structural_dpp(
    key: jax.Array,
    delta_tree: PyTree,
    a: float,
    b: float,
    *,
    q: float | PyTree | dict | None = None,
    mask: PyTree | None = None,
    in_axis: int = -2,
) -> PyTree:
    """Structural DPP: ``Delta'_ij = 1[j in J] m_ij Delta_ij / q``.

    ``J``: ``round(a d_in)`` input features drawn uniformly without replacement per
    matrix; ``m_ij ~ Bernoulli(b)``; ``q`` defaults to ``a * b`` (unbiased, DARE-like).
    """
    if not (0.0 < a <= 1.0 and 0.0 < b <= 1.0):
        raise ValueError(
            f"structural_dpp: a={a}, b={b} must be fractions in (0, 1] (paper: a=0.05, b=0.2)."
        )
    qs = per_leaf_values(a * b if q is None else q, delta_tree, "q")
    keys = jax.tree_util.tree_leaves(per_leaf_keys(key, delta_tree))
    leaves, treedef = jax.tree_util.tree_flatten(delta_tree)
    sel = mask_leaves(mask, delta_tree, "structural_dpp")
    check_rescaled("structural_dpp", delta_tree, qs, sel)
    out = [
        _structural_leaf(k, d, a, b, qi, in_axis) if s else d
        for d, k, qi, s in zip(leaves, keys, qs, sel)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def structural_pruner(a: float, b: float, *, mask: PyTree | None = None, in_axis: int = -2):
    """``pruner(key, delta, q)`` for :func:`moejax.delta.dare.search_q_v` / ``search_q_e``."""
    return lambda key, d, q: structural_dpp(key, d, a, b, q=q, mask=mask, in_axis=in_axis)
