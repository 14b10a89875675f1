"""What the decode step's Pallas Triton kernels share (:mod:`moejax.kernels.decode_qkv`,
:mod:`moejax.kernels.decode_ffn`, :mod:`moejax.kernels.decode_route`): whether this jax ships
Pallas Triton and the operands they take, their launch parameters and blocks, and a program's
product of one row with a block of weight columns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # deprecated since jax 0.12: the kernels run while jax still ships it
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    pltriton = None

__all__ = ["AVAILABLE", "BLOCK_K", "unsupported", "compiler_params", "pow2", "block_of",
           "row_product", "rows_product"]

AVAILABLE = pltriton is not None
BLOCK_K = 256  # the contraction's step: the largest power of two up to this dividing the width


def unsupported(d: int, dtype, n_experts: int = 1) -> str | None:
    """Why the decode kernels do not take a call's operands, or None: this jax ships Pallas
    Triton, a power of two of at least 16 divides the model width ``d`` (the contraction's
    step), the experts (the router's scores, one block) are a power of two, the operands are
    float32 or bfloat16."""
    if not AVAILABLE:
        return "this jax ships no Pallas Triton"
    if block_of(d, BLOCK_K) < 16:
        return f"d_model={d}: no power of two of at least 16 divides it"
    if not pow2(n_experts):
        return f"{n_experts} experts (the router's scores are a power-of-two block)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"dtype {jnp.dtype(dtype).name}"
    return None


def compiler_params(interpret: bool):
    """A program of 4 warps, one stage (each loads its blocks once); none interpreted."""
    return None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=1)


def pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def block_of(n: int, cap: int) -> int:
    """The largest power of two of at most ``cap`` that divides ``n``."""
    return min(cap, n & -n)


_BLOCK_ELEMENTS = 8192  # a weight block's values: 64 registers a thread over 4 warps


def row_product(load_x, w_ref, c, width: int, block_k: int, layout: str):
    """``x W[:, c : c + width]`` in float32 for the row ``load_x(cols)`` returns (float32,
    ``cols`` a ``pl.ds`` of the model width): :func:`rows_product` of one row."""
    return rows_product(lambda n, cols: load_x(cols), w_ref, c, width, block_k, layout, 1)[0]


def rows_product(load_x, w_ref, c, width: int, block_k: int, layout: str, rows: int):
    """``x_n W[:, c : c + width]`` in float32 for each of ``rows`` rows ``load_x(n, cols)``
    (float32, ``cols`` a ``pl.ds`` of the model width), a tuple: over the width in steps of
    ``block_k`` (a power of two dividing it), fewer where a ``block_k x width`` block would
    pass :data:`_BLOCK_ELEMENTS` (a block kept in registers, not spilled), each step's weight
    block read once for every row; ``W`` is ``[K, N]`` (``"kn"``) or ``[N, K]`` (``"nk"``)."""
    k_dim = w_ref.shape[0 if layout == "kn" else 1]
    while block_k > 16 and block_k * width > _BLOCK_ELEMENTS:
        block_k //= 2

    def step(i, accs):
        k0 = pl.multiple_of(i * block_k, block_k)
        if layout == "kn":
            w = w_ref[pl.ds(k0, block_k), pl.ds(c, width)].astype(jnp.float32)
            return tuple(acc + jnp.sum(load_x(n, pl.ds(k0, block_k))[:, None] * w, axis=0)
                         for n, acc in enumerate(accs))
        w = w_ref[pl.ds(c, width), pl.ds(k0, block_k)].astype(jnp.float32)
        return tuple(acc + jnp.sum(w * load_x(n, pl.ds(k0, block_k))[None, :], axis=1)
                     for n, acc in enumerate(accs))
    zeros = tuple(jnp.zeros((width,), jnp.float32) for _ in range(rows))
    return jax.lax.fori_loop(0, k_dim // block_k, step, zeros)
