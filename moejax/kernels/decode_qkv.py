"""A decode step's attention input in one GPU launch: the block input's RMS factor, the q, k and v
product, RoPE, and both KV-cache writes (a Pallas Triton kernel).

For 1 to :data:`MAX_TOKENS` new tokens per cache row (``x [N, D]``, ``N = B T`` token rows:
autoregressive and draft decoding, and a speculative round's verified block), the lean decode
step (:class:`moejax.nn.lean_decode.LeanAttention`) makes q, k and v as one product of
``w_qkv = diag(s) [w_q | w_k | w_v]`` with the norm's per-token factor applied after it, then
rotates q and k and writes k and v into the cache: on a GPU, four kernels after the one that
makes the residual stream and the factor. Here one program per (token row, head) of the
``H + 2G`` heads of the product

1. reads the row ``x`` (or ``x + y``, the previous block's residual add, rounded to the
   operands' dtype as that add rounds; the first program of the row stores it) and takes its
   factor ``r = rsqrt(mean(x^2) + eps)`` (float32, ``D`` values, so every program computes
   it rather than waiting on one that does);
2. computes its head's two halves, ``y_1 = x W[:, c : c + J/2]`` and
   ``y_2 = x W[:, c + J/2 : c + J]``, accumulated in float32 over the model width in
   ``BLOCK_K`` steps, each rounded to the operands' dtype and scaled by ``r`` in it, plus
   the bias, as the XLA step rounds them;
3. rotates a q or k head by its position (``"half"`` RoPE, :func:`moejax.nn.rope.apply_rope`:
   ``[y_1 cos - y_2 sin, y_1 sin + y_2 cos]`` in float32);
4. stores q's head into ``q [N, H, J]``, or k's or v's into its cache row (token row
   ``n``'s is ``n // T``) at the token's write slot: the caches are the kernel's outputs
   aliased to its inputs, so the rest of them is left as it is (donated through the decode
   loop, no copy).

A token row's programs read the weights once (each its head's ``D x J`` columns; the rows
of a block of ``T`` read them again, from the L2 at these sizes); the ``[N, K]``
transposed layout (``"nk"``: each output's weights contiguous) and the modules' ``[K, N]``
(``"kn"``) are both taken. ``interpret=True`` runs the same kernel in Pallas's interpreter
on the CPU (the tests' oracle comparison). Pallas Triton is deprecated since jax 0.12
(tokamax's flash attention, which the decode step calls next, is Pallas Triton too);
:data:`AVAILABLE` says whether this jax ships it, and :func:`supports` which calls the
kernel takes (the caller keeps the XLA step for the others).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from moejax.kernels.decode_rows import (
    AVAILABLE,
    BLOCK_K,
    block_of,
    compiler_params,
    pow2,
    row_product,
    unsupported,
)

__all__ = ["AVAILABLE", "MAX_TOKENS", "supports", "fused_qkv"]

MAX_TOKENS = 8  # new tokens per cache row: a decoded token, or a verified block of up to 8


def supports(d: int, head_dim: int, rope_style: str | None, tokens: int, dtype) -> str | None:
    """None when :func:`fused_qkv` takes the call, else why not: 1 to :data:`MAX_TOKENS` new
    tokens per cache row, a
    head's halves and the contraction step powers of two (Triton's blocks), ``"half"`` RoPE
    or none, float32 or bfloat16 operands."""
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} new tokens per row (the kernel takes 1 to {MAX_TOKENS})"
    if head_dim % 2 or not pow2(head_dim // 2):
        return f"head_dim={head_dim}: its halves are not a power of two"
    if rope_style not in (None, "half"):
        return f"rope_style={rope_style!r} (the kernel rotates 'half' pairs)"
    return unsupported(d, dtype)


def _kernel(*refs, n_heads, n_kv, half, block_k, eps, layout, rope, dtype, bias, add, tokens):
    refs = list(refs)
    x_ref, y_ref = refs.pop(0), refs.pop(0) if add else None
    w_ref, b_ref = refs.pop(0), refs.pop(0) if bias else None
    freq_ref, pos_ref, slot_ref, _, _, q_ref, kc_ref, vc_ref, *xo = refs  # caches aliased
    row, head = pl.program_id(0), pl.program_id(1)
    batch = row // tokens  # the cache row the token row writes
    D = x_ref.shape[1]

    def stream(cols):  # the block's input: x, or x + y rounded as the residual add rounds
        x = x_ref[row, cols]
        if add:
            x = (x.astype(jnp.float32) + y_ref[row, cols].astype(jnp.float32)).astype(dtype)
        return x.astype(jnp.float32)

    x = stream(slice(None))
    r = jax.lax.rsqrt(jnp.sum(x * x) / D + eps).astype(dtype).astype(jnp.float32)
    c0 = head * 2 * half

    def product(c):  # x W[:, c : c + half], rounded as the XLA step rounds it
        acc = row_product(stream, w_ref, c, half, block_k, layout)
        y = (acc.astype(dtype).astype(jnp.float32) * r).astype(dtype)
        if b_ref is not None:
            y = (y.astype(jnp.float32) + b_ref[pl.ds(c, half)].astype(jnp.float32)).astype(dtype)
        return y.astype(jnp.float32)

    y1, y2 = product(c0), product(c0 + half)
    if rope:
        angle = pos_ref[row].astype(jnp.float32) * freq_ref[...]
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        r1, r2 = y1 * cos - y2 * sin, y1 * sin + y2 * cos
    else:
        r1, r2 = y1, y2
    slot = slot_ref[row]

    @pl.when(head < n_heads)
    def _():
        q_ref[row, head, pl.ds(0, half)] = r1.astype(q_ref.dtype)
        q_ref[row, head, pl.ds(half, half)] = r2.astype(q_ref.dtype)

    @pl.when((head >= n_heads) & (head < n_heads + n_kv))
    def _():
        g = head - n_heads
        kc_ref[batch, slot, g, pl.ds(0, half)] = r1.astype(kc_ref.dtype)
        kc_ref[batch, slot, g, pl.ds(half, half)] = r2.astype(kc_ref.dtype)

    @pl.when(head >= n_heads + n_kv)
    def _():
        g = head - n_heads - n_kv
        vc_ref[batch, slot, g, pl.ds(0, half)] = y1.astype(vc_ref.dtype)
        vc_ref[batch, slot, g, pl.ds(half, half)] = y2.astype(vc_ref.dtype)

    if add:  # the residual stream, once per row
        @pl.when(head == 0)
        def _():
            xo[0][row, :] = x.astype(dtype)


def fused_qkv(x_ND, w_qkv, b_qkv, k_BSGJ, v_BSGJ, positions_N, slots_N, *, n_heads: int,
              eps: float, rope_base: float | None, layout: str = "kn", y_ND=None,
              interpret: bool = False):
    """``(q [N, H, J], k cache, v cache)`` of ``N = B T`` new token rows, ``T`` per cache row
    (module docstring): ``x_ND`` the block's input (before its RMSNorm, whose scale ``w_qkv``
    holds; row ``n`` is token ``n % T`` of cache row ``n // T``), ``w_qkv`` ``[D, (H+2G)J]``
    (``layout="kn"``) or its transpose (``"nk"``), ``b_qkv`` ``[(H+2G)J]`` or None; the caches
    ``[B, S, G, J]``, each token written at its slot ``slots_N`` (below ``S``); q and k rotated
    by ``positions_N`` (``rope_base`` None: no RoPE). ``y_ND``: the block's input is ``x + y``
    (the previous block's residual add, made here in ``x``'s dtype), returned as a fourth
    output."""
    N, D = x_ND.shape
    B, _, G, J = k_BSGJ.shape
    reason = supports(D, J, None if rope_base is None else "half", N // B, x_ND.dtype)
    if reason is None and N % B:
        reason = f"{N} token rows for {B} cache rows"
    if reason is not None:
        raise ValueError(f"fused_qkv does not take this call: {reason}; run the XLA decode "
                         "step (LeanAttention without fused=True)")
    half = J // 2
    # the inverse frequencies as a constant of the program (no kernel computes them)
    freq = np.ones(half, np.float32) if rope_base is None else (
        np.float32(1.0) / np.float32(rope_base) ** (np.arange(0, J, 2, dtype=np.float32) / J))
    kernel = functools.partial(
        _kernel, n_heads=n_heads, n_kv=G, half=half, block_k=block_of(D, BLOCK_K), eps=eps,
        layout=layout, rope=rope_base is not None, dtype=x_ND.dtype, bias=b_qkv is not None,
        add=y_ND is not None, tokens=N // B)
    operands = [a for a in (x_ND, y_ND, w_qkv, b_qkv) if a is not None]
    operands += [freq, positions_N.astype(jnp.int32), slots_N.astype(jnp.int32), k_BSGJ,
                 v_BSGJ]
    n_in = len(operands)
    out_shape = [jax.ShapeDtypeStruct((N, n_heads, J), x_ND.dtype),
                 jax.ShapeDtypeStruct(k_BSGJ.shape, k_BSGJ.dtype),
                 jax.ShapeDtypeStruct(v_BSGJ.shape, v_BSGJ.dtype)]
    if y_ND is not None:
        out_shape.append(jax.ShapeDtypeStruct(x_ND.shape, x_ND.dtype))
    return pl.pallas_call(
        kernel, grid=(N, n_heads + 2 * G), out_shape=tuple(out_shape),
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        compiler_params=compiler_params(interpret),
        interpret=interpret,
    )(*operands)
