"""DARE and DAREx-q: random drop of delta parameters with rescaling (DAREx paper, Sec. 3.2 and 4.1).

DARE (per weight matrix, drop rate ``p``)::
    m_ij ~ Bernoulli(1 - p),   Delta'_ij = m_ij * Delta_ij / (1 - p)

DAREx-q replaces the factor ``1/(1-p)`` by ``1/q`` with ``q >= 1 - p``::
    Delta'_ij = m_ij * Delta_ij / q

``q`` is a scalar (global), a per-leaf value, or found by a search:
* ``search_q_v``: ``q_v = argmax_q metric(theta_P + P(Delta, q))`` (labelled validation);
* ``search_q_e``: ``q_e = argmin_q mean |f_L(theta_P + P(Delta, q)) - f_L(theta_P + Delta)|``
  (last-layer outputs on ONE fixed unlabelled batch, via a user ``outputs_fn(params)``).

The grid is ``q_t = 1 - p + t * dq`` (paper Algorithm 2) with optional coarse-to-fine
refinement. The drop mask depends only on the key, so every ``q`` in a search is
evaluated with the SAME mask (the paper prunes once and only tunes the rescaling).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.delta.hash_mask import hash_keep_mask
from moejax.delta.tree import apply_delta, leaf_paths, mask_leaves, per_leaf_keys, per_leaf_values

__all__ = [
    "NoFiniteScore",
    "dare",
    "dare_keep_mask",
    "rescale",
    "check_rescaled",
    "q_grid",
    "GridSearchResult",
    "grid_search",
    "search_q_v",
    "search_q_e",
    "mean_abs_output_change",
]

PyTree = Any
Pruner = Callable[[jax.Array, PyTree, Any], PyTree]


def _check_rate(p: float, name: str = "p") -> None:
    if not (math.isfinite(float(p)) and 0.0 <= float(p) < 1.0):
        raise ValueError(f"{name}={p} must be in [0, 1) (drop rate); use e.g. {name}=0.9.")


def rescale(d: jax.Array, q) -> jax.Array:
    """``d / q`` divided in (at least) float32 and rounded once to ``d``'s dtype. A ``q``
    rounded to bfloat16 first (0.3 -> 0.30078) would scale every survivor by the same wrong
    factor, up to 2^-9 off, and DARE's rescale exists to keep ``E[Delta'] = Delta``."""
    wide = jnp.promote_types(jnp.result_type(d), jnp.float32)
    return (jnp.asarray(d, wide) / jnp.asarray(q, wide)).astype(jnp.result_type(d))


def check_rescaled(who: str, delta_tree: PyTree, qs: Sequence, sel: Sequence[bool]) -> None:
    """Refuse what ``Delta / q`` would turn into garbage, before any compute: a concrete
    ``q`` (one per leaf, ``qs``) that is not a finite number > 0, and a selected leaf (``sel``)
    that is not floating (the rescaled survivors would be truncated to integers)."""
    for qi in qs:
        if qi is not None and not isinstance(qi, jax.core.Tracer) and not (
                math.isfinite(float(qi)) and float(qi) > 0.0):
            raise ValueError(f"{who}: q={qi} must be finite and > 0 (survivors are rescaled by "
                             "1/q).")
    for path, d, s in zip(leaf_paths(delta_tree), jax.tree_util.tree_leaves(delta_tree), sel):
        if s and not jnp.issubdtype(jnp.result_type(d), jnp.floating):
            raise ValueError(f"{who}: delta leaf {path!r} is {jnp.result_type(d)}; its "
                             "survivors are rescaled by 1/q and need a floating dtype (cast "
                             "it, or deselect it via mask).")


def dare_keep_mask(
    key: jax.Array, delta_tree: PyTree, p: float, mask: PyTree | None = None,
    rng: str = "hash",
) -> PyTree:
    """Boolean keep-mask pytree, ``m_ij ~ Bernoulli(1 - p)`` i.i.d. per entry.

    Unselected leaves (``mask`` False) get an all-True mask. Leaf ``i`` uses
    ``fold_in(key, i)``, so masks are reproducible and independent across leaves.
    ``rng="hash"`` (default) draws them from a counter-based hash
    (:mod:`moejax.delta.hash_mask`: a few integer ops per entry, so DARE runs at about the
    speed of one pass over the tree); ``rng="threefry"`` from ``jax.random.bernoulli``
    (other masks for the same key).
    """
    _check_rate(p)
    if rng == "hash":  # which checks the mask itself
        return hash_keep_mask(key, delta_tree, p, mask)
    if rng != "threefry":
        raise ValueError(f"rng={rng!r}; use 'threefry' (JAX's PRNG) or 'hash'")
    mask_leaves(mask, delta_tree, "dare_keep_mask")
    keys = per_leaf_keys(key, delta_tree)
    sel = jax.tree_util.tree_map(lambda _: True, delta_tree) if mask is None else mask
    return jax.tree_util.tree_map(
        lambda d, k, m: (
            jax.random.bernoulli(k, 1.0 - p, jnp.shape(d)) if m else jnp.ones(jnp.shape(d), bool)
        ),
        delta_tree,
        keys,
        sel,
    )


def dare(
    key: jax.Array,
    delta_tree: PyTree,
    p: float,
    *,
    q: float | PyTree | dict[str, float] | None = None,
    mask: PyTree | None = None,
    rng: str = "hash",
) -> PyTree:
    """DARE / DAREx-q: ``Delta'_ij = m_ij Delta_ij / q``, ``m_ij ~ Bernoulli(1-p)``
    (drawn by ``rng``, see :func:`dare_keep_mask`).

    ``q=None`` gives vanilla DARE (``q = 1 - p``). ``q`` may be one global float, a
    ``{leaf_path: q}`` dict or a pytree of per-leaf floats. Unselected leaves (``mask``
    False) are returned unchanged. With the same ``key`` the same entries are dropped
    whatever ``q`` is.
    """
    _check_rate(p)
    qs = per_leaf_values(1.0 - p if q is None else q, delta_tree, "q")
    leaves, treedef = jax.tree_util.tree_flatten(delta_tree)
    sel = mask_leaves(mask, delta_tree, "dare")
    check_rescaled("dare", delta_tree, qs, sel)
    picked = [d for d, s in zip(leaves, sel) if s]
    q_sel = [jnp.asarray(qi) for qi, s in zip(qs, sel) if s]  # :func:`rescale` widens them
    dropped = iter(_drop_and_rescale(key, picked, q_sel, p=float(p), sel=tuple(sel), rng=rng,
                                     treedef=treedef))
    return jax.tree_util.tree_unflatten(treedef, [next(dropped) if s else d
                                                  for d, s in zip(leaves, sel)])


@partial(jax.jit, static_argnames=("p", "sel", "rng", "treedef"))
def _drop_and_rescale(key, picked, q_sel, *, p, sel, rng, treedef) -> list:
    """The selected leaves' ``m * Delta / q``, all in one program (op by op, each leaf's mask
    and rescale would be a dozen dispatches, each compiled for its shape). Only the selected
    leaves are passed in; the others stand in as scalars, so each leaf keeps its index (and
    its mask's key)."""
    it = iter(picked)
    leaves = [next(it) if s else jnp.zeros(()) for s in sel]
    keep = jax.tree_util.tree_leaves(dare_keep_mask(
        key, jax.tree_util.tree_unflatten(treedef, leaves), p,
        jax.tree_util.tree_unflatten(treedef, list(sel)), rng))
    return [jnp.where(k, rescale(d, q), jnp.zeros((), d.dtype))
            for d, k, q in zip(picked, [k for k, s in zip(keep, sel) if s], q_sel)]


def q_grid(p: float, num: int = 20, *, q_max: float = 1.0, include_max: bool = True,
           spacing: Literal["linear", "geometric"] = "linear",
           inv_q_min: float = 10.0) -> np.ndarray:
    """Candidate rescalings ``q``, starting at vanilla DARE's ``1 - p``.

    ``spacing="linear"``: ``q_t = 1 - p + t * dq``, ``t = 0..num``,
    ``dq = (q_max - (1-p)) / num`` (paper Algorithm 2's grid). ``"geometric"``: ``num + 1``
    points geometric from ``1 - p`` to ``1 / inv_q_min`` (``1/q`` from ``1/(1-p)`` down to
    ``inv_q_min``; to ``q_max`` when ``1/(1-p)`` is under ``4 inv_q_min``), dense
    near ``1 - p`` where the paper's optima lie (p = 0.99: ``1/q`` of 30 to 55, i.e.
    ``q`` of 0.018 to 0.033, between the linear grid's first two points at ``num = 20``).

    ``t = 0`` is vanilla DARE, so a search can never score worse than DARE on its own
    objective. ``include_max=False`` drops the last point (paper Algorithm 3, ``t != N``).
    """
    _check_rate(p)
    if int(num) != num or num < 1:
        raise ValueError(f"num={num} must be an int >= 1 grid steps.")
    if spacing == "linear":
        g = np.linspace(1.0 - p, q_max, int(num) + 1)
    elif spacing == "geometric":
        if not (np.isfinite(inv_q_min) and inv_q_min >= 1.0):
            raise ValueError(f"inv_q_min={inv_q_min} must be a finite 1/q >= 1.")
        # narrowed to 1/q >= inv_q_min only where that still spans a factor of 4 (p = 0.99:
        # 1/q from 100 to 10); nearer (p = 0.9: 1 - p is 1 / inv_q_min itself) the grid
        # would collapse onto 1 - p, vanilla DARE, so it runs to q_max
        hi = 1.0 / inv_q_min if 4.0 * (1.0 - p) <= 1.0 / inv_q_min else q_max
        g = np.geomspace(1.0 - p, hi, int(num) + 1)
    else:
        raise ValueError(f"spacing={spacing!r}: 'linear' or 'geometric'")
    return g if include_max else g[:-1]


class GridSearchResult(NamedTuple):
    """Outcome of a 1-D grid search: best point, its score and every (point, score)."""

    best: float
    best_score: float
    points: np.ndarray
    scores: np.ndarray


class NoFiniteScore(ValueError):
    """A search whose score is not finite at any point: there is nothing to choose."""


def grid_search(
    score_fn: Callable[[float], float],
    grid: Sequence[float],
    *,
    minimize: bool = True,
    refine_rounds: int = 0,
    refine_num: int = 10,
    lo: float | None = None,
    hi: float | None = None,
) -> GridSearchResult:
    """Evaluate ``score_fn`` on ``grid``; optionally refine coarse-to-fine.

    Each refinement round evaluates ``refine_num + 1`` evenly spaced points between the
    neighbours of the current best point (clipped to ``[lo, hi]``). Ties keep the
    earliest point evaluated.
    """
    pts = [float(x) for x in grid]
    if not pts:
        raise ValueError("grid_search: empty grid; pass at least one point.")
    lo = min(pts) if lo is None else lo
    hi = max(pts) if hi is None else hi
    scores = [float(score_fn(x)) for x in pts]
    sign = 1.0 if minimize else -1.0

    def best_idx():
        vals = [sign * s if np.isfinite(s) else np.inf for s in scores]
        return int(np.argmin(vals))

    step = (max(pts) - min(pts)) / max(len(pts) - 1, 1)
    for _ in range(refine_rounds):
        b = pts[best_idx()]
        a, c = max(lo, b - step), min(hi, b + step)
        new = [x for x in np.linspace(a, c, refine_num + 1) if all(abs(x - y) > 1e-12 for y in pts)]
        pts += [float(x) for x in new]
        scores += [float(score_fn(x)) for x in new]
        step = (c - a) / refine_num
    if not any(np.isfinite(s) for s in scores):
        raise NoFiniteScore(f"grid_search: the score is not finite at any of the {len(pts)} "
                         f"points ({scores[0]} at {pts[0]}); the metric fails there, so no "
                         "point can be chosen")
    i = best_idx()
    return GridSearchResult(pts[i], scores[i], np.asarray(pts), np.asarray(scores))


def _default_pruner(p: float, mask: PyTree | None) -> Pruner:
    return lambda key, d, q: dare(key, d, p, q=q, mask=mask)


def search_q_v(
    key: jax.Array,
    pretrained: PyTree,
    delta_tree: PyTree,
    p: float,
    metric_fn: Callable[[PyTree], float],
    *,
    higher_is_better: bool = True,
    mask: PyTree | None = None,
    grid: Sequence[float] | None = None,
    refine_rounds: int = 0,
    pruner: Pruner | None = None,
) -> GridSearchResult:
    """Global ``q_v = argopt_q metric_fn(theta_P + P(Delta, q))`` over ``grid``.

    ``metric_fn(params) -> float`` is any validation score (accuracy, -loss ...).
    ``pruner(key, delta, q)`` defaults to :func:`dare` at rate ``p``; pass e.g. a
    structural-DPP pruner to tune its rescaling instead.
    """
    prune = pruner or _default_pruner(p, mask)
    grid = q_grid(p) if grid is None else grid
    score = lambda q: metric_fn(apply_delta(pretrained, prune(key, delta_tree, q)))
    return grid_search(
        score, grid, minimize=not higher_is_better, refine_rounds=refine_rounds, lo=1.0 - p, hi=1.0
    )


def mean_abs_output_change(outputs_a, outputs_b) -> float:
    """``mean |a - b|`` over every entry of two (pytrees of) output arrays."""
    la, lb = jax.tree_util.tree_leaves(outputs_a), jax.tree_util.tree_leaves(outputs_b)
    tot = sum(
        float(jnp.sum(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
        for a, b in zip(la, lb)
    )
    return tot / max(sum(int(jnp.size(a)) for a in la), 1)


def search_q_e(
    key: jax.Array,
    pretrained: PyTree,
    delta_tree: PyTree,
    p: float,
    outputs_fn: Callable[[PyTree], Any],
    *,
    mask: PyTree | None = None,
    grid: Sequence[float] | None = None,
    refine_rounds: int = 0,
    pruner: Pruner | None = None,
) -> GridSearchResult:
    """Label-free global ``q_e``: minimise the mean absolute last-layer output change

    ``q_e = argmin_q mean_{batch, i} |f_L(theta_P + P(Delta, q))_i - f_L(theta_P + Delta)_i|``

    ``outputs_fn(params)`` returns the last layer's outputs on ONE fixed batch (closing
    over the batch) -- any model, any framework, as long as it takes the param pytree.
    """
    prune = pruner or _default_pruner(p, mask)
    grid = q_grid(p) if grid is None else grid
    ref = outputs_fn(apply_delta(pretrained, delta_tree))
    score = lambda q: mean_abs_output_change(
        outputs_fn(apply_delta(pretrained, prune(key, delta_tree, q))), ref
    )
    return grid_search(score, grid, minimize=True, refine_rounds=refine_rounds, lo=1.0 - p, hi=1.0)
