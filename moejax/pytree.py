"""Pytree helpers shared by every layer: readable leaf paths and size counters.

Leaf paths are strings such as ``"layers/0/ffn/w_up"`` built from the ``jax.tree_util`` key
path (dict keys, attribute names and sequence indices joined by ``/``; the trailing ``value``
of an nnx Variable is dropped). Weight-decay masks, sharding rules, delta-leaf selection and
checkpoint error messages all name leaves this way.

Counters accept any pytree, including an ``nnx.Module`` (its ``nnx.Param`` leaves, or all of
its variables for :func:`count_bytes`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["path_names", "path_str", "named_leaves", "leaf_paths", "count_params",
           "count_bytes", "fmt_count"]

PyTree = Any


def path_names(path) -> tuple[str, ...]:
    """``jax.tree_util`` key path -> tuple of plain names (``.value`` of nnx Variables dropped)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:  # pragma: no cover - future key types
            out.append(str(k))
    if out and out[-1] == "value":
        out = out[:-1]
    return tuple(out)


def path_str(path) -> str:
    """``('layers', '0', 'experts', 'w_up')`` -> ``"layers/0/experts/w_up"``."""
    return "/".join(path_names(path))


def named_leaves(tree: PyTree) -> list[tuple[str, Any]]:
    """``[(path_str, leaf), ...]`` in flattening order."""
    return [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaf_paths(tree: PyTree) -> list[str]:
    """Path strings of every leaf of ``tree``, in ``jax.tree_util`` leaf order."""
    return [name for name, _ in named_leaves(tree)]


def _tree_of(obj, params_only: bool):
    if isinstance(obj, nnx.Module):
        return nnx.state(obj, nnx.Param) if params_only else nnx.state(obj)
    return obj


def count_params(tree: PyTree, mask: PyTree | None = None) -> int:
    """Scalar entries of (the ``mask``-selected leaves of) ``tree``; of a module's Params.
    ``mask``: a bool per leaf of ``tree``, in its leaf order."""
    leaves = jax.tree_util.tree_leaves(_tree_of(tree, True))
    sel = [True] * len(leaves) if mask is None else jax.tree_util.tree_leaves(mask)
    if len(sel) != len(leaves):
        raise ValueError(f"count_params: the mask has {len(sel)} leaves but the tree "
                         f"{len(leaves)}; give a bool per leaf")
    return int(sum(int(np.size(x)) for x, m in zip(leaves, sel) if m))


def count_bytes(tree: PyTree) -> int:
    """Bytes of every array leaf of ``tree`` (every variable of a module: params and buffers)."""
    leaves = jax.tree_util.tree_leaves(_tree_of(tree, False))
    return int(sum(int(np.size(x)) * np.dtype(x.dtype).itemsize for x in leaves))


def fmt_count(n: float) -> str:
    """``1234567 -> "1.23M"``, ``4096 -> "4.1K"``, ``12 -> "12"``."""
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}K"
    return str(int(n)) if float(n).is_integer() else f"{n:.3g}"
