"""Per-layer analytic DAREx-q rescaling from the concentration bound (paper App. C.9, E.2).

For output unit ``i`` of a layer, with ``c_ij = Delta_ij x_j`` (``j`` input feature) and
``S1_i = sum_j c_ij``, ``S2_i = sum_j c_ij^2``, App. E.2 writes the pruned-and-rescaled change
as ``sum_j A_ij`` with ``A_ij = (1 - delta_ij / q) c_ij`` and bounds its upper tail for one
fixed ``eta > 0`` (Eq. 10, Kearns-Saul)::

    Pr[sum_j A_ij > eps] <= exp(eta ((1 - (1-p)/q) S1_i - eps) + eta^2 Phi(p) S2_i / (4 q^2))

    Phi(p) = (1 - 2p) / log((1 - p)/p)       (Kearns-Saul, paper Eq. 7; Phi(1/2) = 1/2)

The bound the paper wants is on ``|h_i^diff|`` (Eq. 11), so the lower tail counts too. It is
the same inequality for ``-A_ij``, i.e. with ``c_ij -> -c_ij``: ``S1_i`` changes sign and
``S2_i`` does not. Both tails are below ``gamma/2`` once ``eta eps`` reaches the larger of the
two exponents' remainders, which, since ``q >= 1-p`` makes ``1 - (1-p)/q >= 0``, is::

    f_i(q) = log(2/gamma) + eta (1 - (1-p)/q) |S1_i| + eta^2 Phi(p) S2_i / (4 q^2)

Eq. (5) with ``|S1_i|`` for ``sum_j c_ij``: the bound on ``|h_i^diff|`` is unchanged when a
unit's delta row changes sign, and so is the ``q`` minimising it. In ``u = 1/q`` it is a
parabola, minimised at ``q*_i = eta Phi(p) S2_i / (2 (1-p) |S1_i|)`` (clipped to the grid): a
small ``eta`` gives DARE's ``q = 1-p``, a larger one a larger ``q``.

Three ways to turn it into one ``q`` per layer (``form``):

* ``"two_sided"`` (the default): ``f_i`` above with ``x_j`` the **signed** mean input
  ``mean_t x_tj``; each unit takes its own ``argmin_q f_i`` by the official code's upward scan
  ``q = 1-p, 1-p + 0.001, ..., 0.998``, which stops once ``stop_fraction`` (0.8) of the units
  have seen ``f_i`` stop decreasing (outlier units keep their best so far); the layer's ``q``
  is the **mean** of the units' ``q``;
* ``"official_signed"`` (the official code, ``utils/analyticalq.py`` and ``utils/getwx.py`` of
  github.com/vengdeng/DAREx): the same scan and mean over Eq. (5) with the **signed** ``S1_i``
  inside the absolute value. Only the upper tail is bounded: a unit with ``S1_i < 0`` sees
  ``f_i`` fall over the whole grid for every ``eta`` whose ``eta |S1_i|`` is small against
  ``log(2/gamma)``, ends at ``q = 0.998``, and the layer's ``q`` follows the share of such
  units rather than the bound;
* ``"pooled"``: ``c_ij = |Delta_ij| * mean_t |x_tj|`` and one ``q`` minimising the mean of
  ``f_i`` over the units, on a 200-point grid.

Deviation kept in all three: the official code appends the layer's bias delta as one more
input column (input 1); here biases are separate leaves and are not appended.
A single ``eta`` is then grid-searched for the whole network, on the last-layer output change
(``q_e`` vector) or on a validation metric (``q_v`` vector).

Matrices follow the JAX/Flax layout ``[..., d_in, d_out]`` (``y = x @ W``); pass
``in_axis=-1`` for ``[d_out, d_in]`` (PyTorch) layouts. Leading axes (e.g. stacked
experts) are treated as more output units of the same layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, get_args

import jax
import numpy as np

from moejax.delta.dare import GridSearchResult, dare, grid_search, mean_abs_output_change, q_grid
from moejax.delta.tree import apply_delta, leaf_paths, mask_leaves, per_leaf_values

__all__ = [
    "QForm",
    "Q_FORMS",
    "official_grid",
    "per_unit_q",
    "phi",
    "psi",
    "coefficient_sums",
    "eq5_objective",
    "analytic_q_leaf",
    "analytic_q_tree",
    "EtaSearchResult",
    "fill_other_leaves",
    "search_eta_e",
    "search_eta_v",
]

PyTree = Any
QForm = Literal["two_sided", "official_signed", "pooled"]
Q_FORMS: tuple[str, ...] = get_args(QForm)


def phi(p: float) -> float:
    """``Phi(p) = (1-2p)/log((1-p)/p)``; limits ``Phi(0)=Phi(1)=0``, ``Phi(1/2)=1/2``."""
    p = float(p)
    if p <= 0.0 or p >= 1.0:
        return 0.0
    if abs(p - 0.5) < 1e-9:
        return 0.5
    return (1.0 - 2.0 * p) / np.log((1.0 - p) / p)


def psi(p: float) -> float:
    """Thm 3.1 factor: ``Phi(p)`` for ``p <= 1/2`` else ``sqrt(2p(1-p))`` (the DAREx
    paper's notation)."""
    return phi(p) if p <= 0.5 else float(np.sqrt(2.0 * p * (1.0 - p)))


def coefficient_sums(delta_leaf, x_stat, in_axis: int = -2, *, signed: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``S1_i = sum_j c_ij`` and ``S2_i = sum_j c_ij^2``: ``c_ij = Delta_ij xbar_j``
    (``signed``) or ``|Delta_ij| xbar_j``.

    ``x_stat`` has shape ``[d_in]`` (or broadcastable, e.g. ``[E, d_in]`` for stacked
    experts). Returns flat arrays over all output units of the leaf.
    """
    d = np.asarray(delta_leaf, np.float64)
    d = d if signed else np.abs(d)
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


def _unit_objectives(q, s1, s2, p: float, eta: float, gamma: float) -> np.ndarray:
    """``f_i(q)`` of Eq. (5) for every candidate ``q`` (leading axes) and unit ``i`` (last
    axis); pass ``|S1|`` for the two-sided bound."""
    q = np.asarray(q, np.float64)[..., None]
    return np.abs(np.log(2.0 / gamma) + eta * (1.0 - (1.0 - p) / q) * s1
                  + eta**2 * phi(p) * s2 / (4.0 * q**2))


def eq5_objective(q, s1, s2, p: float, eta: float, gamma: float = 0.05) -> np.ndarray:
    """``mean_i f_i(q)`` (the pooled form's objective); ``q`` may be an array of
    candidates (returns one value per candidate)."""
    return _unit_objectives(q, s1, s2, p, eta, gamma).mean(-1)


def official_grid(p: float) -> np.ndarray:
    """The official scan: ``q = 1-p, 1-p + 0.001, ..., 0.998``."""
    return np.arange(int(round((1.0 - p) * 1000)), 999) / 1000.0


def per_unit_q(s1, s2, p: float, eta: float, *, gamma: float = 0.05, grid=None,
               stop_fraction: float = 0.8, init_best: float = 1e4) -> np.ndarray:
    """Each unit's ``argmin_q f_i`` by the official upward scan with its early stop (a unit
    whose ``f_i`` stops decreasing is done; the scan ends when ``stop_fraction`` of them
    are). Units start at ``q = 1-p`` with best value ``init_best`` (the official code's
    10000: a unit whose ``f_i`` never gets below it keeps ``q = 1-p``, plain DARE; pass
    ``np.inf`` for a plain argmin); ties keep the larger ``q`` (the official ``<=``)."""
    g = official_grid(p) if grid is None else np.asarray(grid, np.float64)
    s1, s2 = np.asarray(s1, np.float64), np.asarray(s2, np.float64)
    best = np.full(s1.shape, float(init_best))
    q_best = np.full(s1.shape, 1.0 - p)
    done = np.zeros(s1.shape, bool)
    for q in g:
        f = _unit_objectives(q, s1, s2, p, eta, gamma)
        better, worse = f <= best, f >= best
        best = np.where(better, f, best)
        q_best = np.where(better, q, q_best)
        done |= worse
        if done.mean() >= stop_fraction:
            break
    return q_best


def analytic_q_leaf(
    delta_leaf,
    x_stat,
    p: float,
    eta: float,
    *,
    gamma: float = 0.05,
    grid: Sequence[float] | None = None,
    in_axis: int = -2,
    form: QForm = "two_sided",
    stop_fraction: float = 0.8,
) -> float:
    r"""One layer's ``q(eta)`` (see the module docstring for the three ``form``\ s;
    ``x_stat`` is the signed mean input for ``"two_sided"`` and ``"official_signed"``, the
    mean ``|x|`` for ``"pooled"``)."""
    _check_form(form)
    if not (math.isfinite(eta) and eta > 0 and 0 < gamma < 1):
        raise ValueError(f"eta={eta} must be > 0 (the bound's Laplace-transform variable) and "
                         f"gamma={gamma} in (0, 1) (its failure probability); Eq. 5 / App. E.2")
    if form == "pooled":
        g = q_grid(p, 200, include_max=False) if grid is None else np.asarray(grid, np.float64)
        s1, s2 = coefficient_sums(delta_leaf, x_stat, in_axis)
        return float(g[int(np.argmin(eq5_objective(g, s1, s2, p, eta, gamma)))])
    s1, s2 = coefficient_sums(delta_leaf, x_stat, in_axis, signed=True)
    if form == "official_signed":
        return float(np.mean(per_unit_q(s1, s2, p, eta, gamma=gamma, grid=grid,
                                        stop_fraction=stop_fraction)))
    # the two-sided f_i is unimodal in q: a plain argmin by the same scan (no 1e4 cap, which
    # would send every unit of a large-eta layer back to 1-p)
    return float(np.mean(per_unit_q(np.abs(s1), s2, p, eta, gamma=gamma, grid=grid,
                                    stop_fraction=stop_fraction, init_best=np.inf)))


def _check_form(form) -> None:
    if form not in Q_FORMS:
        raise ValueError(f"form={form!r}; use one of {', '.join(Q_FORMS)}")


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
    form: QForm = "two_sided",
) -> dict[str, float]:
    """``{leaf_path: q^l(eta)}`` for every selected leaf (unselected leaves get ``1-p``).

    ``x_stats`` gives ``xbar_j`` per leaf (the signed mean input for ``form="two_sided"``
    and ``"official_signed"``, the mean ``|x|`` for ``"pooled"``): a ``{path: array}`` dict
    (only selected leaves needed) or a pytree aligned with ``delta_tree``. The result can be
    passed as ``q=`` to :func:`moejax.delta.dare.dare`.
    """
    _check_form(form)
    paths = leaf_paths(delta_tree)
    leaves = jax.tree_util.tree_leaves(delta_tree)
    sel = mask_leaves(mask, delta_tree, "analytic_q_tree")
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
        out[pth] = analytic_q_leaf(d, x, p, eta, gamma=gamma, grid=grid, in_axis=in_axis,
                                   form=form)
    return out


def fill_other_leaves(qs: dict[str, float], delta_tree: PyTree, mask: PyTree | None,
                      q_mask: PyTree | None) -> dict[str, float]:
    """``qs`` with a ``q`` for every leaf of ``mask`` that ``q_mask`` gave none, by the
    official ``rescale_q`` (``utils/deltaprune.py``): a bias ``.../b_X`` takes its weight
    ``.../w_X``'s q, any other leaf (norm scales, embedding tables) the mean of the layers'
    q."""
    paths = leaf_paths(delta_tree)
    sel = [bool(m) for m in mask_leaves(mask, delta_tree, "fill_other_leaves")]
    has = sel if q_mask is None else [bool(m) for m in
                                      mask_leaves(q_mask, delta_tree, "fill_other_leaves")]
    stated = {pth: qs[pth] for pth, h in zip(paths, has) if h}
    if not stated:
        return dict(qs)
    mean = float(np.mean(list(stated.values())))
    out = dict(qs)
    for pth, s, h in zip(paths, sel, has):
        if s and not h:
            head, _, name = pth.rpartition("/")
            weight = f"{head}/w_{name[2:]}" if head else f"w_{name[2:]}"
            out[pth] = stated.get(weight, mean) if name.startswith("b_") else mean
    return out


class EtaSearchResult(NamedTuple):
    """Best ``eta``, the per-leaf ``q`` it induces, and the full ``eta`` search record."""

    eta: float
    q: dict[str, float]
    search: GridSearchResult


def _search_eta(key, pretrained, delta_tree, x_stats, p, etas, score_of_params, *,
                minimize: bool, gamma: float = 0.05, mask=None, in_axis: int = -2,
                form: QForm = "two_sided", q_mask=None):
    cache: dict[float, dict] = {}
    q_mask = mask if q_mask is None else q_mask

    def score(eta):
        qs = fill_other_leaves(analytic_q_tree(
            delta_tree, x_stats, p, eta, gamma=gamma, mask=q_mask, in_axis=in_axis,
            form=form), delta_tree, mask, q_mask)
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
    form: QForm = "two_sided",
    q_mask: PyTree | None = None,
) -> EtaSearchResult:
    """``q_e`` vector: ``eta_e = argmin_eta mean|f_L(P(q(eta))) - f_L(theta_F)|``.

    ``f_L`` = ``outputs_fn``; ``P(q)`` = ``theta_P + dare(key, Delta, p, q=q(eta))`` over the
    leaves of ``mask``. ``q_mask`` (default ``mask``): the leaves that get an analytic ``q``
    (matrices with input statistics); the other pruned leaves are rescaled as the official
    code does (:func:`fill_other_leaves`: a bias by its weight's q, norms and embeddings by
    the mean of the layers' q).
    """
    ref = outputs_fn(apply_delta(pretrained, delta_tree))
    return _search_eta(key, pretrained, delta_tree, x_stats, p, etas,
                       lambda prm: mean_abs_output_change(outputs_fn(prm), ref), minimize=True,
                       gamma=gamma, mask=mask, in_axis=in_axis, form=form, q_mask=q_mask)


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
    **options,
) -> EtaSearchResult:
    """``q_v`` vector: ``eta_v = argopt_eta metric_fn(theta_P + P(Delta, q(eta)))``;
    ``options``: :func:`search_eta_e`'s keywords (``gamma``, ``mask``, ``in_axis``, ``form``,
    ``q_mask``), the same meaning."""
    return _search_eta(key, pretrained, delta_tree, x_stats, p, etas,
                       lambda prm: float(metric_fn(prm)), minimize=not higher_is_better,
                       **options)
