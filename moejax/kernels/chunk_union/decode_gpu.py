"""BlockFFN's chunk-union forward at decode on an NVIDIA Hopper GPU, in Pallas Mosaic GPU: one
chunk of ``n`` tokens (1 to 64: a decoded token, or the draft block that speculative decoding
verifies) reads only the weights of the experts in its union (BlockFFN paper, Sec. 3.3 and its
decode kernels), in one launch after the output is zeroed.

The grid is (expert ``e``, F block ``f``); each program is one warpgroup:

1. **Membership.** ``e`` is in the union when a token of the chunk activates it; the program
   reads the chunk's activity row for ``e`` and stops at the first active token. A program of
   a non-member exits there, so the weights read are the union's only, each once.
2. **Up-projection.** ``h = act(x W_gate[e][:, f]) * (x W_up[e][:, f]) * a[:, e]`` (plain:
   ``act(x W_up[e][:, f]) * a[:, e]``): the chunk, padded to wgmma's 64 rows, times the F
   block's columns, pipelined over D in 64-column steps (TMA copies into swizzled shared
   memory, wgmma into float32 accumulators; the block sizes: :func:`blocks`). ``h`` goes to
   shared memory in the weights' dtype, as the jnp oracle casts it.
3. **Down-projection.** Over D blocks (default 128): ``h W_down[e][f, d]`` by wgmma, added into the
   float32 output by TMA's reduce-add (``cp.reduce.async.bulk``), so the programs of all
   members and F blocks sum into one output without a second launch. Only the chunk's rows
   (rounded up to 8) are added.

Against the official design (thunlp/BlockFFN ``inference/``: a union kernel, then programs
over (union slot, F block) and a down-projection over D blocks) this finds the union inside
each program and sums the down-projection through the reduce-add; the weights read are the
same (the union's, once), with one launch fewer.

bfloat16 and float16 operands (what wgmma takes without tf32), ``D`` and ``F`` whole multiples
of the blocks (:func:`blocks`, tuned per device; default 128 and 64): :func:`supports` says
whether a call qualifies; the others decode through the
pair kernels (:func:`moejax.kernels.chunk_union.pallas.chunk_union_auto` chooses). Hopper
only (wgmma; compute capability 9.x): :func:`moejax.kernels.tiling.hopper_target`.

``interpret=True`` runs the kernel in Mosaic GPU's interpreter on the CPU, programs one after
another, for tests. The interpreter has no TMA reduce-add, so there the add is a
read-modify-write of the output block, exact when programs do not overlap; everything else is
the kernel that lowers for the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moejax.kernels.chunk_union.decode import MAX_CHUNK, check_expert_weights, kernel_activation
from moejax.kernels.mgpu import DTYPES, swizzled
from moejax.kernels.tuning import config_for
from moejax.ops.activations import activation_fn

__all__ = ["chunk_union_decode_gpu", "supports", "blocks", "ROWS"]

ROWS = 64  # wgmma's M: the chunk is padded to it
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row


def blocks(dtype, D: int, F: int) -> tuple[int, int, int, int]:
    """``(bK, bF, bD, stages)``: the up-projection's contraction step, the F block, the
    down-projection's D block and the pipeline depth for ``D`` and ``F`` on the device being
    lowered for (:func:`moejax.kernels.tuning.config_for`'s ``"decode_mgpu"``; default
    64, 64, 128 and 3)."""
    c = config_for("decode_mgpu", dtype, D, F)
    return c.tm, c.tk, c.tn, c.num_stages


def supports(x_nD, w_up) -> bool:
    """Whether the kernel takes this chunk: 1 to 64 tokens, bf16 / f16 operands, ``D`` and
    ``F`` whole multiples of the blocks (default: ``D`` of 128, ``F`` of 64)."""
    n, D = x_nD.shape
    if not (1 <= n <= MAX_CHUNK and any(x_nD.dtype == d for d in DTYPES)):
        return False
    bK, bF, bD, _ = blocks(x_nD.dtype, D, w_up.shape[-1])
    return D % bD == 0 and D % bK == 0 and w_up.shape[-1] % bF == 0


def _is_member(active_g, e, n: int):
    """1 when any of the chunk's ``n`` tokens activates expert ``e`` (stops at the first);
    ``active_g`` is the chunk's ``[n, E]`` activity as the router gives it (no transposed
    copy: one XLA launch fewer around the kernel)."""
    def more(carry):
        i, found = carry
        return (i < n) & (found == 0)

    def step(carry):
        i, _ = carry
        return i + 1, (active_g[i, e] != 0).astype(jnp.int32)

    return jax.lax.while_loop(more, step, (jnp.int32(0), jnp.int32(0)))[1]


def _body(x_g, a_g, active_g, wu_g, wd_g, *rest, n, rows, activation, gated, interpret,
          tiles):
    wg_g, y_g, h_smem, o_smem = rest if gated else (None, *rest)
    bK, bF, bD, stages = tiles
    D = x_g.shape[1]
    dt = x_g.dtype
    e, f = jax.lax.axis_index("e"), jax.lax.axis_index("f")

    def spec(shape, index, what):
        return plgpu.BlockSpec(shape, index, transforms=swizzled(shape, dt, what),
                               delay_release=1)

    @pl.when(_is_member(active_g, e, n) > 0)
    def _():
        def up(*accs):
            def step(_, x_s, *w_s):
                for acc, w in zip(accs, w_s):
                    plgpu.wgmma(acc, x_s, w)
                plgpu.wgmma_wait(len(accs))

            w_spec = spec((bK, bF), lambda k: (k, f), "w")
            weights = (wu_g.at[e],) + ((wg_g.at[e],) if gated else ())
            plgpu.emit_pipeline(step, grid=(D // bK,),
                                in_specs=(spec((ROWS, bK), lambda k: (0, k), "x"),
                                          *[w_spec] * len(weights)),
                                max_concurrent_steps=stages)(x_g, *weights)
            return tuple(acc[...] for acc in accs)

        accs = pl.run_scoped(up, *[plgpu.ACC((ROWS, bF))] * (2 if gated else 1))
        act = kernel_activation(activation)
        h = act(accs[1]) * accs[0] if gated else act(accs[0])
        a_col = plgpu.load(a_g.at[e], layout=_ROW_LAYOUT, optimized=False)
        h_smem[...] = (h * a_col[:, None]).astype(dt)
        plgpu.commit_smem()

        def down(idx, wd_s):
            (d,) = idx
            out = pl.run_scoped(lambda acc: (plgpu.wgmma(acc, h_smem, wd_s), acc[...])[1],
                                plgpu.ACC((ROWS, bD)))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add has read o_smem
            o_smem[...] = out
            plgpu.commit_smem()
            src, dst = o_smem.at[pl.ds(0, rows)], y_g.at[:, pl.ds(d * bD, bD)]
            if interpret:
                dst[...] = dst[...] + src[...]
            else:
                plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")

        plgpu.emit_pipeline(down, grid=(D // bD,),
                            in_specs=(plgpu.BlockSpec((bF, bD), lambda d: (f, d),
                                                      transforms=swizzled((bF, bD), dt, "wd")),),
                            max_concurrent_steps=stages)(wd_g.at[e])
        plgpu.wait_smem_to_gmem(0)


def chunk_union_decode_gpu(x_nD, a_nE, active_nE, w_up, w_down, w_gate=None, *,
                           activation: str, interpret: bool = False):
    """``y [n, D]`` in ``x``'s dtype: the chunk's expert output through the union's weights
    only (module docstring); equals
    :func:`moejax.kernels.chunk_union.reference.dense_experts`."""
    n, D = x_nD.shape
    E = a_nE.shape[-1]
    if a_nE.shape != (n, E) or active_nE.shape != (n, E):
        raise ValueError(f"a {a_nE.shape} and active {active_nE.shape} must be {(n, E)}")
    check_expert_weights(x_nD.shape, E, w_up, w_down, w_gate)
    activation_fn(activation)  # an unknown name fails here, before any lowering
    if not supports(x_nD, w_up):
        raise ValueError(f"chunk_union_decode_gpu takes 1 to {MAX_CHUNK} tokens of bfloat16 "
                         f"or float16 with D and F whole multiples of its blocks; got "
                         f"x {tuple(x_nD.shape)} {x_nD.dtype}, F {w_up.shape[-1]} (other "
                         f"chunks: chunk_union_auto's pair kernels)")
    tiles = blocks(x_nD.dtype, D, w_up.shape[-1])
    bF, bD = tiles[1], tiles[2]
    dt = x_nD.dtype
    rows = -(-n // 8) * 8
    gated = w_gate is not None
    weights = [w.astype(dt) for w in (w_up, w_down) + ((w_gate,) if gated else ())]
    x = jnp.pad(x_nD, ((0, ROWS - n), (0, 0)))
    a_E = jnp.pad(a_nE.astype(jnp.float32).T, ((0, 0), (0, ROWS - n)))
    active_nE = active_nE.astype(jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_body, n=n, rows=rows, activation=activation, gated=gated,
                          interpret=interpret, tiles=tiles),
        out_type=(), grid=(E, w_up.shape[-1] // bF), grid_names=("e", "f"),
        scratch_types=[plgpu.SMEM((ROWS, bF), dt, transforms=swizzled((ROWS, bF), dt, "h")),
                       plgpu.SMEM((ROWS, bD), jnp.float32)],
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    y = jax.new_ref(jnp.zeros((rows, D), jnp.float32))
    kernel(x, a_E, active_nE, *weights[:2], *weights[2:], y)
    return y[...][:n].astype(dt)
