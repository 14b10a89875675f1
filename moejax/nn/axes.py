"""Logical axis names: what each dimension of a parameter is, as MaxText names them.

Every moejax parameter is made by :func:`param` (or :func:`named` for another variable kind)
with one name per dimension, kept as the variable's ``logical_axes`` metadata; it travels
with the variable through ``nnx.split``, the optimizer's state (whose moments mirror the
parameters) and checkpoints restored onto a template. :mod:`moejax.train.mesh` maps the names
to the mesh with one rules table (its ``RULES``), so a layer is sharded by what its
dimensions are, never by its name or shape: a new parameter without names is refused on a
mesh of more than one device.
"""

from __future__ import annotations

import jax
from flax import nnx

__all__ = ["EMBED", "VOCAB", "MLP", "HEADS", "KV_HEADS", "EXPERTS", "SCORES", "NORM", "RANK",
           "KEPT", "CLASSES", "POSITIONS", "PATCH", "FEATURES", "NAMES", "param", "named",
           "logical_axes"]

EMBED = "embed"  # the model width D
VOCAB = "vocab"  # the vocabulary (token-type vocabularies too)
MLP = "mlp"  # an FFN's hidden width F (a dense FFN's, an expert's, a shared expert's)
HEADS = "heads"  # the query heads' flattened width H x J (and the attention output's input)
KV_HEADS = "kv_heads"  # the key / value heads' flattened width G x J
EXPERTS = "experts"  # the expert axis E of stacked expert weights: expert parallelism
SCORES = "scores"  # a router's output, one score per expert (not expert-parallel)
NORM = "norm"  # a norm's scale or bias
RANK = "rank"  # a low-rank factor's inner dimension (DeRS-LM)
KEPT = "kept"  # the values a sparse increment keeps (DeRS-SM)
CLASSES = "classes"  # a classifier's outputs
POSITIONS = "positions"  # learned position embeddings' positions
PATCH = "patch"  # a flattened image patch's pixels
FEATURES = "features"  # a substrate's input features

NAMES = frozenset({EMBED, VOCAB, MLP, HEADS, KV_HEADS, EXPERTS, SCORES, NORM, RANK, KEPT,
                   CLASSES, POSITIONS, PATCH, FEATURES})


def named(kind: type[nnx.Variable], value: jax.Array, *names: str) -> nnx.Variable:
    """``kind(value)`` carrying ``names`` (one per dimension of ``value``, from
    :data:`NAMES`) as its ``logical_axes``."""
    ndim = len(getattr(value, "shape", ()))
    if len(names) != ndim or not set(names) <= NAMES:
        raise ValueError(f"logical axes {names} for a value of shape "
                         f"{tuple(getattr(value, 'shape', ()))}: give one name per "
                         f"dimension from {sorted(NAMES)}")
    return kind(value, logical_axes=tuple(names))


def param(value: jax.Array, *names: str) -> nnx.Param:
    """An ``nnx.Param`` of ``value`` with its logical axis names (:func:`named`)."""
    return named(nnx.Param, value, *names)


def logical_axes(variable) -> tuple[str, ...] | None:
    """The logical axis names ``variable`` was made with, else None."""
    if not isinstance(variable, nnx.Variable):
        return None
    return variable.get_metadata().get("logical_axes")
