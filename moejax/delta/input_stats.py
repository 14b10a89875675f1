"""Per-input-feature activation statistics for WANDA and the analytic per-layer q.

For the inputs ``x`` of one weight matrix (any leading batch/token axes, last axis =
input feature ``j``), accumulated over calibration batches::

    ||x_j||_2   = sqrt(sum_t x_tj^2)        (WANDA score |Delta_ij| * ||x_j||_2)
    mean x_j    = (1/T) sum_t x_tj          (official DAREx analytic-q statistic, signed)
    mean|x_j|   = (1/T) sum_t |x_tj|        (the pooled analytic-q variant)
    rms(x_j)    = sqrt((1/T) sum_t x_tj^2)

The caller collects ``x`` with its own forward pass (e.g. a hook / intermediate
output) and feeds it batch by batch; this module never sees a model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

__all__ = [
    "InputStats",
    "input_stats_init",
    "input_stats_update",
    "input_l2_norm",
    "input_mean_abs",
    "input_mean",
    "input_rms",
    "accumulate_input_norms",
]


class InputStats(NamedTuple):
    """Running sums over tokens: ``count`` (T), ``sum_sq`` [d], ``sum_abs`` [d], ``sum`` [d]."""

    count: jnp.ndarray
    sum_sq: jnp.ndarray
    sum_abs: jnp.ndarray
    sum: jnp.ndarray


def input_stats_init(dim: int, dtype=jnp.float32) -> InputStats:
    """Empty statistics for inputs with ``dim`` features."""
    z = jnp.zeros((dim,), dtype)
    return InputStats(jnp.zeros((), jnp.int32), z, z, z)


def input_stats_update(stats: InputStats, x_btd: jnp.ndarray) -> InputStats:
    """Add a batch of activations ``x[..., d]`` (all leading axes are tokens)."""
    d = stats.sum_sq.shape[-1]
    if x_btd.shape[-1] != d:
        raise ValueError(
            f"input_stats_update: activations have {x_btd.shape[-1]} features but the "
            f"statistics were initialised for {d}; collect the input of the right matrix."
        )
    x_td = jnp.reshape(x_btd, (-1, d)).astype(stats.sum_sq.dtype)
    return InputStats(
        stats.count + x_td.shape[0],
        stats.sum_sq + jnp.sum(x_td * x_td, axis=0),
        stats.sum_abs + jnp.sum(jnp.abs(x_td), axis=0),
        stats.sum + jnp.sum(x_td, axis=0),
    )


def input_l2_norm(stats: InputStats) -> jnp.ndarray:
    """``||x_j||_2 = sqrt(sum_t x_tj^2)`` (WANDA's input-norm statistic), shape [d]."""
    return jnp.sqrt(stats.sum_sq)


def input_mean_abs(stats: InputStats) -> jnp.ndarray:
    """``mean_t |x_tj|``, shape [d]."""
    return stats.sum_abs / jnp.maximum(stats.count, 1)


def input_mean(stats: InputStats) -> jnp.ndarray:
    """``mean_t x_tj`` (signed), shape [d]."""
    return stats.sum / jnp.maximum(stats.count, 1)


def input_rms(stats: InputStats) -> jnp.ndarray:
    """``sqrt(mean_t x_tj^2)``, shape [d]."""
    return jnp.sqrt(stats.sum_sq / jnp.maximum(stats.count, 1))


def accumulate_input_norms(batches) -> jnp.ndarray:
    """Convenience: ``||x_j||_2`` over an iterable of activation arrays ``[..., d]``."""
    stats = None
    for x in batches:
        x = jnp.asarray(x)
        stats = input_stats_init(x.shape[-1]) if stats is None else stats
        stats = input_stats_update(stats, x)
    if stats is None:
        raise ValueError("accumulate_input_norms: got no batches; pass at least one array.")
    return input_l2_norm(stats)
