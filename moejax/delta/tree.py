"""Delta parameters on arbitrary JAX pytrees, and leaf selection by path pattern.

``Delta = theta_F - theta_P`` (DAREx paper, Sec. 3.1). Every function here works on any
pytree of arrays (nested dicts, lists, NamedTuples, ``nnx.State`` ...); nothing here
knows about moejax models.

Leaf paths are strings such as ``"layers/0/ffn/w_up"`` built from the pytree key path
(dict keys, attribute names and sequence indices joined by ``/``). Leaf selection uses
regular expressions searched (``re.search``) in those strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from moejax.pytree import count_params, leaf_paths, path_str

__all__ = [
    "path_str",
    "leaf_paths",
    "select_leaves",
    "mask_leaves",
    "delta",
    "apply_delta",
    "apply",
    "map_selected",
    "per_leaf_keys",
    "per_leaf_values",
    "count_params",
]

PyTree = Any


def _as_patterns(patterns) -> list[re.Pattern]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"select_leaves: {p!r} is not a regular expression ({e}); "
                             "patterns are searched in leaf paths such as 'blocks/0/attn/w_q'"
                             ) from None
    return out


def select_leaves(
    tree: PyTree,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    *,
    min_ndim: int = 2,
    allow_empty: bool = False,
) -> PyTree:
    """Boolean mask pytree (same structure as ``tree``): which leaves to operate on.

    A leaf is selected iff ``ndim >= min_ndim`` and its path matches at least one
    ``include`` regex (all paths if ``include`` is None) and no ``exclude`` regex.
    Example: ``select_leaves(params, include=r"(ffn|attn)/", exclude=r"embed|norm")``.
    ``min_ndim=2`` (default) keeps only matrices (and stacks of matrices). A mask that selects
    nothing is an error unless ``allow_empty``.
    """
    inc, exc = _as_patterns(include), _as_patterns(exclude)

    def choose(path, leaf) -> bool:
        s = path_str(path)
        if jnp.ndim(leaf) < min_ndim:
            return False
        if inc and not any(p.search(s) for p in inc):
            return False
        return not any(p.search(s) for p in exc)

    mask = jax.tree_util.tree_map_with_path(choose, tree)
    if not allow_empty and not any(jax.tree_util.tree_leaves(mask)):
        raise ValueError(
            f"select_leaves matched no leaf (include={include!r}, exclude={exclude!r}, "
            f"min_ndim={min_ndim}); available paths: {leaf_paths(tree)[:20]} ... "
            "Fix the regexes or lower min_ndim."
        )
    return mask


def _check_same_structure(a: PyTree, b: PyTree, what: str,
                          fix: str = "pass trees built from the same model definition") -> None:
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if ta != tb:
        raise ValueError(f"{what} ({ta} vs {tb}); {fix}.")


def mask_leaves(mask: PyTree | None, tree: PyTree, who: str) -> list:
    """``mask``'s leaves, one per leaf of ``tree`` (every leaf selected for ``None``); a mask of
    another structure is refused, since its leaves would select the wrong matrices."""
    if mask is None:
        return [True] * len(jax.tree_util.tree_leaves(tree))
    _check_same_structure(mask, tree, f"{who}: the mask's structure differs from the delta "
                          "tree's", "build it from this tree: select_leaves(delta_tree, ...)")
    return jax.tree_util.tree_leaves(mask)


def delta(pretrained: PyTree, finetuned: PyTree) -> PyTree:
    """``Delta = theta_F - theta_P`` leaf by leaf (shapes must match)."""
    _check_same_structure(pretrained, finetuned, "delta(pretrained, finetuned): the two pytrees "
                          "have different structures")

    def sub(path, p, f):
        if jnp.shape(p) != jnp.shape(f):
            raise ValueError(
                f"delta: leaf {path_str(path)!r} has shape {jnp.shape(f)} in finetuned but "
                f"{jnp.shape(p)} in pretrained; the trees must come from the same model."
            )
        return jnp.asarray(f) - jnp.asarray(p)

    return jax.tree_util.tree_map_with_path(sub, pretrained, finetuned)


def apply_delta(pretrained: PyTree, delta_tree: PyTree) -> PyTree:
    """``theta = theta_P + Delta`` leaf by leaf (shapes must match), result in the
    pre-trained dtype."""
    _check_same_structure(pretrained, delta_tree, "apply_delta(pretrained, delta): the two "
                          "pytrees have different structures")

    def add(path, p, d):
        if jnp.shape(p) != jnp.shape(d):  # a broadcast sum would change the parameter's shape
            raise ValueError(
                f"apply_delta: leaf {path_str(path)!r} has shape {jnp.shape(d)} in the delta but "
                f"{jnp.shape(p)} in pretrained; the delta must come from the same model.")
        return (jnp.asarray(p) + jnp.asarray(d)).astype(jnp.result_type(p))

    return jax.tree_util.tree_map_with_path(add, pretrained, delta_tree)


apply = apply_delta


def map_selected(fn: Callable, tree: PyTree, mask: PyTree | None, *rest: PyTree) -> PyTree:
    """``fn(leaf, *rest_leaves)`` on selected leaves; unselected leaves pass through.

    ``mask`` None selects every leaf.
    """
    if mask is None:
        return jax.tree_util.tree_map(fn, tree, *rest)
    mask_leaves(mask, tree, "map_selected")
    return jax.tree_util.tree_map(lambda x, m, *r: fn(x, *r) if m else x, tree, mask, *rest)


def per_leaf_keys(key: jax.Array, tree: PyTree) -> PyTree:
    """One independent PRNG key per leaf: ``fold_in(key, leaf_index)``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [jax.random.fold_in(key, i) for i in range(len(leaves))]
    )


def per_leaf_values(value, tree: PyTree, name: str = "value") -> list:
    """Resolve a per-leaf setting into a list aligned with ``tree``'s leaves.

    ``value`` is a scalar (same for all leaves), a ``{path: value}`` mapping (every leaf
    path of ``tree`` must be present; extra keys are an error), or a pytree with the
    same structure as ``tree`` (one value per leaf).
    """
    paths = leaf_paths(tree)
    if value is None or (not isinstance(value, (Mapping, list, tuple)) and jnp.ndim(value) == 0):
        return [value] * len(paths)
    if (
        isinstance(value, Mapping)
        and all(isinstance(k, str) for k in value)
        and not _same_structure(value, tree)
    ):
        missing = [p for p in paths if p not in value]
        extra = [k for k in value if k not in paths]
        if missing or extra:
            raise ValueError(
                f"per-leaf {name}: mapping keys must be exactly the leaf paths; missing "
                f"{missing[:10]}, unknown {extra[:10]}. Use leaf_paths(tree) to list them."
            )
        return [value[p] for p in paths]
    try:
        return jax.tree_util.tree_structure(tree).flatten_up_to(value)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"per-leaf {name}: expected a scalar, a {{path: value}} dict or a pytree with "
            f"the structure of the delta tree; got {type(value).__name__} ({e})."
        ) from e


def _same_structure(a, b) -> bool:
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
