"""The delta-pruning methods of the DAREx paper (Sec. 3-4) behind one name each.

:class:`PruneContext` holds ``(theta_P, Delta)``, the metrics and the input statistics;
:func:`run_one` applies one method at drop rate ``p`` and scores it on the test metric;
:func:`run_methods` sweeps methods x rates. Methods (``METHODS``): DARE, DAREx-q with q_v /
q_e / per-layer q_v / per-layer q_e (analytic q on the :func:`eta_grid`), magnitude, WANDA
and structural DPP + q_v. Everything works on any pytree; models enter only through the
metric callables.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from moejax.delta.analytic_q import Q_FORMS, coefficient_sums, phi, search_eta_e, search_eta_v
from moejax.delta.dare import NoFiniteScore, dare, q_grid, search_q_e, search_q_v
from moejax.delta.importance import magnitude_prune, structural_pruner, wanda_prune
from moejax.delta.tree import apply_delta, leaf_paths, mask_leaves, select_leaves
from moejax.extras import progress

__all__ = ["MethodName", "PruneContext", "run_one", "run_methods", "eta_grid", "METHODS",
           "delta_stats"]

MethodName = Literal[
    "unpruned",
    "DARE",
    "DAREx-q (q_v)",
    "DAREx-q (q_e)",
    "DAREx-q (per-layer q_v)",
    "DAREx-q (per-layer q_e)",
    "DAREx-q (per-layer q_v, pooled)",
    "magnitude",
    "WANDA",
    "structural DPP + q_v",
]
METHODS: tuple[str, ...] = get_args(MethodName)[1:]  # every pruning method ("unpruned" aside)


def delta_stats(delta_tree, mask) -> dict:
    """Mean |Delta| and L2 norm over the selected leaves."""
    sel = [x for x, m in zip(jax.tree_util.tree_leaves(delta_tree),
                             mask_leaves(mask, delta_tree, "delta_stats")) if m]
    n = sum(x.size for x in sel)
    return {"mean_abs_delta": float(sum(jnp.sum(jnp.abs(x)) for x in sel) / max(n, 1)),
            "delta_l2": float(jnp.sqrt(sum(jnp.sum(x * x) for x in sel)))}


def eta_grid(delta_tree, mask, x_stat: dict, p: float, num: int = 12, *,
             signed: bool = True) -> np.ndarray:
    """Geometric eta grid whose per-layer q*(eta) covers ``[1-p, 1]``.

    For one output unit Eq. 5 is minimised at ``q* = eta Phi(p) S2 / (2 (1-p) |S1|)``, so
    ``eta(q) = 2 (1-p) q |S1| / (Phi(p) S2)``; we take the median unit of every layer and span
    from the smallest ``eta(1-p)`` to the largest ``eta(1)``. ``signed``: coefficients
    ``Delta_ij xbar_j`` (two-sided and official forms, ``x_stat`` = signed mean input) or
    ``|Delta_ij| xbar_j`` (pooled form, ``x_stat`` = mean |x|).
    """
    phi_p = phi(p)
    lo, hi = [], []
    for path, d, m in zip(leaf_paths(delta_tree), jax.tree_util.tree_leaves(delta_tree),
                          mask_leaves(mask, delta_tree, "eta_grid")):
        if not m:
            continue
        if path not in x_stat:
            raise ValueError(f"eta_grid: no input statistic for selected leaf {path!r}; add it "
                             "to x_stat or deselect the leaf via mask.")
        s1, s2 = coefficient_sums(d, x_stat[path], signed=signed)
        ratio = np.abs(s1[s2 > 0]) / s2[s2 > 0]
        ratio = ratio[ratio > 0]
        if ratio.size == 0:
            continue
        r = float(np.median(ratio))
        lo.append(2 * (1 - p) * (1 - p) * r / phi_p)
        hi.append(2 * (1 - p) * 1.0 * r / phi_p)
    if not lo:
        raise ValueError("eta_grid: every selected delta leaf is zero; nothing to prune.")
    return np.geomspace(min(lo) * 0.5, max(hi) * 2.0, num)


@dataclass
class PruneContext:
    """Everything the pruning methods need.

    ``val_metric(params)`` / ``test_metric(params)``: higher is better (use ``-loss`` for LMs);
    ``outputs_fn(params)``: last-layer outputs on ONE fixed batch (for q_e);
    ``x_stats``: ``{leaf_path: MatrixInputStats}`` of the matrix inputs (WANDA, analytic q).
    ``structural_a``: fraction of input dimensions kept (the paper: 0.05 with ``b = 0.2`` at
    p = 0.99; raised to ``1 - p`` at low rates so that ``b = (1 - p) / a <= 1``).
    ``structural_include``: which selected matrices structural DPP prunes by input dimension
    (the paper: the MLP layers; a model with no matching leaf, e.g. a plain MLP, is all MLP);
    the other selected matrices get DARE at the same ``p`` and ``q`` so the overall rate is
    ``p``. ``analytic_form``: the bound the per-layer methods minimise
    (:mod:`moejax.delta.analytic_q`; ``"two_sided"``, the default, or the official code's
    ``"official_signed"``); ``"DAREx-q (per-layer q_v, pooled)"`` always uses ``"pooled"``.
    ``q_spacing``: the searched ``q`` grid of ``q_num`` steps (:func:`moejax.delta.dare.
    q_grid`; ``"geometric"`` from ``1/q = 1/(1-p)`` down to 10, or ``"linear"`` over
    ``[1-p, 1]``).
    """

    pretrained: Any
    delta: Any
    mask: Any
    key: jax.Array
    val_metric: Callable[[Any], float]
    test_metric: Callable[[Any], float]
    outputs_fn: Callable[[Any], Any]
    x_stats: dict = field(default_factory=dict)
    q_num: int = 20
    refine_rounds: int = 1
    eta_num: int = 12
    structural_a: float = 0.05
    structural_include: str = r"(^|/)(ffn|mlp)/"
    analytic_form: str = "two_sided"
    q_spacing: str = "geometric"
    records: dict = field(default_factory=dict)  # method -> search record (for plots)

    def __post_init__(self):
        if self.q_spacing not in ("geometric", "linear"):
            raise ValueError(f"q_spacing={self.q_spacing!r}: 'geometric' or 'linear'")
        for key in ("q_num", "eta_num"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1 grid steps")
        if not any(bool(m) for m in jax.tree_util.tree_leaves(self.mask)):
            raise ValueError("mask selects no delta leaf: nothing to prune")
        if self.analytic_form not in Q_FORMS[:2]:
            raise ValueError(f"analytic_form={self.analytic_form!r}: one of "
                             f"{', '.join(Q_FORMS[:2])} (the pooled form is its own method)")

    @property
    def stats_mask(self):
        """The pruned leaves that have input statistics (the matrices used as ``x @ W``):
        where WANDA and the analytic per-layer ``q`` apply; the other pruned leaves
        (vectors, embedding tables) get magnitude pruning in WANDA's place and, in the
        per-layer methods, the official rescaling of leaves without a q
        (:func:`moejax.delta.analytic_q.fill_other_leaves`)."""
        paths = leaf_paths(self.delta)
        flat = [bool(m) and pth in self.x_stats
                for pth, m in zip(paths, jax.tree_util.tree_leaves(self.mask))]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.mask), flat)

    def test(self, delta_tree) -> float:
        return float(self.test_metric(apply_delta(self.pretrained, delta_tree)))


def _fmt_q(q) -> str:
    if isinstance(q, dict):
        vals = np.asarray(list(q.values()), float)
        return f"{vals.min():.3g}..{vals.max():.3g}"
    return f"{float(q):.4g}"


def _structural_mlp_pruner(ctx: PruneContext, a: float, b: float, p: float):
    """Structural DPP on the MLP matrices, DARE (same ``p``, ``q``) on the other selected ones."""
    sel = select_leaves(ctx.delta, include=ctx.structural_include, min_ndim=2, allow_empty=True)
    mlp = jax.tree.map(lambda m, s: bool(m) and bool(s), ctx.mask, sel)
    if not any(jax.tree.leaves(mlp)):  # no MLP module: every selected matrix is MLP
        mats = select_leaves(ctx.delta, min_ndim=2, allow_empty=True)
        mlp = jax.tree.map(lambda m, s: bool(m) and bool(s), ctx.mask, mats)
    rest = jax.tree.map(lambda m, s: bool(m) and not s, ctx.mask, mlp)
    structural = structural_pruner(a, b, mask=mlp)

    def pruner(key, d, q):
        out = structural(key, d, q)
        if any(jax.tree.leaves(rest)):
            out = dare(jax.random.fold_in(key, 1), out, p, q=q, mask=rest)
        return out

    return pruner


def run_one(ctx: PruneContext, method: str, p: float) -> dict:
    """Apply ``method`` at drop rate ``p``; returns ``{"metric", "q", "seconds"}``. A search
    whose validation score is not finite at any of its points chooses no q: its row gets a
    NaN metric and says so, and the other rows still run."""
    t0 = time.time()
    try:
        out, q = _pruned(ctx, method, p)
    except NoFiniteScore:
        return {"metric": float("nan"), "q": "none: no finite validation score",
                "seconds": round(time.time() - t0, 2)}
    return {"metric": ctx.test(out), "q": _fmt_q(q) if q != "" else "",
            "seconds": round(time.time() - t0, 2)}


def _pruned(ctx: PruneContext, method: str, p: float):
    """``(pruned delta, q)`` of ``method`` at drop rate ``p`` (``q``: ``""`` where none)."""
    P, D, mask, key = ctx.pretrained, ctx.delta, ctx.mask, ctx.key
    q = ""
    grid = q_grid(p, ctx.q_num, spacing=ctx.q_spacing)
    if method == "unpruned":
        out = D
    elif method == "DARE":
        out, q = dare(key, D, p, mask=mask), 1 - p
    elif method == "DAREx-q (q_v)":
        r = search_q_v(key, P, D, p, ctx.val_metric, mask=mask, grid=grid,
                          refine_rounds=ctx.refine_rounds)
        ctx.records[(method, p)] = r
        out, q = dare(key, D, p, q=r.best, mask=mask), r.best
    elif method == "DAREx-q (q_e)":
        r = search_q_e(key, P, D, p, ctx.outputs_fn, mask=mask, grid=grid,
                          refine_rounds=ctx.refine_rounds)
        ctx.records[(method, p)] = r
        out, q = dare(key, D, p, q=r.best, mask=mask), r.best
    elif method.startswith("DAREx-q (per-layer"):
        form = "pooled" if method.endswith("pooled)") else ctx.analytic_form
        xbar = {k: (v.mean_abs if form == "pooled" else v.mean) for k, v in ctx.x_stats.items()}
        qm = ctx.stats_mask
        etas = eta_grid(D, qm, xbar, p, ctx.eta_num, signed=form != "pooled")
        if "q_v" in method:
            r = search_eta_v(key, P, D, xbar, p, ctx.val_metric, etas, mask=mask, form=form,
                             q_mask=qm)
        else:
            r = search_eta_e(key, P, D, xbar, p, ctx.outputs_fn, etas, mask=mask, form=form,
                             q_mask=qm)
        ctx.records[(method, p)] = r
        out, q = dare(key, D, p, q=r.q, mask=mask), r.q
    elif method == "magnitude":
        out = magnitude_prune(D, p, mask=mask)
    elif method == "WANDA":
        qm = ctx.stats_mask
        norms = {k: v.l2 for k, v in ctx.x_stats.items()}
        out = wanda_prune(D, norms, p, mask=qm)
        rest = jax.tree.map(lambda m, s: bool(m) and not s, mask, qm)
        if any(jax.tree.leaves(rest)):  # no input statistic: |Delta| alone
            out = magnitude_prune(out, p, mask=rest)
    elif method == "structural DPP + q_v":
        a = min(1.0, max(ctx.structural_a, 1 - p))  # below p = 1 - a keep whole dimensions
        b = (1 - p) / a
        pruner = _structural_mlp_pruner(ctx, a, b, p)
        r = search_q_v(key, P, D, p, ctx.val_metric, grid=grid, pruner=pruner,
                          refine_rounds=ctx.refine_rounds)
        ctx.records[(method, p)] = r
        out, q = pruner(key, D, r.best), r.best
    else:
        raise ValueError(f"unknown method {method!r}; available: unpruned, {', '.join(METHODS)}")
    return out, q


def run_methods(ctx: PruneContext, methods: Sequence[str], ps: Sequence[float],
                desc: str = "prune") -> list[dict]:
    """``[{"p", "method", "metric", "q", "seconds"}]`` for every (p, method)."""
    rows = []
    todo = [(p, m) for p in ps for m in methods]
    for p, m in progress(todo, desc=desc, leave=False):
        rows.append({"p": p, "method": m, **run_one(ctx, m, p)})
    return rows
