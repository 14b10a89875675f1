"""Collect the inputs of every weight matrix of any JAX model, without hooks in the model code.

WANDA (``|Delta_ij| * ||x_j||_2``) and the analytic per-layer q (``c_ij = Delta_ij mean x_j``)
need per-input-feature statistics of the activations ``x`` that multiply each matrix ``W``
(``y = x @ W``). moejax models use their parameters as ``x @ self.w[...]``, so instead of adding
hooks we trace ``fn(params)`` to a jaxpr and interpret it eagerly: every ``dot_general`` whose
right operand is (a dtype cast of) a 2-D parameter leaf contracted over its first axis records
its left operand. Nested ``jit``/``pjit`` calls are interpreted recursively; every other
primitive is bound as in ``jax.core.eval_jaxpr``.

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
_CALLS = {"pjit", "jit", "closed_call", "core_call"}


class MatrixInputStats(NamedTuple):
    """Statistics of one matrix's input features ([d_in] each): ``mean|x_j|``, ``||x_j||_2``
    and the signed ``mean x_j``."""

    mean_abs: np.ndarray
    l2: np.ndarray
    count: int
    mean: np.ndarray | None = None


def _interpret(jaxpr, consts, args, arg_tags, record):
    """Eagerly evaluate ``jaxpr``; ``arg_tags[i]`` is the param-leaf index of input i (or None)."""
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
        if name in _CALLS and "jaxpr" in eqn.params:
            sub = eqn.params["jaxpr"]
            outs, out_tags = _interpret(sub.jaxpr, sub.consts, invals, in_tags, record)
        else:
            if name == "dot_general" and in_tags[1] is not None:
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                if tuple(rc) == (0,) and not rb and jnp.ndim(invals[1]) == 2:
                    record(in_tags[1], invals[0])
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            out_tags = [in_tags[0] if name in _PASSTHROUGH else None] * len(outs)
        for v, o, t in zip(eqn.outvars, outs, out_tags):
            env[v] = o
            if t is not None:
                tags[v] = t
    return [read(v) for v in jaxpr.outvars], [None] * len(jaxpr.outvars)


def matmul_input_stats(
    fn: Callable[[Any], Any], params: Any, batches: int | None = None
) -> dict[str, MatrixInputStats]:
    """``{leaf_path: MatrixInputStats}`` for every 2-D leaf of ``params`` used as ``x @ W``.

    ``fn(params)`` runs the model on fixed data (close over the batch); call this once per
    calibration batch and merge, or pass a ``fn`` that loops over several batches. A matrix used
    several times (e.g. tied weights) accumulates all its inputs. Leaves never used as the right
    operand of a matmul (embeddings looked up by index, vectors) are absent.
    """
    del batches
    flat, treedef = jax.tree_util.tree_flatten(params)
    paths = leaf_paths(params)
    closed = jax.make_jaxpr(lambda fl: fn(jax.tree_util.tree_unflatten(treedef, fl)))(flat)
    acc: dict[int, Any] = {}

    def record(idx, x):
        x = jnp.asarray(x, jnp.float32)
        st = acc.get(idx) or input_stats_init(x.shape[-1])
        acc[idx] = input_stats_update(st, x)

    _interpret(closed.jaxpr, closed.consts, flat, list(range(len(flat))), record)
    if not acc:
        raise ValueError(
            "matmul_input_stats: no `x @ W` with a 2-D parameter leaf as W was found in fn; "
            "the model must use its matrices as the right operand of a matmul."
        )
    return {
        paths[i]: MatrixInputStats(
            np.asarray(input_mean_abs(s)), np.asarray(input_l2_norm(s)), int(s.count),
            np.asarray(input_mean(s)),
        )
        for i, s in sorted(acc.items())
    }
