"""Building blocks shared by the project's Pallas Mosaic GPU kernels (Hopper: TMA copies into
swizzled shared memory, wgmma into float32 accumulators): operand block specs, the store of
an accumulator (whole, or a dynamic range of its rows), zeroing rows outside a range, and the
kernel launch with its interpret mode.

Mosaic GPU's wgmma takes 16-bit operands (:data:`DTYPES`) from shared memory, either
orientation (a transposed view of a block is free); float32 would be a tf32 wgmma, which
takes K-major operands only, so the kernels built here take bf16 / f16 and leave float32 to
the Triton or XLA paths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["DTYPES", "swizzled", "block_spec", "weight_spec", "mma", "store_block", "mgpu_kernel",
           "takes_dtype", "row_ladder", "store_row_range", "zero_rows_outside", "SMEM_BYTES",
           "blocks_per_sm"]

DTYPES = (jnp.bfloat16, jnp.float16)
SMEM_BYTES = 232_448  # the shared memory a Hopper (sm90) block may take; Mosaic GPU refuses more
SM_SMEM_BYTES = 233_472  # an sm90 SM's shared memory, which the blocks resident on it share
BLOCK_RESERVED_BYTES = 1_024  # what CUDA keeps of it per resident block


def blocks_per_sm(smem: int) -> int:
    """How many blocks of ``smem`` shared-memory bytes an sm90 SM holds at once (by shared
    memory alone: one warpgroup's registers and threads allow more)."""
    return SM_SMEM_BYTES // (smem + BLOCK_RESERVED_BYTES)


def takes_dtype(dtype) -> bool:
    """Whether wgmma takes ``dtype`` without tf32 (bf16 / f16)."""
    return any(jnp.dtype(dtype) == d for d in DTYPES)


def swizzled(shape, dtype, what: str = ""):
    """Tiling and swizzle transforms for a wgmma operand block in shared memory."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits, what)
    return plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle)


def block_spec(shape, index, dtype, what):
    """A pipelined operand block of ``shape`` (``None``: a squeezed leading axis) in
    swizzled shared memory, released one step late (wgmma reads it asynchronously)."""
    block = tuple(d for d in shape if d is not None)
    return plgpu.BlockSpec(shape, index, transforms=swizzled(block, dtype, what),
                           delay_release=1)


def weight_spec(tr: int, to: int, transpose: bool, dtype, group, col):
    """Group ``group(i)``'s weight block for contraction step ``i`` of a ``[G, R, n_out]``
    stack: ``[tr, to]`` at output block ``col``, or as stored ``[to, tr]`` of a ``[G, n_out,
    R]`` stack when the product takes ``w^T`` (:func:`mma` transposes the view)."""
    if transpose:
        return block_spec((None, to, tr), lambda i: (group(i), col, i), dtype, "wT")
    return block_spec((None, tr, to), lambda i: (group(i), i, col), dtype, "w")


def mma(acc, a_s, w_s, transpose: bool):
    """``acc += a_s @ w_s`` (``w_s^T`` with ``transpose``) by wgmma, leaving one in flight."""
    plgpu.wgmma(acc, a_s, w_s.T if transpose else w_s)
    plgpu.wgmma_wait(1)


def store_block(acc_f32, out_g, index, dtype):
    """The accumulator in ``dtype`` through shared memory to ``out_g[index]`` (one TMA)."""
    def write(o_smem):
        o_smem[...] = acc_f32.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_g.at[index])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM(acc_f32.shape, dtype))


def row_ladder(tm: int) -> tuple[int, ...]:
    """The TMA copy lengths a store of a dynamic number of rows uses: the powers of two up
    to ``tm``, longest first (``r <= tm`` rows take those of ``r``'s set bits; a TMA copy's
    shape is static)."""
    return tuple(1 << b for b in reversed(range(tm.bit_length())) if 1 << b <= tm)


def store_row_range(acc_f32, o_smem, o_g, row0, first, size, col, tm: int, to: int, dtype):
    """Rows ``[first, first + size)`` of the ``[tm, to]`` accumulator (``0 <= size <= tm``)
    to ``o_g`` at row ``row0 + first``, column block ``col``, through ``o_smem`` (``[tm, c]``,
    ``c`` dividing ``to``: the columns go ``c`` at a time): one TMA copy per set bit of
    ``size``."""
    c = o_smem.shape[1]
    for j in range(to // c):
        plgpu.wait_smem_to_gmem(0)  # the previous columns' copies have read o_smem
        o_smem[...] = acc_f32[:, j * c:(j + 1) * c].astype(dtype)
        plgpu.commit_smem()
        start = first
        for length in row_ladder(tm):
            @pl.when((size & length) != 0)
            def _(start=start, length=length, j=j):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(start, length)],
                    o_g.at[pl.ds(row0 + start, length), pl.ds(col * to + j * c, c)])
            start = start + (size & length)
    plgpu.wait_smem_to_gmem(0)


def zero_rows_outside(x_s, row0, lo, hi):
    """Zero the rows of the shared-memory block ``x_s`` (its rows are rows ``row0, row0 + 1,
    ..`` of the operand) outside ``[lo, hi)``, for the asynchronous proxy (wgmma) to read."""
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, x_s.shape, 0)
    keep = (rows >= lo) & (rows < hi)
    x_s[...] = jnp.where(keep, x_s[...], jnp.zeros(x_s.shape, x_s.dtype))
    plgpu.commit_smem()


def mgpu_kernel(body, out_shape, grid, names, interpret: bool, name: str):
    """``plgpu.kernel`` of one warpgroup per program over ``grid`` (axes ``names``) with one
    output ``(shape, dtype)``, named ``name`` (in profiles and in the lowered program);
    ``interpret``: Mosaic GPU's interpreter (the CPU's tests)."""
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(*out_shape), grid=grid,
                        grid_names=names, kernel_name=name,
                        interpret=plgpu.InterpretGPUParams() if interpret else False)
