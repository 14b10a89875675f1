"""One transformer block (attention + FFN slot) shared by the decoder, BERT and ViT.

Parameter paths of :class:`TransformerBlock`:

* ``attn_norm`` (:mod:`moejax.nn.norms`): pre-LN: applied to the attention input;
  post-LN (BERT ``attention.output.LayerNorm``): applied after the attention residual add.
* ``attn`` (:class:`moejax.nn.attention.Attention`): ``w_q, w_k, w_v, w_o`` (+ biases).
* ``ffn_norm``: pre-LN: applied to the FFN input; post-LN (BERT ``output.LayerNorm``):
  applied after the FFN residual add.
* ``ffn``: the module built from the layer's FFN slot config (e.g. ``DenseFFN``).

pre:  ``x = x + attn(norm1(x)); x = x + ffn(norm2(x))``
post: ``x = norm1(x + attn(x)); x = norm2(x + ffn(x))``
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn.attention import Attention, KVCache
from moejax.nn.norms import make_norm
from moejax.nn.slots import FFNSlotConfig, sum_aux_losses

__all__ = ["TransformerBlock", "NormPosition", "run_blocks"]

NormPosition = Literal["pre", "post"]


class TransformerBlock(nnx.Module):
    """Attention + FFN slot with pre- or post-normalisation. Returns ``(x, slot_aux)``."""

    def __init__(self, d_model: int, *, n_heads: int, ffn_slot: FFNSlotConfig,
                 n_kv_heads: int | None = None, head_dim: int | None = None,
                 norm_position: str = "pre", norm_kind: str = "rmsnorm",
                 norm_eps: float = 1e-6, attn_bias: bool = False, causal: bool = True,
                 rope_style: str | None = None, rope_base: float = 10000.0,
                 qkv_bias: bool = False, qk_norm: str = "none",
                 attention: str = "auto", rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32):
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position={norm_position!r}; use 'pre' or 'post'")
        self.norm_position = norm_position
        norm_kw = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = make_norm(norm_kind, d_model, **norm_kw)
        self.attn = Attention(d_model, n_heads, n_kv_heads, head_dim, use_bias=attn_bias,
                              causal=causal, rope_style=rope_style, rope_base=rope_base,
                              qkv_bias=qkv_bias, qk_norm=qk_norm, norm_eps=norm_eps,
                              impl=attention, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.ffn_norm = make_norm(norm_kind, d_model, **norm_kw)
        self.ffn = ffn_slot.build(d_model, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def _slot(self, x_BTD, *, train, key, mask_BT, segment_ids_BT):
        # segment ids are passed only when given, so slots predating the segment_ids_BT
        # contract still run on unpacked batches
        kw = {} if segment_ids_BT is None else {"segment_ids_BT": segment_ids_BT}
        return self.ffn(x_BTD, train=train, key=key, mask_BT=mask_BT, **kw)

    def _forward(self, x_BTD, attend, *, train, key, mask_BT, segment_ids_BT=None):
        slot_kw = dict(train=train, key=key, mask_BT=mask_BT, segment_ids_BT=segment_ids_BT)
        if self.norm_position == "pre":
            a, extra = attend(self.attn_norm(x_BTD))
            x_BTD = x_BTD + a.astype(x_BTD.dtype)
            y, aux = self._slot(self.ffn_norm(x_BTD), **slot_kw)
            x_BTD = x_BTD + y.astype(x_BTD.dtype)
        else:
            a, extra = attend(x_BTD)
            x_BTD = self.attn_norm(x_BTD + a.astype(x_BTD.dtype))
            y, aux = self._slot(x_BTD, **slot_kw)
            x_BTD = self.ffn_norm(x_BTD + y.astype(x_BTD.dtype))
        return x_BTD, aux, extra

    def __call__(self, x_BTD: jax.Array, *, train: bool = False, key: jax.Array | None = None,
                 positions_BT: jax.Array | None = None, mask_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None):
        """Full-sequence block. ``mask_BT``: real tokens (keys masked in attention; passed to
        the slot so its statistics ignore padding). ``segment_ids_BT``: document ids of a
        packed row (attention stays within a document; passed to the slot for its
        document-aware losses)."""
        def attend(h):
            return self.attn(h, positions_BT=positions_BT, mask_BT=mask_BT,
                             segment_ids_BT=segment_ids_BT), None
        x_BTD, aux, _ = self._forward(x_BTD, attend, train=train, key=key, mask_BT=mask_BT,
                                      segment_ids_BT=segment_ids_BT)
        return x_BTD, aux

    def decode(self, x_BTD: jax.Array, cache: KVCache, *, positions_BT=None,
               mask_BT=None) -> tuple[jax.Array, dict, KVCache]:
        """Cached (incremental) block for causal decoding; inference mode, no key."""
        def attend(h):
            return self.attn.decode(h, cache, positions_BT)
        return self._forward(x_BTD, attend, train=False, key=None, mask_BT=mask_BT)


def run_blocks(blocks, x_BTD: jax.Array, *, train: bool = False, key: jax.Array | None = None,
               positions_BT: jax.Array | None = None, mask_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None, remat: bool = False):
    """Apply ``blocks`` in order; ``key`` (if given) is split into one key per block.
    ``segment_ids_BT`` (packed documents) is forwarded to every block. ``remat``: each block
    under :func:`jax.checkpoint`, so a gradient keeps only the blocks' inputs and recomputes
    one block's activations at a time in the backward (same values, one more forward).

    Returns ``(x_BTD, {"aux_loss": sum of the slots' aux_loss, "layers": per-block aux})``.
    """
    n = len(blocks)
    keys = jax.random.split(key, n) if key is not None else [None] * n
    layer_aux = []
    def call(block, x_BTD, k):
        return block(x_BTD, train=train, key=k, positions_BT=positions_BT, mask_BT=mask_BT,
                     segment_ids_BT=segment_ids_BT)

    def recomputed(block, x_BTD, k):  # blocks read their variables and write none
        graphdef, state = nnx.split(block)
        return jax.checkpoint(lambda st, x, kk: call(nnx.merge(graphdef, st), x, kk))(
            state, x_BTD, k)

    step = recomputed if remat else call
    for block, k in zip(blocks, keys):
        x_BTD, aux = step(block, x_BTD, k)
        layer_aux.append(aux)
    layer_aux = tuple(layer_aux)
    return x_BTD, {"aux_loss": sum_aux_losses(layer_aux), "layers": layer_aux}
