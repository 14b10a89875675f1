"""Collect the inputs of every weight matrix of any JAX model, without hooks in the model code.

WANDA (``|Delta_ij| * ||x_j||_2``) and the analytic per-layer q (``c_ij = Delta_ij mean x_j``)
need per-input-feature statistics of the activations ``x`` that multiply each matrix ``W``
(``y = x @ W``). moejax models use their parameters as ``x @ self.w[...]``, so instead of adding
hooks we trace ``fn(params)`` to a jaxpr and interpret it eagerly: every ``dot_general`` whose
right operand is (a dtype cast of) a 2-D parameter leaf contracted over its first axis records
its left operand, and a grouped matmul (``ragged_dot``: an MoE's dropless dispatch) over a stack
of experts ``[E, d_in, d_out]`` records each expert's rows, the tokens routed to it, apart
(statistics ``[E, d_in]``; other dispatch paths pad the experts' rows, and are not read). The
inner programs of ``jit``, ``remat`` and custom derivatives are
interpreted in turn, and ``scan``, ``while`` and ``cond`` run as Python loops and branches, so
a body's matmuls see every step's inputs (a matrix the body closes over keeps its tag); every
other primitive is bound as in ``jax.core.eval_jaxpr``.

    stats = matmul_input_stats(lambda prm: model_fn(prm, batch), params)
    stats["blocks/0/ffn/w_up"].mean_abs, .l2, .mean    # [d_in] each

Used by WANDA and the analytic per-layer q (:mod:`moejax.delta.methods`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from moejax.delta.input_stats import (
    input_l2_norm,
    input_mean,
    input_mean_abs,
    input_stats_init,
    input_stats_update,
)
from moejax.delta.tree import leaf_paths

__all__ = ["MatrixInputStats", "matmul_input_stats"]

_PASSTHROUGH = {"convert_element_type", "copy", "copy_p"}
# primitives that run an inner jaxpr once on their operands (jit, remat, custom derivatives)
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr"}


class MatrixInputStats(NamedTuple):
    """Statistics of one matrix's input features ([d_in] each; ``[E, d_in]`` and ``[E]``
    counts for a stack of experts): ``mean|x_j|``, ``||x_j||_2`` and the signed ``mean x_j``,
    over ``count`` tokens."""

    mean_abs: np.ndarray
    l2: np.ndarray
    count: int | np.ndarray
    mean: np.ndarray | None = None


def _open(j):
    """``(jaxpr, consts)`` of a closed or an open jaxpr."""
    return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, ())


def _run(j, args, tags, record):
    jaxpr, consts = _open(j)
    return _interpret(jaxpr, consts, args, tags, record)[0]


def _scan_operands(prm, vals) -> list[list]:
    """``[consts, carry, xs]`` of a scan's operands (or of their tags); jax 0.12 describes the
    split by a flat tree, jax 0.11 by counts."""
    if "ft_in" in prm:
        return [list(part) for part in prm["ft_in"].update(list(vals)).unpack()]
    nc, ncar = prm["num_consts"], prm["num_carry"]
    return [list(vals[:nc]), list(vals[nc:nc + ncar]), list(vals[nc + ncar:])]


def _scan(eqn, invals, in_tags, record):
    """``lax.scan`` as a Python loop, so the body's matmuls see every step's inputs; the
    scan's constants keep their parameter tags (a matrix closed over by the body)."""
    prm = eqn.params
    consts, carry, xs = _scan_operands(prm, invals)
    const_tags = _scan_operands(prm, in_tags)[0]
    tags = const_tags + [None] * (len(carry) + len(xs))
    n, ys = prm["length"], [None] * prm["length"]
    if n == 0:  # no step runs: the scan's own outputs
        return _bind(eqn, invals)
    for i in (range(n - 1, -1, -1) if prm["reverse"] else range(n)):
        out = _run(prm["jaxpr"], consts + carry + [x[i] for x in xs], tags, record)
        carry, ys[i] = out[:len(carry)], out[len(carry):]
    n_ys = len(eqn.outvars) - len(carry)
    return carry + [jnp.stack([y[k] for y in ys]) for k in range(n_ys)]


def _while(eqn, invals, in_tags, record):
    """``lax.while_loop`` (and ``fori_loop``) as a Python loop."""
    prm = eqn.params
    cn, bn = prm["cond_nconsts"], prm["body_nconsts"]
    cc, bc, carry = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    ctags = list(in_tags[:cn]) + [None] * len(carry)
    btags = list(in_tags[cn:cn + bn]) + [None] * len(carry)
    while bool(_run(prm["cond_jaxpr"], cc + carry, ctags, record)[0]):
        carry = _run(prm["body_jaxpr"], bc + carry, btags, record)
    return carry


def _cond(eqn, invals, in_tags, record):
    """``lax.cond`` / ``switch``: the branch the index picks, on the operands."""
    branch = eqn.params["branches"][int(invals[0])]
    return _run(branch, invals[1:], in_tags[1:], record)


def _bind(eqn, invals) -> list:
    """The primitive of ``eqn`` applied to ``invals``, as ``jax.core.eval_jaxpr`` does."""
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


_LOOPS = {"scan": _scan, "while": _while, "cond": _cond}


def _interpret(jaxpr, consts, args, arg_tags, record):
    """Eagerly evaluate ``jaxpr``; ``arg_tags[i]`` is the param-leaf index of input i (or None).
    Returns the outputs and, per output, its tag (always None: a tag marks a parameter)."""
    env, tags = {}, {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a, t in zip(jaxpr.invars, args, arg_tags):
        env[v] = a
        if t is not None:
            tags[v] = t
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        in_tags = [None if isinstance(v, Literal) else tags.get(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if name in _CALLS and inner is not None:
            outs, out_tags = _run(inner, invals, in_tags, record), [None] * len(eqn.outvars)
        elif name in _LOOPS:
            outs, out_tags = _LOOPS[name](eqn, invals, in_tags, record), [None] * len(eqn.outvars)
        else:
            if name == "dot_general" and in_tags[1] is not None:
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                if tuple(rc) == (0,) and not rb and jnp.ndim(invals[1]) == 2:
                    record(in_tags[1], invals[0])
            elif name == "ragged_dot_general" and in_tags[1] is not None:
                dn = eqn.params["ragged_dot_dimension_numbers"]
                (lc, rc), (lb, rb) = dn.dot_dimension_numbers
                if (tuple(dn.lhs_ragged_dimensions) == (0,) and tuple(lc) == (1,)
                        and tuple(dn.rhs_group_dimensions) == (0,) and tuple(rc) == (1,)
                        and not lb and not rb and jnp.ndim(invals[1]) == 3):
                    record(in_tags[1], invals[0], invals[2])  # rows grouped by expert
            outs = _bind(eqn, invals)
            out_tags = [in_tags[0] if name in _PASSTHROUGH else None] * len(outs)
        for v, o, t in zip(eqn.outvars, outs, out_tags):
            env[v] = o
            if t is not None:
                tags[v] = t
    return [read(v) for v in jaxpr.outvars], [None] * len(jaxpr.outvars)


def matmul_input_stats(fn: Callable[[Any], Any], params: Any) -> dict[str, MatrixInputStats]:
    """``{leaf_path: MatrixInputStats}`` for every 2-D leaf of ``params`` used as ``x @ W``
    and every stack of experts used in a grouped matmul (run an MoE with ``dispatch="ragged"``
    to collect its experts').

    ``fn(params)`` runs the model on fixed data (close over the batch); for several
    calibration batches, pass a ``fn`` that runs them all. A matrix used several times (several
    batches, tied weights) accumulates all its inputs. Leaves never used as the right operand
    of a matmul (embeddings looked up by index, vectors) are absent.
    """
    flat, treedef = jax.tree_util.tree_flatten(params)
    paths = leaf_paths(params)
    closed = jax.make_jaxpr(lambda fl: fn(jax.tree_util.tree_unflatten(treedef, fl)))(flat)
    acc: dict[int, Any] = {}  # leaf index -> InputStats, or a list of one per expert

    def record(idx, x, group_sizes=None):
        x = jnp.asarray(x, jnp.float32)
        if group_sizes is None:
            acc[idx] = input_stats_update(acc.get(idx) or input_stats_init(x.shape[-1]), x)
            return
        sizes = np.asarray(group_sizes)
        ends = np.cumsum(sizes)
        acc[idx] = [input_stats_update(st, x[end - size:end]) for st, size, end in zip(
            acc.get(idx) or [input_stats_init(x.shape[-1]) for _ in sizes], sizes, ends)]

    _interpret(closed.jaxpr, closed.consts, flat, list(range(len(flat))), record)
    if not acc:
        raise ValueError(
            "matmul_input_stats: no `x @ W` with a 2-D parameter leaf as W was found in fn; "
            "the model must use its matrices as the right operand of a matmul."
        )
    return {paths[i]: _matrix_stats(s) for i, s in sorted(acc.items())}


def _matrix_stats(st) -> MatrixInputStats:
    """One matrix's statistics; a stack of experts' (a list of theirs) as ``[E, d_in]``
    arrays and ``[E]`` counts."""
    if isinstance(st, list):
        parts = [_matrix_stats(s) for s in st]
        return MatrixInputStats(*(np.stack([getattr(p, f) for p in parts])
                                  for f in MatrixInputStats._fields))
    return MatrixInputStats(np.asarray(input_mean_abs(st)), np.asarray(input_l2_norm(st)),
                            int(st.count), np.asarray(input_mean(st)))
