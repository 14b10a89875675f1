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
  columns, as three bfloat16 pieces whose sum is those weights exactly (:func:`_pieces`)
  where the experts run in bfloat16, the product accumulated in float32 and the pieces'
  scores summed (the float32 router up to the order of its sums);
  any other FFN slot (MoE, DeRS) runs as the module does, after its RMSNorm;
* attention over the cache as the module's ``impl`` says (``"flash"``: tokamax's kernel on
  GPU, :mod:`moejax.kernels.flash_attention`, given the rows' filled lengths, so its loop over
  key blocks ends there), the cache written in place
  (:func:`moejax.nn.attention._write_cache`).

A block's input and its attention output's sum are each made once with their sum of squares
(:func:`_stream`), so the products read a written vector and the norm's factor, rather than
XLA recomputing the residual sums inside every product's fusion over the whole weight (on a
GPU, a written ``[D, N]`` of products per matrix-vector product).

Each product's weight is kept ``[K, N]`` (``layout="kn"``, the modules' own orientation, the
default) or transposed, ``[N, K]`` (``"nk"``). A one-row product is no GEMM: XLA's GPU compiler
runs it as a reduction over ``K``, a reduction over the weight's major dimension (a column
reduction) for ``"kn"`` and over its minor one (a row reduction, each output's weights read
contiguously) for ``"nk"``; the two lower to different kernels, so the layout is a decoding's
choice, timed on the device (the values are the same products either way).

The weights are made once per decoding (the decode loops call :func:`lean_decoder` before
their loop: :mod:`moejax.nn.sample`, :mod:`moejax.nn.speculative`, :mod:`moejax.nn.generate`),
so a token reads each weight once, as the module would. Decoding only: a :class:`LeanDecoder`
has no training forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels.chunk_union.pallas import add_residual
from moejax.nn import axes as ax
from moejax.nn.attention import Attention, KVCache
from moejax.nn.blockffn import BlockFFN, BlockRoute, block_experts
from moejax.nn.decoder import DecoderLM
from moejax.nn.ffn import DenseFFN
from moejax.nn.norms import RMSNorm, inv_rms
from moejax.ops.activations import activation_fn

__all__ = ["LeanDecoder", "LeanBlock", "LeanAttention", "LeanDenseFFN", "LeanBlockFFN",
           "lean_decoder", "LAYOUTS"]

LAYOUTS = ("kn", "nk")  # a product's weight as [K, N] (the modules') or transposed, [N, K]


def _laid(w_KN, layout: str, *axes: str) -> nnx.Param:
    """A product's weight ``[K, N]`` (an array, or a module's parameter, which ``"kn"``
    keeps as it is) as a parameter in ``layout`` (``"nk"``: a transposed copy, ``[N, K]``),
    with its logical axes in the same order."""
    if layout == "kn":
        return w_KN if isinstance(w_KN, nnx.Param) else ax.param(w_KN, *axes)
    return ax.param(jnp.asarray(w_KN[...].T), *reversed(axes))


def _matvec(x: jax.Array, w: jax.Array, layout: str, out_dtype=None) -> jax.Array:
    """``x @ W`` for ``W`` laid out as ``layout`` (:func:`_laid`): ``x [..., K]``; the product
    in ``out_dtype`` where given (accumulated in it), else in the operands' dtype."""
    dims = (((x.ndim - 1,), (0 if layout == "kn" else 1,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)


def _pieces(w, dtype) -> tuple[jax.Array, ...]:
    """float32 ``w`` as a sum of ``dtype`` arrays, exactly: itself in float32; three bfloat16
    pieces (8 significant bits each, float32's exponent range), each the rounding of what the
    ones before it leave. A product with them, accumulated in float32, is the float32
    product up to the order of its sums."""
    if jnp.dtype(dtype) == jnp.float32:
        return (w,)
    out = []
    for _ in range(3):
        out.append(w.astype(dtype))
        w = w - out[-1].astype(jnp.float32)
    return tuple(out)


def _folded(norm: RMSNorm, *ws) -> jax.Array:
    """``diag(norm.scale) [w_1 | w_2 | ...]`` in the weights' dtype (folded in float32)."""
    w = jnp.concatenate([x[...] for x in ws], axis=1)
    return (norm.scale[...].astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)


def _bias(module, names, axis: str) -> nnx.Param | None:
    present = [getattr(module, "b_" + n) for n in names if hasattr(module, "b_" + n)]
    return ax.param(jnp.concatenate([b[...] for b in present]), axis) if present else None


class LeanAttention(Attention):
    """:class:`Attention` after its RMSNorm, with q, k and v in one product (module
    docstring); takes the block's input, not its normalised input."""

    def __init__(self, attn: Attention, norm: RMSNorm,  # noqa: D107 - no Attention init
                 layout: str = "kn"):
        for name in ("impl", "n_heads", "n_kv_heads", "head_dim", "causal", "rope_style",
                     "rope_base", "use_bias", "dtype", "qk_norm"):
            setattr(self, name, getattr(attn, name))
        self.biased = tuple(n for n in attn.biased if n == "o")
        self.eps, self.layout = norm.eps, layout
        self.w_qkv = _laid(_folded(norm, attn.w_q, attn.w_k, attn.w_v), layout, ax.EMBED,
                           ax.HEADS)
        self.b_qkv = _bias(attn, ("q", "k", "v"), ax.HEADS)
        self.w_o = _laid(attn.w_o, layout, ax.HEADS, ax.EMBED)
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
        return _matvec(x, w, self.layout)

    def decode_normed(self, x_BTD, r_BT1, cache: KVCache, positions_BT=None):
        """:meth:`decode` of the block's input ``x`` given its RMS factor ``r``
        (:func:`_stream`)."""
        return self.decode_projected(self._project(x_BTD, r_BT1), cache, positions_BT)


class LeanDenseFFN(nnx.Module):
    """A :class:`DenseFFN` after its RMSNorm, gate and up in one product (module docstring);
    ``y, {} = ffn(x_BTD)`` of the block's input."""

    def __init__(self, ffn: DenseFFN, norm: RMSNorm, layout: str = "kn"):
        self.dtype, self.gated, self.eps = ffn.dtype, ffn.gated, norm.eps
        self.activation, self.d_hidden, self.layout = ffn.cfg.activation, ffn.cfg.d_hidden, layout
        ins = (ffn.w_gate, ffn.w_up) if ffn.gated else (ffn.w_up,)
        self.w_in = _laid(_folded(norm, *ins), layout, ax.EMBED, ax.MLP)
        self.b_in = _bias(ffn, ("gate", "up"), ax.MLP)
        self.w_down = _laid(ffn.w_down, layout, ax.MLP, ax.EMBED)
        self.b_down = getattr(ffn, "b_down", None)

    def __call__(self, x_BTD: jax.Array, r_BT1=None):
        dt = self.dtype or x_BTD.dtype
        r = (inv_rms(x_BTD, self.eps) if r_BT1 is None else r_BT1).astype(dt)
        h = _matvec(x_BTD.astype(dt), self.w_in[...].astype(dt), self.layout) * r
        if self.b_in is not None:
            h = h + self.b_in[...].astype(dt)
        act = activation_fn(self.activation)
        h = act(h[..., :self.d_hidden]) * h[..., self.d_hidden:] if self.gated else act(h)
        y = _matvec(h, self.w_down[...].astype(dt), self.layout)
        if self.b_down is not None:
            y = y + self.b_down[...].astype(dt)
        return y, {}

    def with_residual(self, x_BTD: jax.Array, r_BT1=None):
        """``x + ffn(x)``, the block's output, and ``{}``; ``r``: ``x``'s RMS factor, where
        it is at hand."""
        y, aux = self(x_BTD, r_BT1)
        return add_residual(x_BTD, y), aux


class LeanBlockFFN(nnx.Module):
    """A :class:`~moejax.nn.blockffn.BlockFFN` after its RMSNorm with the norm's scale folded
    into the router and the experts' input weights (module docstring); ``y, {} = ffn(x_BTD)``
    of the block's input."""

    def __init__(self, ffn: BlockFFN, norm: RMSNorm, layout: str = "kn"):
        self.cfg, self.dtype, self.eps, self.layout = ffn.cfg, ffn.dtype, norm.eps, layout
        s_D = norm.scale[...].astype(jnp.float32)
        w_router_DE = s_D[:, None] * ffn.router.w[...].astype(jnp.float32)
        self.router_norm = ffn.router_norm if ffn.cfg.rmsnorm else None
        w_up, w_down, w_gate = ffn.experts.weights()
        fold = lambda w: (s_D[None, :, None] * w.astype(jnp.float32)).astype(w.dtype)  # noqa: E731
        dt = jnp.dtype(ffn.dtype or w_up.dtype)
        # on the dense path, the router's product joins the experts' input product where its
        # weights are an exact sum of that product's dtype (_pieces)
        router = (_pieces(w_router_DE, dt) if ffn.cfg.path == "dense"
                  and dt in (jnp.float32, jnp.bfloat16) else ())
        self.n_pieces = len(router)
        if not router:
            self.w_router = _laid(w_router_DE, layout, ax.EMBED, ax.SCORES)
        if ffn.cfg.path == "dense":  # every expert: one product in, one out ([D, E F], [E F, D])
            E, D, F = w_up.shape
            flat = lambda w: fold(w).transpose(1, 0, 2).reshape(D, E * F).astype(dt)  # noqa: E731
            ins = (w_up,) if w_gate is None else (w_gate, w_up)
            self.w_in = _laid(jnp.concatenate([flat(w) for w in ins] + list(router), axis=1),
                              layout, ax.EMBED, ax.MLP)
            self.w_out = _laid(w_down.reshape(E * F, D), layout, ax.MLP, ax.EMBED)
            return
        up = (ax.EXPERTS, ax.EMBED, ax.MLP)
        self.w_up = ax.param(fold(w_up), *up)
        self.w_down = ax.param(w_down, ax.EXPERTS, ax.MLP, ax.EMBED)
        self.w_gate = None if w_gate is None else ax.param(fold(w_gate), *up)

    def __call__(self, x_BTD: jax.Array, r_BT1=None):
        return self._experts(x_BTD, r_BT1, residual=False), {}

    def with_residual(self, x_BTD: jax.Array, r_BT1=None):
        """``x + ffn(x)``, the block's output, and ``{}``: the residual goes to the expert
        part, whose GPU decode kernel sums into it (no zeroed output, no add after it)."""
        return self._experts(x_BTD, r_BT1, residual=True), {}

    def _experts(self, x_BTD: jax.Array, r_BT1, residual: bool):
        B, T, D = x_BTD.shape
        dt = self.dtype or x_BTD.dtype
        x_ND = x_BTD.reshape(B * T, D)
        r_N1 = inv_rms(x_ND, self.eps) if r_BT1 is None else r_BT1.reshape(B * T, 1)
        if self.n_pieces:  # the router's product is the experts' input product
            y_ND = self._every_expert(x_ND.astype(dt), r_N1, dt)
        else:
            x32_ND = x_ND.astype(jnp.float32)
            route = self._route(_matvec(x32_ND, self.w_router[...], self.layout) * r_N1)
            if self.cfg.path != "dense":
                xe_ND = (x32_ND * r_N1).astype(dt)
                w_gate = None if self.w_gate is None else self.w_gate[...]
                y_ND, _ = block_experts(self.cfg, xe_ND, route, self.w_up[...],
                                        self.w_down[...], w_gate, x_ND if residual else None)
                return y_ND.reshape(B, T, D)
            y_ND = self._every_expert(x_ND.astype(dt), r_N1, dt, route.a)
        return (y_ND if not residual else add_residual(x_ND, y_ND)).reshape(B, T, D)

    def _route(self, a0_NE) -> BlockRoute:
        a1 = jax.nn.relu(a0_NE)
        return BlockRoute(a0_NE, a1, a1 if self.router_norm is None else self.router_norm(a1))

    def _every_expert(self, x_ND, r_N1, dt, a_NE=None):
        """``sum_e a_e E_e(x r)`` as two products: ``[N, D] x [D, E F]``, accumulated in
        float32 and rounded to ``dt`` as the experts' own product would be, times ``r`` after
        it; the activation and each expert's weight ``a_e`` on its ``F`` columns; then
        ``[N, E F] x [E F, D]``. Without ``a_NE``, the router's scores are the in product's
        last ``P E`` columns (``[D, E F + P E]``), its ``P`` pieces summed in float32."""
        h_NH = _matvec(x_ND, self.w_in[...].astype(dt), self.layout, jnp.float32)
        if a_NE is None:
            E, P = self.cfg.n_experts, self.n_pieces
            H = h_NH.shape[1] - P * E
            a0_NE = sum(h_NH[:, H + i * E:H + (i + 1) * E] for i in range(P)) * r_N1
            h_NH, a_NE = h_NH[:, :H], self._route(a0_NE).a
        N, E = a_NE.shape
        h_NH = h_NH.astype(dt) * r_N1.astype(dt)
        act = activation_fn(self.cfg.activation)
        EF = self.w_out.shape[0 if self.layout == "kn" else 1]
        h_NH = act(h_NH) if h_NH.shape[1] == EF else act(h_NH[:, :EF]) * h_NH[:, EF:]
        g_NEF = h_NH.reshape(N, E, EF // E) * a_NE.astype(dt)[:, :, None]
        return _matvec(g_NEF.reshape(N, EF), self.w_out[...].astype(dt), self.layout)


def _stream(x_BTD, eps: float):
    """``(x, inv_rms(x))`` with ``x`` and its sum of squares made together and kept (one
    reduction, which also writes ``x``): the products read the written stream, rather than
    recomputing its sums inside each product's fusion over the whole weight. The sum, not the
    factor, is kept, so the ``rsqrt`` joins the kernels that use it."""
    ss = jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), axis=-1, keepdims=True)
    x_BTD, ss = jax.lax.optimization_barrier((x_BTD, ss))
    return x_BTD, jax.lax.rsqrt(ss / x_BTD.shape[-1] + eps)


def _plain_rmsnorm(norm) -> bool:
    return type(norm) is RMSNorm


class LeanBlock(nnx.Module):
    """A pre-RMSNorm :class:`~moejax.nn.block.TransformerBlock`'s decode with the folded
    products (module docstring)."""

    def __init__(self, block, layout: str = "kn"):
        self.attn = LeanAttention(block.attn, block.attn_norm, layout)
        lean = {DenseFFN: LeanDenseFFN, BlockFFN: LeanBlockFFN}.get(type(block.ffn))
        if lean is not None and _plain_rmsnorm(block.ffn_norm):
            self.ffn, self.ffn_norm = lean(block.ffn, block.ffn_norm, layout), None
        else:
            self.ffn, self.ffn_norm = block.ffn, block.ffn_norm

    def decode(self, x_BTD: jax.Array, cache: KVCache, *, positions_BT=None,
               mask_BT=None) -> tuple[jax.Array, dict, KVCache]:
        x_BTD, r_BT1 = _stream(x_BTD, self.attn.eps)
        a, cache = self.attn.decode_normed(x_BTD, r_BT1, cache, positions_BT)
        x_BTD = x_BTD + a.astype(x_BTD.dtype)
        if self.ffn_norm is None:  # a lean slot: it takes the block's input, adds its own
            x_BTD, aux = self.ffn.with_residual(*_stream(x_BTD, self.ffn.eps))
            return x_BTD, aux, cache
        y, aux = self.ffn(self.ffn_norm(x_BTD), train=False, key=None, mask_BT=mask_BT)
        return add_residual(x_BTD, y), aux, cache


class LeanDecoder(DecoderLM):
    """A :class:`DecoderLM`'s ``decode`` and ``init_cache`` on :class:`LeanBlock` s; its
    embedding, final norm and head are the model's own arrays."""

    def __init__(self, model: DecoderLM, layout: str = "kn"):  # noqa: D107 - no DecoderLM init
        self.cfg, self.dtype, self.layout = model.cfg, model.dtype, layout
        self.embed, self.final_norm = model.embed, model.final_norm
        if not model.cfg.tie_embeddings:
            self.w_head = model.w_head
        self.blocks = nnx.List([LeanBlock(b, layout) for b in model.blocks])

    def __call__(self, *args, **kwargs):
        raise TypeError("a LeanDecoder decodes only (decode, init_cache); run the full "
                        "forward on the DecoderLM it was made from")


def lean_decoder(model, layout: str = "kn"):
    """``model`` with its decode step lean (:class:`LeanDecoder`, its products' weights in
    ``layout``: module docstring) where it is a pre-RMSNorm :class:`DecoderLM`; anything else
    (a lean decoder already, whatever its layout, another model kind) is returned as it is,
    so a decoding loop given a :class:`LeanDecoder` made before it keeps that one."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; a product's weight is laid out as one of "
                         f"{', '.join(map(repr, LAYOUTS))}")
    if type(model) is not DecoderLM or not all(
            b.norm_position == "pre" and _plain_rmsnorm(b.attn_norm) for b in model.blocks):
        return model
    return LeanDecoder(model, layout)
