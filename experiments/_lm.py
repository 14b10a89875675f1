"""Small pieces shared by the language-model experiments (not part of the library API)."""

from __future__ import annotations

from typing import Literal

from moejax.config import Config, config
from moejax.nn.decoder import DecoderConfig
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern


@config
class MoELMConfig(Config):
    """A decoder LM whose FFN slots are MoE layers at ``moe_layers`` (dense elsewhere)."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_hidden: int = 512  # dense FFN width
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 256
    activation: Literal["swiglu", "geglu", "gelu", "relu", "swish"] = "swiglu"
    dispatch: Literal["dense", "capacity", "ragged"] = "capacity"
    capacity_factor: float = 2.0
    router: Literal["softmax", "noisy"] = "softmax"
    balance_loss: Literal["none", "cv2", "switch"] = "switch"
    balance_coef: float = 0.01
    moe_layers: Literal["all", "every_other", "none"] = "all"
    max_seq_len: int = 1024
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (params stay fp32)

    def decoder_config(self) -> DecoderConfig:
        dense = DenseFFNConfig(d_hidden=self.d_hidden, activation=self.activation)
        moe = MoEConfig(
            n_experts=self.n_experts,
            top_k=self.top_k,
            d_expert=self.d_expert,
            activation=self.activation,
            router=self.router,
            dispatch=self.dispatch,
            capacity_factor=self.capacity_factor,
            balance_loss=self.balance_loss,
            balance_coef=self.balance_coef,
        )
        if self.moe_layers == "all":
            slots = (moe,) * self.n_layers
        elif self.moe_layers == "every_other":
            slots = layer_pattern(self.n_layers, dense, moe, every=2, offset=1)
        else:
            slots = (dense,) * self.n_layers
        return DecoderConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_slots=slots,
            max_seq_len=self.max_seq_len,
            dtype=self.dtype,
        )
