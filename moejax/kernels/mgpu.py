"""Building blocks shared by the project's Pallas Mosaic GPU kernels (Hopper: TMA copies into
swizzled shared memory, wgmma into float32 accumulators): operand block specs, the store of
an accumulator, and the kernel launch with its interpret mode.

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
           "takes_dtype"]

DTYPES = (jnp.bfloat16, jnp.float16)


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


def mgpu_kernel(body, out_shape, grid, names, interpret: bool):
    """``plgpu.kernel`` of one warpgroup per program over ``grid`` (axes ``names``) with one
    output ``(shape, dtype)``; ``interpret``: Mosaic GPU's interpreter (the CPU's tests)."""
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(*out_shape), grid=grid,
                        grid_names=names,
                        interpret=plgpu.InterpretGPUParams() if interpret else False)
