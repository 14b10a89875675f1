"""A decoder LM whose FFN slots are top-k MoE layers (dense FFNs elsewhere).

``MoELMConfig(d_model=..., moe=MoEConfig(n_experts=8, top_k=2, ...), moe_layers="all")``: the
MoE settings are the one :class:`~moejax.nn.moe.MoEConfig` (override them as
``model.moe.dispatch=ragged`` on an experiment's command line); ``decoder_config()`` places
that slot at every layer, every other layer (layers 1, 3, ...) or none.
"""

from __future__ import annotations

from typing import Literal

from moejax.config import Config, ConfigError, config
from moejax.nn.decoder import DecoderConfig
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern
from moejax.ops.activations import ActivationName

__all__ = ["MoELMConfig"]


@config
class MoELMConfig(Config):
    """A decoder LM whose FFN slots are ``moe`` at ``moe_layers`` (dense FFNs of width
    ``d_hidden`` elsewhere)."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_hidden: int = 512  # dense FFN width
    activation: ActivationName = "swiglu"  # dense FFN activation
    moe: MoEConfig = MoEConfig(n_experts=8, top_k=2, d_expert=256)
    moe_layers: Literal["all", "every_other", "none"] = "all"
    max_seq_len: int = 1024
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (params stay fp32)
    # the attention's implementation (moejax.nn.attention): "auto" = tokamax's flash kernel
    # on GPU / TPU, XLA's on the CPU; "jax" = XLA's everywhere
    attention: Literal["auto", "flash", "jax", "einsum"] = "auto"

    def validate(self) -> None:
        try:  # the decoder this config builds must be valid too: fail at construction
            self.decoder_config()
        except ValueError as e:  # a ConfigError, or layer_pattern's refusal
            raise ConfigError(f"MoELMConfig: {e}") from None

    def decoder_config(self) -> DecoderConfig:
        dense = DenseFFNConfig(d_hidden=self.d_hidden, activation=self.activation)
        if self.moe_layers == "all":
            slots = (self.moe,) * self.n_layers
        elif self.moe_layers == "every_other":
            slots = layer_pattern(self.n_layers, dense, self.moe, every=2, offset=1)
        else:
            slots = (dense,) * self.n_layers
        return DecoderConfig(vocab_size=self.vocab_size, d_model=self.d_model,
                             n_layers=self.n_layers, n_heads=self.n_heads,
                             n_kv_heads=self.n_kv_heads, ffn_slots=slots,
                             max_seq_len=self.max_seq_len, dtype=self.dtype,
                             attention=self.attention)
