"""The MoE FFN as a drop-in NNX layer for a user's own model.

:class:`MoELayer` wraps :class:`~moejax.nn.moe.MoE` in the idioms of ``flax.nnx`` layers:

* it is built as ``MoELayer(cfg, d_model, rngs=...)``, the config first as in
  ``DecoderLM(cfg, rngs=...)``;
* ``y = layer(x_BTD)`` returns the output alone, so it replaces an MLP without changing the
  caller; the auxiliary losses and router statistics are sown as ``nnx.Intermediate``
  values (``aux_loss``, ``balance_loss``, ``z_loss``, ``load``, ``dropped_fraction``),
  collected by ``y, sown = nnx.capture(model, nnx.Intermediate)(x)`` (outside a capture
  the sowing does nothing);
* ``model.train()`` / ``model.eval()`` (or ``deterministic=`` at the call) switch the
  training-time routing (the noisy router's noise) on and off;
* its randomness comes from its own ``noise`` rng stream, forked from the ``rngs`` it was
  built with (as ``nnx.Dropout`` forks ``dropout``), so no key is passed by hand.

Inside moejax the models call :class:`~moejax.nn.moe.MoE` directly (``(y, aux)``, explicit
``train`` and ``key``), which is what the training loop's losses consume.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn.moe import MoE, MoEConfig

__all__ = ["MoELayer", "SOWN"]

SOWN = ("aux_loss", "balance_loss", "z_loss", "load", "dropped_fraction")


class MoELayer(nnx.Module):
    """A top-k MoE FFN, ``[B, T, D] -> [B, T, D]`` (module docstring)."""

    def __init__(self, cfg: MoEConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, deterministic: bool = False):
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoELayer(cfg, d_model, rngs=...): cfg must be a MoEConfig, got "
                            f"{type(cfg).__name__}")
        self.moe = MoE(cfg, d_model, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.rngs = rngs["noise"].fork()
        self.deterministic = deterministic

    def __call__(self, x_BTD: jax.Array, *, mask_BT: jax.Array | None = None,
                 deterministic: bool | None = None) -> jax.Array:
        det = self.deterministic if deterministic is None else deterministic
        key = None if det else self.rngs()
        y_BTD, aux = self.moe(x_BTD, train=not det, key=key, mask_BT=mask_BT)
        for name in SOWN:
            self.sow(nnx.Intermediate, name, aux[name], capture_noop=True)
        return y_BTD
