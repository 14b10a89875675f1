"""Dense feed-forward network: the default FFN slot.

Parameter paths of :class:`DenseFFN` (``[in, out]`` matrices; names are relied on by the
dense-to-MoE upcycling code, keep them):

* ``w_gate`` ``[D, d_hidden]`` (gated activations only: swiglu, geglu)
* ``w_up`` ``[D, d_hidden]``
* ``w_down`` ``[d_hidden, D]``
* with ``use_bias``: ``b_gate`` ``[d_hidden]`` (gated only), ``b_up`` ``[d_hidden]``,
  ``b_down`` ``[D]``

Gated: ``y = (act(x w_gate + b_gate) * (x w_up + b_up)) w_down + b_down``;
non-gated: ``y = act(x w_up + b_up) w_down + b_down``. Returns ``(y_BTD, {})``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import config
from moejax.nn import axes as ax
from moejax.nn.slots import FFNSlotConfig
from moejax.ops.activations import ActivationName, activation_fn, is_gated

__all__ = ["DenseFFNConfig", "DenseFFN"]


@config
class DenseFFNConfig(FFNSlotConfig):
    """Dense FFN slot: hidden width, activation name, optional biases (BERT/ViT)."""

    d_hidden: int
    activation: ActivationName
    use_bias: bool = False

    def validate(self) -> None:
        self._require(self.d_hidden > 0, f"d_hidden={self.d_hidden} must be > 0")

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return DenseFFN(self, d_model, rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype or jnp.float32)


class DenseFFN(nnx.Module):
    """``y, {} = ffn(x_BTD, train=..., key=..., mask_BT=..., segment_ids_BT=...)``
    (train/key/mask/segment ids unused)."""

    def __init__(self, cfg: DenseFFNConfig, d_model: int, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        self.cfg, self.dtype = cfg, dtype
        self.gated = is_gated(cfg.activation)
        D, F = d_model, cfg.d_hidden

        def dense(shape, *names):
            return ax.param(jax.random.normal(rngs.params(), shape, param_dtype)
                            * (shape[0] ** -0.5), *names)

        if self.gated:
            self.w_gate = dense((D, F), ax.EMBED, ax.MLP)
        self.w_up = dense((D, F), ax.EMBED, ax.MLP)
        self.w_down = dense((F, D), ax.MLP, ax.EMBED)
        if cfg.use_bias:
            if self.gated:
                self.b_gate = ax.param(jnp.zeros((F,), param_dtype), ax.MLP)
            self.b_up = ax.param(jnp.zeros((F,), param_dtype), ax.MLP)
            self.b_down = ax.param(jnp.zeros((D,), param_dtype), ax.EMBED)

    def hidden(self, x_BTD: jax.Array) -> jax.Array:
        """The hidden activations ``act(x w_up + b_up)`` (gated: ``act(x w_gate + b_gate) *
        (x w_up + b_up)``), ``[..., d_hidden]``: what expert extraction clusters."""
        dt = self.dtype or x_BTD.dtype
        x = x_BTD.astype(dt)
        act = activation_fn(self.cfg.activation)
        up = x @ self.w_up[...].astype(dt)
        if self.cfg.use_bias:
            up = up + self.b_up[...].astype(dt)
        if not self.gated:
            return act(up)
        gate = x @ self.w_gate[...].astype(dt)
        if self.cfg.use_bias:
            gate = gate + self.b_gate[...].astype(dt)
        return act(gate) * up

    def __call__(self, x_BTD: jax.Array, *, train: bool = False, key=None, mask_BT=None,
                 segment_ids_BT=None):
        del train, key, mask_BT, segment_ids_BT
        h = self.hidden(x_BTD)
        y = h @ self.w_down[...].astype(h.dtype)
        if self.cfg.use_bias:
            y = y + self.b_down[...].astype(h.dtype)
        return y, {}
