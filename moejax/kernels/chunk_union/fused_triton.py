"""BlockFFN's chunk-sparse experts as a Triton kernel, called from JAX through
``jax_triton.triton_call`` (the ``backend="triton"`` of
:func:`moejax.kernels.chunk_union.pallas.chunk_union_kernel`; BlockFFN's ``path="triton"``).

Grid ``(C, F / BLOCK_F)``: program ``(c, f)`` takes token tile ``c`` (rows padded to a power of
two of at least 16, as ``tl.dot`` needs, and masked) and hidden block ``f``; for each of the
``count[c]`` union members ``e = ids[c, j]`` it computes ``h = act(x W_up[e][:, f]) [* (x
W_gate[e][:, f])] * A[:, e]`` over the model width in blocks of ``BLOCK_D`` and adds ``h
W_down[e][f, :]`` into the float32 output block by block (atomic adds: the hidden blocks of a
tile run in parallel). A program holds a few ``[BLOCK_T, BLOCK_D]`` / ``[BLOCK_D, BLOCK_F]``
blocks whatever ``D`` and ``F`` are, and only the union's expert weights are read. Offsets
into the expert stacks are 64-bit.

Needs ``triton`` and ``jax_triton`` (the ``gpu`` extra) and a GPU; both imports are guarded:
without them :data:`TRITON_AVAILABLE` is False and :func:`chunk_union_triton_call` raises an
error naming the fix. The kernel itself also runs in Triton's CPU interpreter
(``TRITON_INTERPRET=1`` set before this module is imported; ``tests/test_kernels_triton.py``
drives it with numpy arrays whenever ``triton`` is installed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

try:
    import triton
    import triton.language as tl
except ImportError:  # the gpu extra is not installed
    triton = tl = None

try:
    import jax_triton
except ImportError:  # no GPU jaxlib or no jax-triton
    jax_triton = None

__all__ = ["TRITON_AVAILABLE", "JAX_TRITON_AVAILABLE", "ACT_CODES", "launch_config",
           "chunk_union_triton_call", "unavailable_reason"]

TRITON_AVAILABLE = triton is not None
JAX_TRITON_AVAILABLE = jax_triton is not None
ACT_CODES = {"relu": 0, "swish": 1, "swiglu": 1, "gelu": 2, "geglu": 2, "gelu_tanh": 3}


def unavailable_reason() -> str | None:
    """None when ``backend="triton"`` can run here, else why not and the fix."""
    if not TRITON_AVAILABLE:
        return "triton is not installed (pip install -e '.[gpu]' on a machine with a GPU)"
    if not JAX_TRITON_AVAILABLE:
        return ("jax_triton cannot be imported: it needs a GPU build of jax and the gpu extra "
                "(pip install -e '.[gpu]')")
    if jax.default_backend() != "gpu":
        return f"backend='triton' needs a GPU; jax runs on {jax.default_backend()!r}"
    return None


def _next_pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, int(n) - 1).bit_length())


def launch_config(tile: int, d: int, f: int, activation: str, gated: bool,
                  block_f: int = 32, block_d: int = 64, ieee: bool = False) -> dict:
    """The kernel's compile-time constants for a tile length and the expert shapes. ``ieee``:
    float32 products in full precision (else TF32, Triton's and XLA's GPU default)."""
    if activation not in ACT_CODES:
        raise ValueError(f"activation={activation!r} has no Triton kernel; use one of "
                         f"{sorted(ACT_CODES)}")
    return dict(D=d, F=f, TILE=tile, BLOCK_T=_next_pow2(tile, 16),
                BLOCK_D=min(_next_pow2(d, 16), _next_pow2(block_d, 16)),
                BLOCK_F=min(_next_pow2(f, 16), _next_pow2(block_f, 16)),
                ACT=ACT_CODES[activation], GATED=bool(gated),
                PRECISION="ieee" if ieee else "tf32")


if TRITON_AVAILABLE:

    @triton.jit
    def _activation(x, ACT: tl.constexpr):
        if ACT == 0:
            y = tl.maximum(x, 0.0)
        elif ACT == 1:
            y = x * tl.sigmoid(x)
        elif ACT == 2:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        else:  # tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = x * tl.sigmoid(2.0 * z)
        return y

    @triton.jit
    def _chunk_union_kernel(x_ptr, a_ptr, ids_ptr, count_ptr, w_up_ptr, w_down_ptr,
                            w_gate_ptr, out_ptr, E: tl.constexpr, U: tl.constexpr,
                            D: tl.constexpr, F: tl.constexpr, TILE: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_F: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
                            PRECISION: tl.constexpr):
        c = tl.program_id(0)
        fs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        f_ok = fs < F
        t = tl.arange(0, BLOCK_T)
        rows = c * TILE + t
        row_ok = t < TILE
        count = tl.load(count_ptr + c)
        for j in range(0, count):
            e = tl.load(ids_ptr + c * U + j).to(tl.int64)
            a = tl.load(a_ptr + rows * E + e, mask=row_ok, other=0.0).to(tl.float32)
            up = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
            gate = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):  # h = x W_up[e][:, fs], contraction in blocks
                ds = d0 + tl.arange(0, BLOCK_D)
                d_ok = ds < D
                x = tl.load(x_ptr + rows[:, None] * D + ds[None, :],
                            mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                w_off = e * D * F + ds[:, None] * F + fs[None, :]
                w_mask = d_ok[:, None] & f_ok[None, :]
                up += tl.dot(x, tl.load(w_up_ptr + w_off, mask=w_mask, other=0.0),
                             input_precision=PRECISION)
                if GATED:
                    gate += tl.dot(x, tl.load(w_gate_ptr + w_off, mask=w_mask, other=0.0),
                                   input_precision=PRECISION)
            if GATED:
                h = _activation(gate, ACT) * up
            else:
                h = _activation(up, ACT)
            h = h * a[:, None]
            for d0 in range(0, D, BLOCK_D):  # out[:, ds] += h W_down[e][fs, ds]
                ds = d0 + tl.arange(0, BLOCK_D)
                d_ok = ds < D
                w_down = tl.load(w_down_ptr + e * F * D + fs[:, None] * D + ds[None, :],
                                 mask=f_ok[:, None] & d_ok[None, :], other=0.0)
                part = tl.dot(h.to(w_down.dtype), w_down, input_precision=PRECISION)
                tl.atomic_add(out_ptr + rows[:, None] * D + ds[None, :], part,
                              mask=row_ok[:, None] & d_ok[None, :])

    KERNEL = _chunk_union_kernel
else:
    KERNEL = None


def chunk_union_triton_call(xp, ap, ids_CU, count_C, w_up, w_down, w_gate=None, *,
                            activation: str, tile: int, num_warps: int = 4):
    """``y [C * tile, D]`` for tile-padded inputs (see
    :func:`moejax.kernels.chunk_union.pallas.tile_unions`) through ``jax_triton.triton_call``."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"chunk-union Triton kernel unavailable: {why}")
    (C, U), (E, D, F) = ids_CU.shape, w_up.shape
    # full float32 products when jax is asked for them (jax_default_matmul_precision)
    ieee = (xp.dtype == jnp.float32
            and str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32"))
    meta = launch_config(tile, D, F, activation, w_gate is not None, ieee=ieee)
    out = jax_triton.triton_call(
        xp, ap, ids_CU, count_C, w_up, w_down, w_up if w_gate is None else w_gate,
        kernel=KERNEL, out_shape=jax.ShapeDtypeStruct((C * tile, D), jnp.float32),
        grid=(C, -(-F // meta["BLOCK_F"])), zeroed_outputs=(0,), num_warps=num_warps, E=E,
        U=U, **meta)
    return out.astype(xp.dtype)


def launch_interpreted(xp, ap, ids_CU, count_C, w_up, w_down, w_gate=None, *, activation: str,
                       tile: int, wrap, **blocks):
    """Run the kernel in Triton's interpreter on host arrays (tests, ``TRITON_INTERPRET=1``):
    ``wrap`` turns a numpy array into the tensor object the interpreter takes; ``blocks``:
    ``block_f`` / ``block_d`` for :func:`launch_config`."""
    if not TRITON_AVAILABLE:
        raise RuntimeError(unavailable_reason())
    xp, ap, ids_CU, count_C, w_up, w_down = map(np.asarray, (xp, ap, ids_CU, count_C, w_up,
                                                             w_down))
    (C, U), (E, D, F) = ids_CU.shape, w_up.shape
    out = wrap(np.zeros((C * tile, D), np.float32))
    gate = w_up if w_gate is None else np.asarray(w_gate)
    meta = launch_config(tile, D, F, activation, w_gate is not None, ieee=True, **blocks)
    KERNEL[(C, -(-F // meta["BLOCK_F"]))](wrap(xp), wrap(ap), wrap(ids_CU.astype(np.int32)),
                 wrap(count_C.astype(np.int32)), wrap(w_up), wrap(w_down), wrap(gate), out,
                 E=E, U=U, **meta)
    return out
