"""A decoder's decode step with fewer, larger products: weights prepared once per decoding.

:func:`lean_decoder` returns a :class:`LeanDecoder`, the same :class:`DecoderLM` for
``decode`` and ``init_cache`` (equal logits and caches, up to float rounding), whose blocks
(:class:`LeanBlock`) run

* q, k and v as one product of ``w_qkv = diag(s_attn) [w_q | w_k | w_v]`` ``[D, (H+2G)J]``:
  the attention RMSNorm's learned scale ``s_attn`` folded into the weights, its per-token
  ``rsqrt(mean(x^2) + eps)`` applied to the product (exact: a per-row scalar commutes with
  the product), biases added after it;
* a dense FFN's gate and up as one product of ``w_in = diag(s_ffn) [w_gate | w_up]``
  ``[D, 2F]``, the same way;
* a BlockFFN slot's router as one product of the block's input with ``diag(s_ffn) w_router``,
  times the per-token rsqrt (the router no longer waits for the norm: its product and the
  norm's reduction read ``x`` side by side), and its experts' input weights
  ``diag(s_ffn) W_up^(e)`` (and ``W_gate^(e)``), so the experts take ``x`` times that rsqrt;
  the expert part is the module's (:func:`moejax.nn.blockffn.block_experts`: on a GPU the
  chunk-union decode kernel, which sums the experts' output into the block's residual, so
  the block's residual add is the kernel's and its float32 output needs no zeroing), except
  on ``path="dense"``, where every expert runs as two products, ``[D, E F]`` in (the
  experts' input weights side by side, gate then up) and ``[E F, D]`` out, each expert's
  ``F`` activations weighted by its ``a_e`` between them (``sum_e a_e E_e(x)`` with the
  weighting moved inside the linear down product), not as ``E`` products of one row each,
  and the router's product is part of the in product: its float32 weights appended as
  columns, as three bfloat16 pieces whose sum is those weights exactly
  (:func:`moejax.nn.lean_ops.pieces`) where the experts run in bfloat16, the product
  accumulated in float32 and the pieces' scores summed (the float32 router up to the order of
  its sums);
  any other FFN slot (MoE, DeRS) runs as the module does, after its RMSNorm;
* attention over the cache as the module's ``impl`` says (``"flash"``: tokamax's kernel on
  GPU, :mod:`moejax.kernels.flash_attention`, given the rows' filled lengths, so its loop over
  key blocks ends there), the cache written in place
  (:func:`moejax.nn.attention._write_cache`).

A block's input and its attention output's sum are each made once with their sum of squares
(:func:`moejax.nn.lean_ops.stream`), so the products read a written vector and the norm's
factor, rather than XLA recomputing the residual sums inside every product's fusion over the
whole weight (on a GPU, a written ``[D, N]`` of products per matrix-vector product).

Each product's weight is kept ``[K, N]`` (``layout="kn"``, the modules' own orientation, the
default) or transposed, ``[N, K]`` (``"nk"``). A one-row product is no GEMM: XLA's GPU compiler
runs it as a reduction over ``K``, a reduction over the weight's major dimension (a column
reduction) for ``"kn"`` and over its minor one (a row reduction, each output's weights read
contiguously) for ``"nk"``; the two lower to different kernels, so the layout is a decoding's
choice, timed on the device (the values are the same products either way).

``fused=True`` (a decoding's choice, timed on the device): where a step decodes a few new
tokens (a decoded token per cache row, up to :data:`moejax.kernels.decode_ffn.MAX_ROWS` token
rows in all: a speculative round's verified block too) and the program is built for a GPU,
each block runs as five kernels, two of them its own Pallas kernels:

1. the attention input (:func:`moejax.kernels.decode_qkv.fused_qkv`): the previous block's
   residual add (a block's output is passed on as a :class:`Residual`, ``x`` and ``y`` not
   yet summed, and the decoder's head sums the last one), the norm's factor, the q, k and v
   product, RoPE and both cache writes;
2. the flash kernel over the cache; 3. the o product;
4. the FFN input (:func:`moejax.kernels.decode_ffn.fused_ffn_in`): the residual add, the
   norm's factor, the in product (a BlockFFN dense path's with its router's pieces, its ReLU
   and RMSNorm) and the activation, weighted by each expert's ``a_e``;
5. the down product.

On BlockFFN's token-sparse path, 4. and 5. are the FFN input
(:func:`moejax.kernels.decode_route.fused_route`: the residual add, the norm's factor, the
router's float32 product with its ReLU and RMSNorm, the experts' input and a zeroed float32
target) and the chunk-union decode kernel summing the members' output into that target; the
block's output is the stream and that float32 sum (a :class:`Residual`, added by the next
block's kernel, rounding once), for a decoded token and a verified block alike (up to
:data:`moejax.kernels.decode_route.MAX_TOKENS` token rows).

The kernels round as XLA's GPU fusions do (bfloat16 results of the same float32 values), so a
fused decoding equals the XLA step's up to the products' order of sums. Elsewhere (the CPU),
for other calls (a prefill of more rows, q/k norms, an FFN the kernel does not take: see each
kernel's ``supports``; the attention kernel takes up to
:data:`moejax.kernels.decode_qkv.MAX_TOKENS` new tokens per cache row, and the FFN's XLA
step may follow it) the step is XLA's; ``fused="interpret"`` runs the kernels in Pallas's
interpreter on any platform (tests).

The weights are made once per decoding (the decode loops call :func:`lean_decoder` before
their loop: :mod:`moejax.nn.sample`, :mod:`moejax.nn.speculative`, :mod:`moejax.nn.generate`),
so a token reads each weight once, as the module would. Decoding only: a :class:`LeanDecoder`
has no training forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels import decode_qkv
from moejax.kernels.chunk_union.pallas import add_residual
from moejax.nn import axes as ax
from moejax.nn.attention import Attention, KVCache, _write_cache
from moejax.nn.blockffn import BlockFFN
from moejax.nn.decoder import DecoderLM
from moejax.nn.ffn import DenseFFN
from moejax.nn.lean_ffn import LeanBlockFFN, LeanDenseFFN
from moejax.nn.lean_ops import (
    FUSED,
    LAYOUTS,
    Residual,
    bias_of,
    folded,
    laid,
    matvec,
    on_gpu,
    stream,
)
from moejax.nn.norms import RMSNorm, inv_rms

__all__ = ["LeanDecoder", "LeanBlock", "Residual", "LeanAttention", "LeanDenseFFN",
           "LeanBlockFFN", "lean_decoder", "LAYOUTS", "FUSED"]


class LeanAttention(Attention):
    """:class:`Attention` after its RMSNorm, with q, k and v in one product (module
    docstring); takes the block's input, not its normalised input."""

    def __init__(self, attn: Attention, norm: RMSNorm,  # noqa: D107 - no Attention init
                 layout: str = "kn", fused: bool = False):
        for name in ("impl", "n_heads", "n_kv_heads", "head_dim", "causal", "rope_style",
                     "rope_base", "use_bias", "dtype", "qk_norm"):
            setattr(self, name, getattr(attn, name))
        self.biased = tuple(n for n in attn.biased if n == "o")
        self.eps, self.layout, self.fused = norm.eps, layout, fused
        self.w_qkv = laid(folded(norm, attn.w_q, attn.w_k, attn.w_v), layout, ax.EMBED,
                          ax.HEADS)
        self.b_qkv = bias_of(attn, ("q", "k", "v"), ax.HEADS)
        self.w_o = laid(attn.w_o, layout, ax.HEADS, ax.EMBED)
        if "o" in attn.biased:
            self.b_o = attn.b_o
        if attn.qk_norm != "none":
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    def _project(self, x_BTD, r_BT1=None):
        dt = self.dtype or x_BTD.dtype
        r = (inv_rms(x_BTD, self.eps) if r_BT1 is None else r_BT1).astype(dt)
        y = self._matmul(x_BTD.astype(dt), self.w_qkv[...].astype(dt)) * r
        if self.b_qkv is not None:
            y = y + self.b_qkv[...].astype(dt)
        qj, kj = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return y[..., :qj], y[..., qj:qj + kj], y[..., qj + kj:]

    def _matmul(self, x, w):
        return matvec(x, w, self.layout)

    def decode_normed(self, x_BTD, r_BT1, cache: KVCache, positions_BT=None):
        """:meth:`decode` of the block's input ``x`` given its RMS factor ``r``
        (:func:`moejax.nn.lean_ops.stream`)."""
        return self.decode_projected(self._project(x_BTD, r_BT1), cache, positions_BT)

    def fusable(self, x_BTD) -> bool:
        """Whether :meth:`decode_fused` takes the block input ``x`` (an array or a
        :class:`Residual`): ``fused`` asked for, 1 to
        :data:`moejax.kernels.decode_qkv.MAX_TOKENS` new tokens per row, and a call
        :func:`moejax.kernels.decode_qkv.supports`, without q/k norms."""
        x_BTD = x_BTD.x if isinstance(x_BTD, Residual) else x_BTD
        return (bool(self.fused) and self.qk_norm == "none"
                and self.w_qkv[...].dtype == x_BTD.dtype == (self.dtype or x_BTD.dtype)
                and decode_qkv.supports(x_BTD.shape[-1], self.head_dim, self.rope_style,
                                        x_BTD.shape[1], self.dtype or x_BTD.dtype) is None)

    def decode_fused(self, x_BTD, cache: KVCache, positions_BT=None):
        """``(out, x, cache)``: :meth:`decode` of a few new tokens per row (:meth:`fusable`)
        and the block's input ``x`` (an array, or a :class:`Residual` summed here), before its
        norm: on a GPU the residual add, the norm's factor, the q, k and v product, RoPE and
        the cache writes are one kernel (:func:`moejax.kernels.decode_qkv.fused_qkv`);
        elsewhere the XLA step."""
        x_BTD, y_BTD = (x_BTD.x, x_BTD.y) if isinstance(x_BTD, Residual) else (x_BTD, None)
        B, T, D = x_BTD.shape
        start_B = cache.lengths_B
        slot_BT = start_B[:, None] + jnp.arange(T, dtype=start_B.dtype)[None, :]
        pos_BT = slot_BT if positions_BT is None else positions_BT
        b = None if self.b_qkv is None else self.b_qkv[...].astype(x_BTD.dtype)  # as XLA's adds

        def kernel(x, y, w, k, v, slot, pos):
            out = decode_qkv.fused_qkv(
                x.reshape(B * T, D), w, b, k, v, pos.reshape(-1), slot.reshape(-1),
                n_heads=self.n_heads, eps=self.eps,
                rope_base=None if self.rope_style is None else self.rope_base,
                layout=self.layout, y_ND=None if y is None else y.reshape(B * T, D),
                interpret=self.fused == "interpret")
            q = out[0].reshape(B, T, self.n_heads, self.head_dim)
            return q, out[1], out[2], x if y is None else out[3].reshape(B, T, D)

        def xla(x, y, w, k, v, slot, pos):
            x = Residual(x, y).summed() if y is not None else x
            q, k_new, v_new = self._heads(*self._project(x), pos)
            return q, _write_cache(k, k_new, slot[:, 0]), _write_cache(v, v_new, slot[:, 0]), x

        q, k, v, x_BTD = on_gpu(self.fused, kernel, xla, x_BTD, y_BTD, self.w_qkv[...],
                                cache.k_BSGJ, cache.v_BSGJ, slot_BT, pos_BT)
        out, cache = self.attend_cache(q, k, v, start_B)
        return out, x_BTD, cache


def _plain_rmsnorm(norm) -> bool:
    return type(norm) is RMSNorm


class LeanBlock(nnx.Module):
    """A pre-RMSNorm :class:`~moejax.nn.block.TransformerBlock`'s decode with the folded
    products (module docstring)."""

    def __init__(self, block, layout: str = "kn", fused: bool = False):
        self.attn = LeanAttention(block.attn, block.attn_norm, layout, fused)
        lean = {DenseFFN: LeanDenseFFN, BlockFFN: LeanBlockFFN}.get(type(block.ffn))
        if lean is not None and _plain_rmsnorm(block.ffn_norm):
            self.ffn, self.ffn_norm = lean(block.ffn, block.ffn_norm, layout), None
        else:
            self.ffn, self.ffn_norm = block.ffn, block.ffn_norm

    def decode(self, x_BTD, cache: KVCache, *, positions_BT=None,
               mask_BT=None) -> tuple[jax.Array | Residual, dict, KVCache]:
        """:meth:`TransformerBlock.decode`; ``x`` an array or a :class:`Residual`. A step whose
        attention input is fused (:meth:`LeanAttention.fusable`) hands a lean FFN the
        residual and the attention's output (its ``decode_fused``), which returns the block's
        output as a :class:`Residual` where the FFN's output is a plain product (the next
        block's kernel, or the decoder's head, makes the add)."""
        if self.attn.fusable(x_BTD):
            a, x_BTD, cache = self.attn.decode_fused(x_BTD, cache, positions_BT)
            fused = True
        else:
            if isinstance(x_BTD, Residual):
                x_BTD = x_BTD.summed()
            x_BTD, r_BT1 = stream(x_BTD, self.attn.eps)
            a, cache = self.attn.decode_normed(x_BTD, r_BT1, cache, positions_BT)
            fused = False
        if fused and self.ffn_norm is None:
            return self.ffn.decode_fused(x_BTD, a.astype(x_BTD.dtype), self.attn.fused), {}, cache
        x_BTD = x_BTD + a.astype(x_BTD.dtype)
        if self.ffn_norm is None:  # a lean slot: it takes the block's input, adds its own
            x_BTD, aux = self.ffn.with_residual(*stream(x_BTD, self.ffn.eps))
            return x_BTD, aux, cache
        y, aux = self.ffn(self.ffn_norm(x_BTD), train=False, key=None, mask_BT=mask_BT)
        return add_residual(x_BTD, y), aux, cache


class LeanDecoder(DecoderLM):
    """A :class:`DecoderLM`'s ``decode`` and ``init_cache`` on :class:`LeanBlock` s; its
    embedding, final norm and head are the model's own arrays."""

    def __init__(self, model: DecoderLM, layout: str = "kn",  # noqa: D107 - no DecoderLM init
                 fused: bool = False):
        self.cfg, self.dtype, self.layout, self.fused = model.cfg, model.dtype, layout, fused
        self.embed, self.final_norm = model.embed, model.final_norm
        if not model.cfg.tie_embeddings:
            self.w_head = model.w_head
        self.blocks = nnx.List([LeanBlock(b, layout, fused) for b in model.blocks])

    def _head(self, h_BTD):
        return super()._head(h_BTD.summed() if isinstance(h_BTD, Residual) else h_BTD)

    def __call__(self, *args, **kwargs):
        raise TypeError("a LeanDecoder decodes only (decode, init_cache); run the full "
                        "forward on the DecoderLM it was made from")


def lean_decoder(model, layout: str = "kn", fused: bool = False):
    """``model`` with its decode step lean (:class:`LeanDecoder`, its products' weights in
    ``layout``, its decode steps' kernels as ``fused`` says: module docstring) where it is
    a pre-RMSNorm :class:`DecoderLM`; anything else
    (a lean decoder already, whatever its layout, another model kind) is returned as it is,
    so a decoding loop given a :class:`LeanDecoder` made before it keeps that one."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; a product's weight is laid out as one of "
                         f"{', '.join(map(repr, LAYOUTS))}")
    if fused not in FUSED:
        raise ValueError(f"fused={fused!r}; give one of {', '.join(map(repr, FUSED))}")
    if type(model) is not DecoderLM or not all(
            b.norm_position == "pre" and _plain_rmsnorm(b.attn_norm) for b in model.blocks):
        return model
    return LeanDecoder(model, layout, fused)
