"""Shared pieces of the DAREx studies (a helper, not an experiment module).

* :func:`make_tx`: AdamW / AdamR-L2 / AdamR-L1 with warmup + linear decay and clipping;
* :func:`fit`: a jitted functional training loop over any param pytree;
* :class:`PruneContext` + :func:`run_methods`: apply the delta-pruning methods of SPEC section 3
  (DARE, DAREx-q with q_v / q_e / per-layer q_v / per-layer q_e, magnitude, WANDA, structural
  DPP) to ``(theta_P, Delta)`` and score each on a test metric;
* :func:`eta_grid`: the eta grid of the analytic per-layer q, spanning ``q in [1-p, 1]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from moejax import delta as dl
from moejax.optim.adamr import adamr

__all__ = ["make_tx", "fit", "PruneContext", "run_methods", "eta_grid", "METHODS", "delta_stats"]

METHODS = (
    "DARE",
    "DAREx-q (q_v)",
    "DAREx-q (q_e)",
    "DAREx-q (per-layer q_v)",
    "DAREx-q (per-layer q_e)",
    "magnitude",
    "WANDA",
    "structural DPP + q_v",
)


def make_tx(
    optimizer: str, lr: float, steps: int, *, weight: float = 0.0, warmup: int = 0,
    clip: float = 1.0,
) -> optax.GradientTransformation:
    """``optimizer``: ``"adamw"`` (``weight`` = decoupled weight decay, 0 = plain Adam),
    ``"adamr_l2"`` / ``"adamr_l1"`` (``weight`` = lambda of paper Algorithm 1)."""
    sched = optax.join_schedules(
        [optax.linear_schedule(lr / max(warmup, 1), lr, max(warmup, 1)),
         optax.linear_schedule(lr, lr * 0.1, max(steps - warmup, 1))], [max(warmup, 1)])
    if optimizer == "adamw":
        opt = optax.adamw(sched, weight_decay=weight)
    elif optimizer in ("adamr_l2", "adamr_l1"):
        opt = adamr(sched, weight, reg=optimizer[-2:])
    else:
        raise ValueError(f"optimizer={optimizer!r}; use 'adamw', 'adamr_l2' or 'adamr_l1'.")
    return optax.chain(optax.clip_by_global_norm(clip), opt) if clip > 0 else opt


_STEP_CACHE: dict = {}


def fit(
    loss_fn: Callable[[Any, Any], jax.Array], params: Any, tx: optax.GradientTransformation,
    batch_at: Callable[[int], Any], steps: int, *, desc: str = "train",
) -> tuple[Any, list[float]]:
    """``steps`` of ``params <- tx(grad loss_fn(params, batch_at(i)))``; returns params, losses.

    The jitted step is cached per ``(loss_fn, tx)`` pair, so reusing both objects (e.g. over
    seeds) compiles once.
    """
    cache_key = (id(loss_fn), id(tx))
    if cache_key not in _STEP_CACHE:

        @jax.jit
        def step(prm, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(prm, batch)
            updates, opt_state = tx.update(grads, opt_state, prm)
            return optax.apply_updates(prm, updates), opt_state, loss

        _STEP_CACHE[cache_key] = (step, loss_fn, tx)  # keep the objects alive: ids stay unique
    step = _STEP_CACHE[cache_key][0]
    opt_state, losses = tx.init(params), []
    for i in tqdm(range(steps), desc=desc, leave=False, mininterval=2.0):
        params, opt_state, loss = step(params, opt_state, batch_at(i))
        losses.append(loss)
    return params, [float(x) for x in jax.device_get(losses)]


def delta_stats(delta_tree, mask) -> dict:
    """Mean |Delta| and L2 norm over the selected leaves."""
    sel = [x for x, m in zip(jax.tree_util.tree_leaves(delta_tree), jax.tree_util.tree_leaves(mask))
           if m]
    n = sum(x.size for x in sel)
    return {"mean_abs_delta": float(sum(jnp.sum(jnp.abs(x)) for x in sel) / max(n, 1)),
            "delta_l2": float(jnp.sqrt(sum(jnp.sum(x * x) for x in sel)))}


def eta_grid(delta_tree, mask, x_mean_abs: dict, p: float, num: int = 12) -> np.ndarray:
    """Geometric eta grid whose per-layer q*(eta) covers ``[1-p, 1]``.

    For one output unit Eq. 5 is minimised at ``q* = eta Phi(p) S2 / (2 (1-p) S1)``, so
    ``eta(q) = 2 (1-p) q S1 / (Phi(p) S2)``; we take the median unit of every layer and span
    from the smallest ``eta(1-p)`` to the largest ``eta(1)``.
    """
    phi = dl.phi(p)
    lo, hi = [], []
    for path, d, m in zip(dl.leaf_paths(delta_tree), jax.tree_util.tree_leaves(delta_tree),
                          jax.tree_util.tree_leaves(mask)):
        if not m:
            continue
        s1, s2 = dl.coefficient_sums(d, x_mean_abs[path])
        ratio = s1[s2 > 0] / s2[s2 > 0]
        if ratio.size == 0:
            continue
        r = float(np.median(ratio))
        lo.append(2 * (1 - p) * (1 - p) * r / phi)
        hi.append(2 * (1 - p) * 1.0 * r / phi)
    if not lo:
        raise ValueError("eta_grid: every selected delta leaf is zero; nothing to prune.")
    return np.geomspace(min(lo) * 0.5, max(hi) * 2.0, num)


@dataclass
class PruneContext:
    """Everything the pruning methods need.

    ``val_metric(params)`` / ``test_metric(params)``: higher is better (use ``-loss`` for LMs);
    ``outputs_fn(params)``: last-layer outputs on ONE fixed batch (for q_e);
    ``x_stats``: ``{leaf_path: MatrixInputStats}`` of the matrix inputs (WANDA, analytic q).
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
    records: dict = field(default_factory=dict)  # method -> search record (for plots)

    def test(self, delta_tree) -> float:
        return float(self.test_metric(dl.apply_delta(self.pretrained, delta_tree)))


def _fmt_q(q) -> str:
    if isinstance(q, dict):
        vals = np.asarray(list(q.values()), float)
        return f"{vals.min():.3g}..{vals.max():.3g}"
    return f"{float(q):.4g}"


def run_one(ctx: PruneContext, method: str, p: float) -> dict:
    """Apply ``method`` at drop rate ``p``; returns ``{"metric", "q", "seconds"}``."""
    P, D, mask, key = ctx.pretrained, ctx.delta, ctx.mask, ctx.key
    t0, q = time.time(), ""
    grid = dl.q_grid(p, ctx.q_num)
    if method == "unpruned":
        out = D
    elif method == "DARE":
        out, q = dl.dare(key, D, p, mask=mask), 1 - p
    elif method == "DAREx-q (q_v)":
        r = dl.search_q_v(key, P, D, p, ctx.val_metric, mask=mask, grid=grid,
                          refine_rounds=ctx.refine_rounds)
        ctx.records[(method, p)] = r
        out, q = dl.dare(key, D, p, q=r.best, mask=mask), r.best
    elif method == "DAREx-q (q_e)":
        r = dl.search_q_e(key, P, D, p, ctx.outputs_fn, mask=mask, grid=grid,
                          refine_rounds=ctx.refine_rounds)
        ctx.records[(method, p)] = r
        out, q = dl.dare(key, D, p, q=r.best, mask=mask), r.best
    elif method in ("DAREx-q (per-layer q_v)", "DAREx-q (per-layer q_e)"):
        xbar = {k: v.mean_abs for k, v in ctx.x_stats.items()}
        etas = eta_grid(D, mask, xbar, p, ctx.eta_num)
        if method.endswith("q_v)"):
            r = dl.search_eta_v(key, P, D, xbar, p, ctx.val_metric, etas, mask=mask)
        else:
            r = dl.search_eta_e(key, P, D, xbar, p, ctx.outputs_fn, etas, mask=mask)
        ctx.records[(method, p)] = r
        out, q = dl.dare(key, D, p, q=r.q, mask=mask), r.q
    elif method == "magnitude":
        out = dl.magnitude_prune(D, p, mask=mask)
    elif method == "WANDA":
        norms = {k: v.l2 for k, v in ctx.x_stats.items()}
        out = dl.wanda_prune(D, norms, p, mask=mask)
    elif method == "structural DPP + q_v":
        a = min(1.0, ctx.structural_a)
        b = (1 - p) / a
        if b > 1:
            raise ValueError(f"structural DPP: a={a} too small for p={p} (b={(1 - p) / a} > 1).")
        pruner = dl.structural_pruner(a, b, mask=mask)
        r = dl.search_q_v(key, P, D, p, ctx.val_metric, grid=grid, pruner=pruner,
                          refine_rounds=ctx.refine_rounds)
        ctx.records[(method, p)] = r
        out, q = pruner(key, D, r.best), r.best
    else:
        raise ValueError(f"unknown method {method!r}; available: unpruned, {', '.join(METHODS)}")
    return {"metric": ctx.test(out), "q": _fmt_q(q) if q != "" else "",
            "seconds": round(time.time() - t0, 2)}


def run_methods(ctx: PruneContext, methods: Sequence[str], ps: Sequence[float],
                desc: str = "prune") -> list[dict]:
    """``[{"p", "method", "metric", "q", "seconds"}]`` for every (p, method)."""
    rows = []
    todo = [(p, m) for p in ps for m in methods]
    for p, m in tqdm(todo, desc=desc, leave=False):
        rows.append({"p": p, "method": m, **run_one(ctx, m, p)})
    return rows
