"""A decode step's BlockFFN input on the token-sparse path in one GPU launch: the attention's
residual add, the FFN norm's factor, the router's float32 scores, their ReLU and RMSNorm, the
experts' normalised input and the zeroed float32 output the chunk-union decode kernel sums
into (a Pallas Triton kernel).

On the chunk-union path the lean decode step (:class:`moejax.nn.lean_ffn.LeanBlockFFN`) runs
BlockFFN's router (:mod:`moejax.nn.blockffn`: ``A_0 = x W_r``, ``A_1 = ReLU(A_0)``,
``A = RMSNorm(A_1)``) on the FFN norm's input with the norm's scale folded into ``W_r`` and
its per-token factor ``r`` applied after the product, then hands the experts ``x r`` (the
norm's scale is in their input weights) and the combine weights ``A``; the decode
kernel (:mod:`moejax.kernels.chunk_union.decode_gpu`) sums the members' output into a float32
target. On a GPU, the stream with its sum of squares, the router's product, the router norm's
reduction, the experts' input and the target are five kernels before it. Here one program per
token row

1. reads the row's residual ``x`` and the attention's output ``o`` and makes the stream
   ``s = x + o`` (rounded to the operands' dtype, as the residual add rounds) and its factor
   ``r = rsqrt(mean(s^2) + eps)`` in float32;
2. computes the router's scores ``a_0 = r (s W_r)`` (float32 weights and accumulation, over
   the model width in steps, every expert at once), ``a_1 = relu(a_0)`` and, with a router
   norm, ``a = RMSNorm(a_1)`` in the norm's output dtype;
3. stores the experts' input ``(s r)`` in the operands' dtype, ``a``, ``a_1`` in float32,
   the stream ``s`` (the block's residual, which the next block's kernel adds the experts'
   float32 output to, rounding once: :class:`moejax.nn.lean_ops.Residual`) and zeros in
   float32, the target the decode kernel's reduce-adds sum into.

The router's ``D x E`` float32 weights are read by every row's program (from the L2 after the
first); the rows are a decoded token or a verified block of at most :data:`MAX_TOKENS`.
``W_r`` in ``[D, E]`` (``"kn"``) or transposed (``"nk"``) layout; ``interpret=True`` runs the
kernel in Pallas's interpreter (the tests). :func:`supports` says which calls it takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moejax.kernels.decode_ffn import Router
from moejax.kernels.decode_rows import (
    BLOCK_K,
    block_of,
    compiler_params,
    row_product,
    unsupported,
)

__all__ = ["MAX_TOKENS", "supports", "fused_route"]

MAX_TOKENS = 64  # token rows: what the chunk-union decode kernel takes as one chunk


def supports(d: int, n_experts: int, tokens: int, dtype) -> str | None:
    """None when :func:`fused_route` takes the call, else why not: 1 to :data:`MAX_TOKENS`
    token rows, the model width divisible by a power of two of at least 16, a power-of-two
    number of experts, float32 or bfloat16 operands."""
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} token rows (the kernel takes 1 to {MAX_TOKENS})"
    return unsupported(d, dtype, n_experts)


def _kernel(*refs, block_k, eps, layout, dtype, router):
    refs = list(refs)
    x_ref, o_ref, w_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    s_ref = refs.pop(0) if router.norm_scale else None
    xe_ref, a_ref, a1_ref, s_out_ref, y_ref = refs
    row = pl.program_id(0)
    D, E = x_ref.shape[1], router.n_experts
    f32 = jnp.float32

    def stream(cols):  # x + o, rounded as the residual add rounds
        return (x_ref[row, cols].astype(f32) + o_ref[row, cols].astype(f32)).astype(dtype
                                                                                  ).astype(f32)

    s = stream(slice(None))
    r = jax.lax.rsqrt(jnp.sum(s * s) / D + eps)
    a1 = jnp.maximum(row_product(stream, w_ref, 0, E, block_k, layout) * r, 0.0)
    a = a1
    if s_ref is not None:
        a = a1 * jax.lax.rsqrt(jnp.sum(a1 * a1) / E + router.eps) * s_ref[...].astype(f32)
    xe_ref[row, :] = (s * r).astype(xe_ref.dtype)
    a_ref[row, :] = a.astype(a_ref.dtype)
    a1_ref[row, :] = a1
    s_out_ref[row, :] = s.astype(s_out_ref.dtype)
    y_ref[row, :] = jnp.zeros((D,), f32)


def fused_route(x_ND, o_ND, w_router, router: Router, *, eps: float, layout: str = "kn",
                interpret: bool = False):
    """``(x_e [N, D], a [N, E], a_1 [N, E], s [N, D], y [N, D])`` (module docstring): the
    experts' input in ``x``'s dtype, the combine weights in the router norm's output dtype
    (float32 without a norm), the ReLU scores in float32, the stream ``x + o`` in ``x``'s
    dtype and float32 zeros (the expert part's target), of ``x_ND`` the
    block's residual and ``o_ND`` its attention output; ``w_router`` ``[D, E]`` float32 with
    the FFN norm's scale folded in (``"kn"``) or its transpose (``"nk"``); ``router`` its
    experts, norm scale ``[E]`` (None: no norm), eps and output dtype (one piece)."""
    N, D = x_ND.shape
    E = router.n_experts
    reason = supports(D, E, N, x_ND.dtype)
    if reason is None and w_router.shape != ((D, E) if layout == "kn" else (E, D)):
        reason = f"router weights {tuple(w_router.shape)} for d_model={D}, {E} experts"
    if reason is not None:
        raise ValueError(f"fused_route does not take this call: {reason}; run the XLA decode "
                         "step (lean_decoder without fused=True)")
    kernel = functools.partial(
        _kernel, block_k=block_of(D, BLOCK_K), eps=eps, layout=layout, dtype=x_ND.dtype,
        router=router._replace(norm_scale=router.norm_scale is not None))  # an operand
    a_dtype = jnp.float32 if router.norm_scale is None else router.norm_dtype
    operands = [a for a in (x_ND, o_ND, w_router, router.norm_scale) if a is not None]
    return pl.pallas_call(
        kernel, grid=(N,),
        out_shape=(jax.ShapeDtypeStruct((N, D), x_ND.dtype),
                   jax.ShapeDtypeStruct((N, E), a_dtype),
                   jax.ShapeDtypeStruct((N, E), jnp.float32),
                   jax.ShapeDtypeStruct((N, D), x_ND.dtype),
                   jax.ShapeDtypeStruct((N, D), jnp.float32)),
        compiler_params=compiler_params(interpret),
        interpret=interpret,
    )(*operands)
