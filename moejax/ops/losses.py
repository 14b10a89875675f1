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

__all__ = ["token_cross_entropy", "cross_entropy", "accuracy"]


def token_cross_entropy(logits, targets):
    """Per-token cross-entropy ``logsumexp(logits) - logits[target]`` in float32."""
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

    An all-padding batch gives 0 (the denominator is clamped to 1), not NaN.
    """
    w = _weights(mask, targets.shape)
    ce = token_cross_entropy(logits, targets)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def accuracy(logits, targets, mask=None):
    """Mean top-1 accuracy over real tokens. Returns a float32 scalar."""
    w = _weights(mask, targets.shape)
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(hit * w) / jnp.maximum(jnp.sum(w), 1.0)
