"""ReMoE baseline (Wang et al. 2024, "Fully differentiable MoE with ReLU routing").

``A = ReLU(x W_router)`` (no RMSNorm), ``y = sum_e A_e E_e(x)``, trained with an L1 penalty
``lambda * mean_t sum_e A_e`` whose coefficient follows ReMoE's controller
``lambda <- lambda * alpha^sign(S* - S_t)`` (target sparsity ``S* = 1 - k/E``; see
:func:`moejax.chunk_sparse.schedule.remoe_update`, run by ``ScheduledLM(kind="remoe_l1")``).

The experts are the same non-gated fine-grained experts as BlockFFN (the BlockFFN paper keeps
expert number and width identical across baselines), so a ReMoE slot is a :class:`BlockFFN`
with ``rmsnorm=False`` and no AL/CS terms; its ``aux["l1_loss"]`` is the unweighted L1. It is
called like every slot, ``slot(x_BTD, train=, key=, mask_BT=, segment_ids_BT=None)`` (the
segment ids only affect the AL/CS statistics it reports).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from flax import nnx

from moejax.config import ConfigError, config
from moejax.nn.blockffn import BlockFFN, BlockFFNConfig, ExpertPath
from moejax.nn.slots import FFNSlotConfig
from moejax.ops.activations import ActivationName

__all__ = ["ReMoEConfig"]


@config
class ReMoEConfig(FFNSlotConfig):
    """ReMoE slot. ``l1_coef`` is a static weight; keep 0 with the adaptive controller.
    ``l1_form``: ReMoE's ``"load_balanced"`` L1 (default) or ``"plain"``; ``l1_k``: the
    target active experts per token that normalises it (``E (1 - target sparsity)``)."""

    n_experts: int = 16
    d_expert: int = 64
    activation: ActivationName = "swish"
    path: ExpertPath = "dense"
    union_chunk: int = 32
    l1_coef: float = 0.0
    l1_form: Literal["plain", "load_balanced"] = "load_balanced"
    l1_k: float = 2.0

    def validate(self) -> None:
        try:  # the BlockFFN slot it builds checks the shared fields (sizes, union_chunk)
            self.blockffn_config()
        except ConfigError as e:
            raise ConfigError(f"ReMoEConfig: {str(e).removeprefix('BlockFFNConfig: ')}"
                              ) from None

    def blockffn_config(self) -> BlockFFNConfig:
        return BlockFFNConfig(n_experts=self.n_experts, d_expert=self.d_expert,
                              activation=self.activation, rmsnorm=False, path=self.path,
                              union_chunk=self.union_chunk, al_coef=0.0, cs_coef=0.0,
                              l1_coef=self.l1_coef, l1_form=self.l1_form, l1_k=self.l1_k)

    def build(self, d_model: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        return BlockFFN(self.blockffn_config(), d_model, rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype or jnp.float32)
