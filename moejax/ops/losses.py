"""Token-level losses and metrics (pure functions).

* :func:`cross_entropy` -- masked mean token cross-entropy; the log-sum-exp runs in float32 even
  when the logits are bfloat16.
* :func:`accuracy` -- masked mean top-1 accuracy.

Shapes: ``logits_BTV`` ``[batch, time, vocab]``, ``targets_BT`` int ``[batch, time]``,
``mask_BT`` ``[batch, time]`` (1 = real token, 0 = padding; bool or float). Any leading shape
works as long as the last axis of the logits is the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["token_cross_entropy", "cross_entropy", "accuracy", "check_mask"]


def check_mask(fn: str, mask, shape, what: str = "a mask") -> None:
    """Refuse (at trace time: shapes are static) a ``mask`` (or another per-position array,
    named by ``what``) that is not one entry per position of ``shape``: broadcast, a
    ``[B, 1]`` or ``[T]`` mask would weight every position and divide by the wrong count,
    silently."""
    if mask is not None and tuple(jnp.shape(mask)) != tuple(shape):
        raise ValueError(f"{fn}: {what} of shape {tuple(jnp.shape(mask))} for positions of "
                         f"shape {tuple(shape)}; give one entry per position")


def _check_targets(fn: str, logits, targets, mask) -> None:
    if not jnp.issubdtype(targets.dtype, jnp.integer):  # a float would be truncated to an id
        raise ValueError(f"{fn}: targets of dtype {targets.dtype}; give integer class or token "
                         "ids (one-hot or soft labels: optax.softmax_cross_entropy)")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{fn}: targets of shape {tuple(targets.shape)} for logits of shape "
                         f"{tuple(logits.shape)}; give one target per position (the logits' "
                         "shape without the vocabulary axis)")
    check_mask(fn, mask, targets.shape)


def token_cross_entropy(logits, targets):
    """Per-token cross-entropy ``logsumexp(logits) - logits[target]`` in float32."""
    _check_targets("token_cross_entropy", logits, targets, None)
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked


def _weights(mask, shape):
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    return mask.astype(jnp.float32)


def cross_entropy(logits, targets, mask=None):
    """Mean cross-entropy over real tokens (``mask`` > 0). Returns a float32 scalar.

    An all-padding batch gives 0 (the denominator is clamped to 1), not NaN. ``targets`` and
    ``mask`` must have the logits' shape without the vocabulary axis.
    """
    ce = token_cross_entropy(logits, targets)  # checks the targets
    check_mask("cross_entropy", mask, targets.shape)
    w = _weights(mask, targets.shape)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def accuracy(logits, targets, mask=None):
    """Mean top-1 accuracy over real tokens. Returns a float32 scalar."""
    _check_targets("accuracy", logits, targets, mask)
    w = _weights(mask, targets.shape)
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(hit * w) / jnp.maximum(jnp.sum(w), 1.0)
