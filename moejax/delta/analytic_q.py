"""Per-layer analytic DAREx-q rescaling from the concentration bound (paper App. C.9).

With coefficients ``c_ij = |Delta_ij| * xbar_j`` (``i`` output unit, ``j`` input feature;
``xbar_j = mean|x_j|`` as in the official code), each layer's ``q`` solves Eq. (5)::

    q(eta) = argmin_q | log(2/gamma) + eta (1 - (1-p)/q) sum_j c_ij
                        + eta^2 Phi(p) sum_j c_ij^2 / (4 q^2) |

    Phi(p) = (1 - 2p) / log((1 - p)/p)       (Kearns-Saul, paper Eq. 7; Phi(1/2) = 1/2)

Eq. (5) is written per output unit ``i``; one ``q`` per layer is obtained by
minimising the mean over output units of the absolute objective, over the grid
``q in [1-p, 1)`` (paper Algorithm 3: ``q_t = 1-p + t dq``, ``t != N``).
A single ``eta`` is then grid-searched for the whole network, on the last-layer
output change (``q_e`` vector) or on a validation metric (``q_v`` vector).

Matrices follow the JAX/Flax layout ``[..., d_in, d_out]`` (``y = x @ W``); pass
``in_axis=-1`` for ``[d_out, d_in]`` (PyTorch) layouts. Leading axes (e.g. stacked
experts) are treated as more output units of the same layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from moejax.delta.dare import GridSearchResult, dare, grid_search, mean_abs_output_change, q_grid
from moejax.delta.tree import apply_delta, leaf_paths, per_leaf_values

__all__ = [
    "phi",
    "psi",
    "coefficient_sums",
    "eq5_objective",
    "analytic_q_leaf",
    "analytic_q_tree",
    "EtaSearchResult",
    "search_eta_e",
    "search_eta_v",
]

PyTree = Any


def phi(p: float) -> float:
    """``Phi(p) = (1-2p)/log((1-p)/p)``; limits ``Phi(0)=Phi(1)=0``, ``Phi(1/2)=1/2``."""
    p = float(p)
    if p <= 0.0 or p >= 1.0:
        return 0.0
    if abs(p - 0.5) < 1e-9:
        return 0.5
    return (1.0 - 2.0 * p) / np.log((1.0 - p) / p)


def psi(p: float) -> float:
    """Thm 3.1 factor: ``Phi(p)`` for ``p <= 1/2`` else ``sqrt(2p(1-p))`` (SPEC notation)."""
    return phi(p) if p <= 0.5 else float(np.sqrt(2.0 * p * (1.0 - p)))


def coefficient_sums(delta_leaf, x_stat, in_axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """``S1_i = sum_j c_ij`` and ``S2_i = sum_j c_ij^2`` with ``c_ij = |Delta_ij| xbar_j``.

    ``x_stat`` has shape ``[d_in]`` (or broadcastable, e.g. ``[E, d_in]`` for stacked
    experts). Returns flat arrays over all output units of the leaf.
    """
    d = np.abs(np.asarray(delta_leaf, np.float64))
    if d.ndim < 2:
        raise ValueError(
            f"analytic q needs a matrix leaf, got shape {d.shape}; exclude it via mask."
        )
    d = np.moveaxis(d, in_axis, -1)  # [..., d_out, d_in]
    x = np.asarray(x_stat, np.float64)
    if x.shape[-1] != d.shape[-1]:
        raise ValueError(
            f"input statistic has {x.shape[-1]} features but the matrix has d_in={d.shape[-1]} "
            f"along in_axis={in_axis}; pass the statistics of this matrix's input (or fix in_axis)."
        )
    x = x.reshape(x.shape[:-1] + (1,) * (d.ndim - x.ndim) + x.shape[-1:]) if x.ndim > 1 else x
    c = d * x
    return c.sum(-1).reshape(-1), (c * c).sum(-1).reshape(-1)


def eq5_objective(q, s1, s2, p: float, eta: float, gamma: float = 0.05) -> np.ndarray:
    """``mean_i |log(2/gamma) + eta (1-(1-p)/q) S1_i + eta^2 Phi(p) S2_i / (4 q^2)|``.

    ``q`` may be an array of candidates (returns one value per candidate).
    """
    q = np.asarray(q, np.float64)[..., None]
    val = (
        np.log(2.0 / gamma) + eta * (1.0 - (1.0 - p) / q) * s1 + eta**2 * phi(p) * s2 / (4.0 * q**2)
    )
    return np.abs(val).mean(-1)


def analytic_q_leaf(
    delta_leaf,
    x_stat,
    p: float,
    eta: float,
    *,
    gamma: float = 0.05,
    grid: Sequence[float] | None = None,
    in_axis: int = -2,
) -> float:
    """One layer's ``q(eta)``: grid argmin of :func:`eq5_objective` (first minimum on ties)."""
    g = q_grid(p, 200, include_max=False) if grid is None else np.asarray(grid, np.float64)
    s1, s2 = coefficient_sums(delta_leaf, x_stat, in_axis)
    return float(g[int(np.argmin(eq5_objective(g, s1, s2, p, eta, gamma)))])


def analytic_q_tree(
    delta_tree: PyTree,
    x_stats: PyTree | dict,
    p: float,
    eta: float,
    *,
    gamma: float = 0.05,
    mask: PyTree | None = None,
    grid: Sequence[float] | None = None,
    in_axis: int = -2,
) -> dict[str, float]:
    """``{leaf_path: q^l(eta)}`` for every selected leaf (unselected leaves get ``1-p``).

    ``x_stats`` gives ``xbar_j`` per leaf: a ``{path: array}`` dict (only selected leaves
    needed) or a pytree aligned with ``delta_tree``. The result can be passed as
    ``q=`` to :func:`moejax.delta.dare.dare`.
    """
    paths = leaf_paths(delta_tree)
    leaves = jax.tree_util.tree_leaves(delta_tree)
    sel = [True] * len(leaves) if mask is None else jax.tree_util.tree_leaves(mask)
    if (
        isinstance(x_stats, dict)
        and all(isinstance(k, str) for k in x_stats)
        and set(x_stats) <= set(paths)
    ):
        xs = [x_stats.get(pth) for pth in paths]
    else:
        xs = per_leaf_values(x_stats, delta_tree, "x_stats")
    out = {}
    for pth, d, s, x in zip(paths, leaves, sel, xs):
        if not s:
            out[pth] = 1.0 - p
            continue
        if x is None:
            raise ValueError(
                f"analytic_q_tree: no input statistic for selected leaf {pth!r}; "
                "add it to x_stats or deselect the leaf via mask."
            )
        out[pth] = analytic_q_leaf(d, x, p, eta, gamma=gamma, grid=grid, in_axis=in_axis)
    return out


class EtaSearchResult(NamedTuple):
    """Best ``eta``, the per-leaf ``q`` it induces, and the full ``eta`` search record."""

    eta: float
    q: dict[str, float]
    search: GridSearchResult


def _search_eta(
    key, pretrained, delta_tree, x_stats, p, etas, score_of_params, minimize, gamma, mask, in_axis
):
    cache: dict[float, dict] = {}

    def score(eta):
        qs = analytic_q_tree(delta_tree, x_stats, p, eta, gamma=gamma, mask=mask, in_axis=in_axis)
        cache[float(eta)] = qs
        return score_of_params(apply_delta(pretrained, dare(key, delta_tree, p, q=qs, mask=mask)))

    res = grid_search(score, etas, minimize=minimize)
    return EtaSearchResult(res.best, cache[res.best], res)


def search_eta_e(
    key: jax.Array,
    pretrained: PyTree,
    delta_tree: PyTree,
    x_stats,
    p: float,
    outputs_fn: Callable[[PyTree], Any],
    etas: Sequence[float],
    *,
    gamma: float = 0.05,
    mask: PyTree | None = None,
    in_axis: int = -2,
) -> EtaSearchResult:
    """``q_e`` vector: ``eta_e = argmin_eta mean|f_L(P(q(eta))) - f_L(theta_F)|``.

    ``f_L`` = ``outputs_fn``; ``P(q)`` = ``theta_P + dare(key, Delta, p, q=q(eta))``.
    """
    ref = outputs_fn(apply_delta(pretrained, delta_tree))
    return _search_eta(
        key,
        pretrained,
        delta_tree,
        x_stats,
        p,
        etas,
        lambda prm: mean_abs_output_change(outputs_fn(prm), ref),
        True,
        gamma,
        mask,
        in_axis,
    )


def search_eta_v(
    key: jax.Array,
    pretrained: PyTree,
    delta_tree: PyTree,
    x_stats,
    p: float,
    metric_fn: Callable[[PyTree], float],
    etas: Sequence[float],
    *,
    higher_is_better: bool = True,
    gamma: float = 0.05,
    mask: PyTree | None = None,
    in_axis: int = -2,
) -> EtaSearchResult:
    """``q_v`` vector: ``eta_v = argopt_eta metric_fn(theta_P + P(Delta, q(eta)))``."""
    return _search_eta(
        key,
        pretrained,
        delta_tree,
        x_stats,
        p,
        etas,
        lambda prm: float(metric_fn(prm)),
        not higher_is_better,
        gamma,
        mask,
        in_axis,
    )
