"""A decode step's FFN input in one GPU launch: the attention's residual add, the FFN norm's factor,
the input product (with a BlockFFN router's scores, its ReLU and RMSNorm), the activation and the
experts' weights (a Pallas Triton kernel).

The lean decode step (:mod:`moejax.nn.lean_decode`) runs a dense FFN as ``h = act(x W_gate r) *
(x W_up r)``, ``y = h W_down`` with the norm's scale folded into ``W`` and its per-token factor
``r`` applied after the product, and BlockFFN's every-expert path the same way over ``[D, E F]``
with the router's float32 weights as extra columns of the in product (three bfloat16 pieces
where the experts run in bfloat16) and each expert's ``F`` activations weighted by its combine
weight ``a_e``: on a GPU, the residual stream with its sum of squares, the in product, the
router norm's reduction and the activation are four kernels before the down product. Here one
program per block of ``BLOCK_F`` of the ``H`` hidden columns takes every token row of the call
(1 to :data:`MAX_ROWS`: a decoded token per cache row, or a speculative round's verified
block), reading its block of weights once for all of them; for each row it

1. reads the row's residual ``x`` and the attention's output ``o``, makes the stream ``x + o``
   (rounded to the operands' dtype, as the residual add rounds) and its factor ``r``;
2. with a router, computes every expert's score ``a_0 = r sum_p x P_p`` (float32 over the
   pieces ``P_p``), ``a_1 = relu(a_0)`` and, with a router norm, ``a = RMSNorm(a_1)``, and
   takes its expert's ``a_e`` (the scores are ``E`` values of ``D E P`` weights: each program
   computes them rather than waiting on one that does);
3. computes its block's columns of the in product (gate and up), each rounded to the operands'
   dtype and scaled by ``r`` in it (plus the bias), the activation, and ``a_e``, and stores
   them in ``g [N, H]``, which the down product reads;
4. the first program stores the rows' stream, which the block's output adds to.

Float32 accumulation, the weights in ``[K, N]`` (``"kn"``) or transposed (``"nk"``) layout;
``interpret=True`` runs the kernel in Pallas's interpreter (the tests). Pallas Triton is
deprecated since jax 0.12: :data:`moejax.kernels.decode_rows.AVAILABLE` says whether this jax
ships it; :func:`supports` says which calls the kernel takes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from moejax.kernels.decode_rows import (
    BLOCK_K,
    block_of,
    compiler_params,
    rows_product,
    unsupported,
)
from moejax.ops.activations import activation_fn

__all__ = ["MAX_ROWS", "Router", "supports", "fused_ffn_in"]

MAX_ROWS = 8  # token rows per call, each program's weight block read once for all of them
BLOCK_F = 128  # a program's hidden columns: the largest power of two up to this dividing F


class Router(NamedTuple):
    """A BlockFFN router inside the in product: its ``n_pieces`` pieces' ``E`` columns each
    follow the experts' columns; ``norm_scale [E]`` (None: no router norm), its ``eps`` and
    the norm's output dtype."""
    n_experts: int
    n_pieces: int
    norm_scale: jax.Array | None
    eps: float
    norm_dtype: np.dtype


def supports(d: int, d_hidden: int, n_experts: int, rows: int, dtype) -> str | None:
    """None when :func:`fused_ffn_in` takes the call, else why not: 1 to :data:`MAX_ROWS`
    token rows, the model width and an expert's hidden width divisible by a power of two of at
    least 16, a power-of-two number of experts, float32 or bfloat16 operands."""
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} token rows (the kernel takes 1 to {MAX_ROWS})"
    if block_of(d_hidden, BLOCK_F) < 16:
        return f"hidden width {d_hidden}: no power of two of at least 16 divides it"
    return unsupported(d, dtype, n_experts)


def _kernel(*refs, rows, block_k, block_f, d_hidden, hidden, gated, activation, eps, layout,
            dtype, bias, router):
    refs = list(refs)
    x_ref, o_ref, w_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if bias else None
    s_ref = refs.pop(0) if router is not None and router.norm_scale else None
    g_ref, xo_ref = refs
    j = pl.program_id(0)
    D = x_ref.shape[1]
    f32 = jnp.float32

    def stream(n, cols):  # row n's x + o, rounded as the residual add rounds, in float32
        return (x_ref[n, cols].astype(f32) + o_ref[n, cols].astype(f32)).astype(dtype
                                                                              ).astype(f32)

    def factor(n):
        x = stream(n, slice(None))
        return jax.lax.rsqrt(jnp.sum(x * x) / D + eps)

    r32 = [factor(n) for n in range(rows)]
    r = [v.astype(dtype).astype(f32) for v in r32]

    def product(c, width):  # each row's x W[:, c : c + width], float32
        return rows_product(stream, w_ref, c, width, block_k, layout, rows)

    def scaled(c):  # each row's hidden column block as the XLA step rounds it
        out = []
        for n, acc in enumerate(product(c, block_f)):
            h = (acc.astype(dtype).astype(f32) * r[n]).astype(dtype)
            if b_ref is not None:
                h = (h.astype(f32) + b_ref[pl.ds(c, block_f)].astype(f32)).astype(dtype)
            out.append(h.astype(f32))
        return out

    c0 = j * block_f
    act = activation_fn(activation)
    if gated:  # the activation in float32, rounded once (XLA's excess precision)
        g = [(act(a) * u).astype(dtype) for a, u in zip(scaled(c0), scaled(hidden + c0))]
    else:
        g = [act(a).astype(dtype) for a in scaled(c0)]
    if router is not None:
        E = router.n_experts
        start = (2 if gated else 1) * hidden
        pieces = [product(start + p * E, E) for p in range(router.n_pieces)]
        e = c0 // d_hidden  # this block's expert
        for n in range(rows):
            a = jnp.maximum(sum(piece[n] for piece in pieces) * r32[n], 0.0)
            if s_ref is not None:
                a = a * jax.lax.rsqrt(jnp.sum(a * a) / E + router.eps) * s_ref[...].astype(f32)
                a = a.astype(router.norm_dtype)
            a_e = jnp.sum(jnp.where(jnp.arange(E) == e, a.astype(f32), 0.0)).astype(dtype)
            g[n] = (g[n] * a_e).astype(dtype)
    for n in range(rows):
        g_ref[n, pl.ds(c0, block_f)] = g[n].astype(g_ref.dtype)

    @pl.when(j == 0)
    def _():
        for n in range(rows):
            xo_ref[n, :] = stream(n, slice(None)).astype(dtype)


def fused_ffn_in(x_ND, o_ND, w_in, b_in, *, d_hidden: int, n_experts: int = 1, gated: bool,
                 activation: str, eps: float, layout: str = "kn", router: Router | None = None,
                 interpret: bool = False):
    """``(g [N, E F], x + o [N, D])`` (module docstring): ``x_ND`` the block's residual (``N``
    token rows), ``o_ND`` its attention output, ``w_in`` ``[D, (gate) E F | up E F | router
    P E]`` (``"kn"``; the FFN norm's scale folded in) or its transpose (``"nk"``), ``b_in``
    ``[(2) E F]`` or None; ``d_hidden`` an expert's ``F`` (a dense FFN: one expert, no
    router); ``activation`` the gate's (or the plain activation)."""
    N, D = x_ND.shape
    reason = supports(D, d_hidden, n_experts, N, x_ND.dtype)
    if reason is not None:
        raise ValueError(f"fused_ffn_in does not take this call: {reason}; run the XLA decode "
                         "step (lean_decoder without fused=True)")
    hidden = n_experts * d_hidden
    block_f = block_of(d_hidden, BLOCK_F)
    kernel = functools.partial(
        _kernel, rows=N, block_k=block_of(D, BLOCK_K), block_f=block_f, d_hidden=d_hidden,
        hidden=hidden, gated=gated, activation=activation, eps=eps, layout=layout,
        dtype=x_ND.dtype, bias=b_in is not None, router=None if router is None else
        router._replace(norm_scale=router.norm_scale is not None))  # the scale: an operand
    scale = None if router is None else router.norm_scale
    operands = [a for a in (x_ND, o_ND, w_in, b_in, scale) if a is not None]
    return pl.pallas_call(
        kernel, grid=(hidden // block_f,),
        out_shape=(jax.ShapeDtypeStruct((N, hidden), x_ND.dtype),
                   jax.ShapeDtypeStruct((N, D), x_ND.dtype)),
        compiler_params=compiler_params(interpret),
        interpret=interpret,
    )(*operands)
