"""Readable names for pytree leaf paths (shared by weight-decay masks, sharding rules and
checkpoint error messages)."""

from __future__ import annotations

import jax

__all__ = ["path_names", "path_str", "named_leaves"]


def path_names(path) -> tuple[str, ...]:
    """``jax.tree_util`` key path -> tuple of plain names (``.value`` of nnx Variables dropped)."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(str(k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(str(k.key))
        else:  # pragma: no cover - future key types
            out.append(str(k))
    if out and out[-1] == "value":
        out = out[:-1]
    return tuple(out)


def path_str(path) -> str:
    """``('layers', '0', 'experts', 'w_up')`` -> ``"layers/0/experts/w_up"``."""
    return "/".join(path_names(path))


def named_leaves(tree) -> list[tuple[str, object]]:
    """``[(path_str, leaf), ...]`` in flattening order."""
    return [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
