"""The MoE FFN as a drop-in NNX layer for a user's own model.

:class:`MoELayer` wraps :class:`~moejax.nn.moe.MoE` in the idioms of ``flax.nnx`` layers:

* it is built as ``MoELayer(cfg, d_model, rngs=...)``, the config first as in
  ``DecoderLM(cfg, rngs=...)``;
* ``y = layer(x)`` returns the output alone, so it replaces an MLP without changing the
  caller. ``x`` is ``[..., D]`` with any leading axes, as for ``nnx.Linear``: ``[B, T, D]``
  as it is, ``[N, D]`` as ``N`` rows of one token, further axes folded into the first.
  Routing (and the capacity path's drops) runs over all tokens at once, so the shape changes
  no token's output;
* the auxiliary losses and router statistics are sown as ``nnx.Intermediate`` values
  (``aux_loss``, ``balance_loss``, ``z_loss``, ``load``, ``dropped_fraction``), collected by
  ``y, sown = nnx.capture(model, nnx.Intermediate)(x)`` (outside a capture the sowing does
  nothing);
* ``model.train()`` / ``model.eval()`` (or ``deterministic=`` at the call) switch the
  training-time routing (the noisy router's noise) on and off;
* under a mesh of explicit axes (``jax.make_mesh``'s default) it runs with them automatic
  (:mod:`moejax.nn.auto_axes`), expert-parallel where ``expert_mesh_axes`` names them;
* its randomness comes from its own ``noise`` rng stream, forked from the ``rngs`` it was
  built with (as ``nnx.Dropout`` forks ``dropout``), so no key is passed by hand.

Inside moejax the models call :class:`~moejax.nn.moe.MoE` directly (``(y, aux)``, explicit
``train`` and ``key``), which is what the training loop's losses consume.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import is_integer
from moejax.nn.auto_axes import call_with_auto_axes, explicit_mesh
from moejax.nn.moe import MoE, MoEConfig

__all__ = ["MoELayer", "SOWN"]

SOWN = ("aux_loss", "balance_loss", "z_loss", "load", "dropped_fraction")


class MoELayer(nnx.Module):
    """A top-k MoE FFN, ``[..., D] -> [..., D]`` (module docstring)."""

    def __init__(self, cfg: MoEConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, deterministic: bool = False):
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoELayer(cfg, d_model, rngs=...): cfg must be a MoEConfig, got "
                            f"{type(cfg).__name__}")
        if not is_integer(d_model) or d_model < 1:
            raise ValueError(f"MoELayer: d_model={d_model!r} must be a positive int (the width "
                             "of the inputs and outputs)")
        self.moe = MoE(cfg, d_model, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.rngs = rngs["noise"].fork()
        self.deterministic = deterministic

    def __call__(self, x: jax.Array, *, mask_BT: jax.Array | None = None,
                 deterministic: bool | None = None) -> jax.Array:
        """``x [..., D]``; ``mask_BT`` (1 = real token, 0 = padding) of ``x``'s leading
        shape."""
        lead = jnp.shape(x)[:-1]
        if not lead:
            raise ValueError(f"MoELayer: input of shape {jnp.shape(x)}; it needs a leading "
                             "token axis, [..., D] (e.g. x[None] for one token)")
        if mask_BT is not None and jnp.shape(mask_BT) != lead:
            raise ValueError(f"MoELayer: mask_BT of shape {jnp.shape(mask_BT)} for input "
                             f"{jnp.shape(x)}; it must have the input's leading shape {lead}")
        if len(lead) == 1:  # N rows of one token each
            B_T = (lead[0], 1)
        else:  # [B, T] as it is; further leading axes folded into B
            B_T = (math.prod(lead[:-1]), lead[-1])
        det = self.deterministic if deterministic is None else deterministic
        key = None if det else self.rngs()
        x_BTD = x.reshape(*B_T, x.shape[-1])
        mask_BT = None if mask_BT is None else mask_BT.reshape(B_T)
        if explicit_mesh():
            y_BTD, aux = call_with_auto_axes(self.moe, _sown, x_BTD, train=not det, key=key,
                                             mask_BT=mask_BT)
        else:
            y_BTD, aux = self.moe(x_BTD, train=not det, key=key, mask_BT=mask_BT)
        for name in SOWN:
            self.sow(nnx.Intermediate, name, aux[name], capture_noop=True)
        return y_BTD.reshape(x.shape[:-1] + y_BTD.shape[-1:])


def _sown(moe: MoE, x_BTD, **kwargs):
    """The MoE's output and the statistics the layer sows."""
    y_BTD, aux = moe(x_BTD, **kwargs)
    return y_BTD, {name: aux[name] for name in SOWN}
