"""BlockFFN's chunk-union forward at decode on an NVIDIA Hopper GPU, in Pallas Mosaic GPU: one
chunk of ``n`` tokens (1 to 64: a decoded token, or the draft block that speculative decoding
verifies) reads only the weights of the experts in its union (BlockFFN paper, Sec. 3.3 and its
decode kernels), in one launch into a float32 output that starts at zero or at the block's
residual.

As in the official kernels (thunlp/BlockFFN ``inference/``), the weights are wgmma's M operand
and the chunk its N: the products are computed transposed, ``h^T = W^T x^T``, so the chunk is
computed as a multiple of 8 rows (wgmma's N step), not the 64 rows of an M operand, and a
step's copy of the chunk is ``rows x bK`` beside the weights' ``bK x bF``. The rows past the
chunk's ``n`` are TMA's zero-filled out-of-bounds reads of ``x`` itself (no padded copy); a
column of a product depends on its own token's column only, so they never reach the chunk's.

The grid is (expert ``e``, F block ``f``, split ``s``); each program is one warpgroup (a
tuned configuration may split each (expert, F block) over the model width in ``splits``
programs, :func:`d_splits`: each computes the up-projection and the down-projection of its
``D / splits`` columns, so a small union keeps more SMs busy; default one):

1. **Membership.** ``e`` is a member when a token of the chunk gives it a nonzero combine
   weight: a program reads its expert's ``n`` weights (scalar loads of ``a [n, E]``) and a
   non-member's exits there, so the weights read are the members' only, each once. The
   combine weights are zero outside the chunk's activity (every caller's contract), so the
   members are the union's experts that contribute; one whose weights are all zero adds
   exactly nothing to ``y = sum_e a[:, e] E_e(x)`` and is skipped too. Nothing runs before
   the kernel to find them, and the weights the up-projection's output is scaled by are the
   same scalars, placed in the accumulator's column layout.
2. **Up-projection.** ``h^T = act(W_gate[e][:, f]^T x^T) * (W_up[e][:, f]^T x^T) * a[:, e]^T``
   (plain: ``act(W_up[e][:, f]^T x^T) * a[:, e]^T``), ``[bF, rows]``: the F block's weight
   columns (a transposed view of the ``[bK, bF]`` block) times the chunk's, pipelined over D in
   ``bK`` steps (TMA copies into swizzled shared memory, wgmma into float32 accumulators; the
   block sizes: :func:`blocks`). ``h`` goes to shared memory in the weights' dtype, as the jnp
   oracle casts it, stored through a transposed view as ``[rows, bF]`` (the K-major operand
   the down-projection's wgmma takes for any ``rows``).
3. **Down-projection.** Over D blocks (default 128): ``W_down[e][f, d]^T h^T`` by wgmma
   (``[bD, rows]``), added into the float32 output ``y [n, D]`` by TMA's reduce-add
   (``cp.reduce.async.bulk``), so the programs of all members and F blocks sum into one
   output without a second launch. The product is turned into ``y``'s orientation on its
   way to shared memory: its registers take wgmma's transposed layout (one warp shuffle:
   two neighbouring rows of a column in one thread), which stores through a transposed view
   of a ``[rows, bD]`` buffer, and the add writes that buffer's first ``n`` rows (TMA drops
   the rows past the output's end, as it zero-fills them on the way in). The products are
   staged for the add in two alternating shared-memory buffers, so a block's product waits
   only for the add issued two blocks before it, not for the last one.

**L2 prefetch** (a tuned option, :data:`moejax.kernels.tuning.L2_PREFETCH`; default none):
at its start a member's program can ask the L2 for its down-projection's weights, or for all
of its weights, in TMA prefetches (``cp.async.bulk.prefetch``, no shared memory, nothing to
wait on). A small union leaves most SMs idle and each busy one bound by the bytes its
pipelines keep in flight; a prefetch puts every byte the program will read in flight at once,
and its pipelines then copy from the L2. The values are the same either way.

Against the official design (a union kernel, then programs over (union slot, F block) and a
down-projection over D blocks) each program finds its own membership and the programs sum the
down-projection through the reduce-add; the weights read are the same (the union's, once),
with no launch but this one. Around it: the float32 output's start (the target the
reduce-adds sum into: zeros, or a decoder block's residual, whose add then is the kernel's)
and its cast to the operands' dtype, an elementwise conversion that XLA fuses into whatever
reads the output.

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
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moejax.kernels.activation_forms import kernel_activation
from moejax.kernels.chunk_union.decode import MAX_CHUNK, check_expert_weights
from moejax.kernels.mgpu import DTYPES, SMEM_BYTES, blocks_per_sm, swizzled
from moejax.kernels.tuning import DEFAULTS, config_for, is_forced
from moejax.ops.activations import activation_fn

__all__ = ["chunk_union_decode_gpu", "supports", "blocks", "l2_prefetch", "d_splits", "l2_boxes",
           "smem_bytes", "chunk_rows", "OUT_BUFFERS", "TUNED_ROWS"]

OUT_BUFFERS = 2  # the down-projection's staging buffers: a step's add overlaps the next product
TUNED_ROWS = 8  # the chunk the autotune times a configuration on (one token, or a draft of 8)
_COLUMN_LAYOUT = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column (token)


def chunk_rows(n: int) -> int:
    """The chunk's rows as the kernel computes them: ``n`` rounded up to wgmma's N step, 8."""
    return -(-n // 8) * 8


def smem_bytes(tiles, gated: bool, rows: int = 64, itemsize: int = 2) -> int:
    """Shared memory the kernel takes with ``tiles`` (:func:`blocks`) for a chunk of ``rows``
    (:func:`chunk_rows`): ``h`` and the output's staging buffers, then the larger of the two
    pipelines (they run one after the other), and their barriers."""
    bK, bF, bD, stages = tiles
    up = stages * (rows * bK + (2 if gated else 1) * bK * bF) * itemsize
    down = stages * bF * bD * itemsize
    return rows * bF * itemsize + OUT_BUFFERS * bD * rows * 4 + max(up, down) + 16 * stages


def blocks(dtype, D: int, F: int, gated: bool = False, rows: int = 64
           ) -> tuple[int, int, int, int]:
    """``(bK, bF, bD, stages)``: the up-projection's contraction step, the F block, the
    down-projection's D block and the pipeline depth for ``D`` and ``F`` on the device being
    lowered for (:func:`moejax.kernels.tuning.config_for`'s ``"decode_mgpu"``; default
    128, 64, 128 and 6: a few programs per member, each holding as many weight bytes in flight
    as shared memory allows). A configuration is tuned on plain experts and a chunk of
    :data:`TUNED_ROWS`; a gated expert's second weight block or a longer chunk takes more
    shared memory, so the call gets the deepest pipeline (at least 2 stages) that keeps as
    many programs resident per SM as the tuned one had (two programs of 4 stages become two
    of 3 rather than one of 4: the SM keeps the bytes in flight of both), else the deepest
    that fits (:data:`SMEM_BYTES`), else the default's. A :func:`forced` one (an autotune
    candidate) is lowered as given."""
    c = config_for("decode_mgpu", dtype, D, F)
    if is_forced():
        return c.tm, c.tk, c.tn, c.num_stages
    size = jnp.dtype(dtype).itemsize
    for cand in (c, DEFAULTS[("decode_mgpu", jnp.dtype(dtype).name)]):
        tiles = _fitted((cand.tm, cand.tk, cand.tn, cand.num_stages), gated, rows, size)
        if tiles is not None:
            return tiles
    return (cand.tm, cand.tk, cand.tn, 2)


def _fitted(tiles, gated: bool, rows: int, size: int):
    """``tiles`` with the most stages (at most theirs, at least 2) that fit and keep the
    programs per SM the tiles had on :data:`TUNED_ROWS` rows of plain experts; else the most
    that fit; None when none does."""
    resident = blocks_per_sm(smem_bytes(tiles, False, TUNED_ROWS, size))
    fit = [t for t in ((*tiles[:3], s) for s in range(tiles[3], 1, -1))
           if smem_bytes(t, gated, rows, size) <= SMEM_BYTES]
    keep = [t for t in fit if blocks_per_sm(smem_bytes(t, gated, rows, size)) >= resident]
    return (keep or fit or [None])[0]


def l2_prefetch(dtype, D: int, F: int) -> int:
    """Which weights a member's program prefetches into the L2 at its start, as an index of
    :data:`moejax.kernels.tuning.L2_PREFETCH` (0 none, 1 the down-projection's, 2 all), for
    ``D`` and ``F`` on the device being lowered for (a :func:`forced` configuration's, else
    the tuned one's, else none)."""
    return config_for("decode_mgpu", dtype, D, F).l2_prefetch


def d_splits(dtype, D: int, F: int, gated: bool = False, rows: int = TUNED_ROWS) -> int:
    """In how many programs each (expert, F block) is split over the model width ``D``: each
    computes the F block's up-projection (the same weights: the first program's read brings
    them to the L2 for the others) and the down-projection for its ``D / splits`` columns,
    so a small union keeps ``splits`` times the SMs busy. The configuration's (forced, tuned,
    else 1), or 1 where ``D`` is no whole number of its D blocks per program."""
    splits = config_for("decode_mgpu", dtype, D, F).d_splits
    bD = blocks(dtype, D, F, gated, rows)[2]
    return splits if splits >= 1 and D % (bD * splits) == 0 else 1


def l2_boxes(rows: tuple, cols: tuple, box: int, along: int) -> list[tuple[tuple, tuple]]:
    """The block ``[rows, cols]`` (each a ``(start, size)``) cut along axis ``along`` into
    ``box``-long pieces, ``(rows, cols)`` each: one TMA prefetch apiece (a TMA box is at most
    256 elements a side; the block's other side is an F block, at most 256 too)."""
    span = (rows, cols)[along]
    if span[1] % box:
        raise ValueError(f"a side of {span[1]} is no whole number of {box}-long boxes")
    parts = [(span[0] + i * box, box) for i in range(span[1] // box)]
    return [(p, cols) if along == 0 else (rows, p) for p in parts]


def _prefetch_to_l2(w_g, rows: tuple, cols: tuple, box: int, along: int):
    """Ask the L2 for ``w_g[rows, cols]``, :func:`l2_boxes` at a time."""
    for r, c in l2_boxes(rows, cols, box, along):
        plgpu.async_prefetch(w_g.at[pl.ds(*r), pl.ds(*c)])


def supports(x_nD, w_up, w_gate=None) -> bool:
    """Whether the kernel takes this chunk: 1 to 64 tokens, bf16 / f16 operands, ``D`` and
    ``F`` whole multiples of the blocks (default: ``D`` of 128, ``F`` of 64)."""
    n, D = x_nD.shape
    if not (1 <= n <= MAX_CHUNK and any(x_nD.dtype == d for d in DTYPES)):
        return False
    bK, bF, bD, _ = blocks(x_nD.dtype, D, w_up.shape[-1], w_gate is not None, chunk_rows(n))
    return D % bD == 0 and D % bK == 0 and w_up.shape[-1] % bF == 0


def _body(x_g, a_g, wu_g, wd_g, *rest, rows, activation, gated, interpret, tiles, prefetch,
          splits):
    wg_g, y_g, h_smem, o_smem = rest if gated else (None, *rest)
    bK, bF, bD, stages = tiles
    D = x_g.shape[1]
    dt = x_g.dtype
    e, f, s = (jax.lax.axis_index(a) for a in ("e", "f", "s"))
    # the chunk's rows are read as a block of ``rows``: the ones past ``n`` are TMA's
    # zero-filled out-of-bounds reads (no padded copy of x). Their start is the program's
    # index times 0, a dynamic 0: a static start is checked against ``n`` when traced
    row0 = e * 0
    blocks_s = D // bD // splits  # the down-projection's D blocks in each program
    box = math.gcd(D, 256)

    def spec(shape, index, what):
        return plgpu.BlockSpec(shape, index, transforms=swizzled(shape, dt, what),
                               delay_release=1)

    # the expert's combine weight for each of the chunk's tokens, as scalars: e is a member
    # when one is nonzero
    a_n = [a_g[j, e].astype(jnp.float32) for j in range(a_g.shape[0])]
    member = functools.reduce(jnp.logical_or, [a != 0 for a in a_n])

    @pl.when(member)
    def _():
        if prefetch == 2:  # all: the up-projection's columns (and the gate's), then the down
            @pl.when(s == 0)  # the split programs read the same up-projection weights
            def _():
                for w_g in (wu_g,) + ((wg_g,) if gated else ()):
                    _prefetch_to_l2(w_g.at[e], (0, D), (f * bF, bF), box, along=0)
        if prefetch >= 1:
            _prefetch_to_l2(wd_g.at[e], (f * bF, bF), (s * blocks_s * bD, blocks_s * bD),
                            math.gcd(blocks_s * bD, 256), along=1)

        def up(*accs):
            def step(_, x_s, *w_s):
                for acc, w in zip(accs, w_s):
                    plgpu.wgmma(acc, w.T, x_s.T)  # [bF, bK] x [bK, rows]
                plgpu.wgmma_wait(len(accs))

            w_spec = spec((bK, bF), lambda k: (k, f), "w")
            weights = (wu_g.at[e],) + ((wg_g.at[e],) if gated else ())
            plgpu.emit_pipeline(step, grid=(D // bK,),
                                in_specs=(spec((rows, bK), lambda k: (row0, k), "x"),
                                          *[w_spec] * len(weights)),
                                max_concurrent_steps=stages)(x_g, *weights)
            return tuple(acc[...] for acc in accs)

        accs = pl.run_scoped(up, *[plgpu.ACC((bF, rows))] * (2 if gated else 1))
        act = kernel_activation(activation)
        h = act(accs[1]) * accs[0] if gated else act(accs[0])
        token = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=_COLUMN_LAYOUT)
        a_row = functools.reduce(lambda row, j: jnp.where(token == j, a_n[j], row),
                                 range(1, len(a_n)), jnp.where(token == 0, a_n[0], 0.0))
        h_smem.T[...] = (h * a_row[None, :]).astype(dt)
        plgpu.commit_smem()

        def down(idx, wd_s):
            i = idx[0]
            d = s * blocks_s + i
            out = pl.run_scoped(  # [bD, bF] x [bF, rows]
                lambda acc: (plgpu.wgmma(acc, wd_s.T, h_smem.T), acc[...])[1],
                plgpu.ACC((bD, rows)))
            # the add issued two steps ago, from the same buffer, has read it; the last one
            # may still be reading the other
            plgpu.wait_smem_to_gmem(OUT_BUFFERS - 1, wait_read_only=True)
            buf = o_smem.at[i % OUT_BUFFERS]  # [rows, bD]: y's orientation
            buf.T[...] = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            if interpret:  # the interpreter checks bounds: the chunk's n rows only
                dst = y_g.at[:, pl.ds(d * bD, bD)]
                dst[...] = dst[...] + buf[:y_g.shape[0]]
            else:  # TMA drops the rows past n (the dynamic row start, as for x's reads)
                dst = y_g.at[pl.ds(row0, rows), pl.ds(d * bD, bD)]
                plgpu.copy_smem_to_gmem(buf, dst, reduction_op="add")

        plgpu.emit_pipeline(down, grid=(blocks_s,),
                            in_specs=(plgpu.BlockSpec((bF, bD), lambda d: (f, s * blocks_s + d),
                                                      transforms=swizzled((bF, bD), dt, "wd")),),
                            max_concurrent_steps=stages)(wd_g.at[e])
        plgpu.wait_smem_to_gmem(0)


def chunk_union_decode_gpu(x_nD, a_nE, active_nE, w_up, w_down, w_gate=None, *,
                           activation: str, interpret: bool = False, residual_nD=None):
    """``y [n, D]`` in ``x``'s dtype: the chunk's expert output through its members' weights
    only (module docstring); equals
    :func:`moejax.kernels.chunk_union.reference.dense_experts` of ``a`` (``active``, whose
    union holds every member, is checked for its shape: the members are read from ``a``).

    ``residual_nD`` (``[n, D]``): ``residual + y`` instead, rounded once to the residual's
    dtype. The float32 output the reduce-adds sum into starts from the residual rather than
    from zeros, so a decoder block's residual add is the kernel's own and nothing but
    conversions surrounds the launch."""
    n, D = x_nD.shape
    E = a_nE.shape[-1]
    if a_nE.shape != (n, E) or active_nE.shape != (n, E):
        raise ValueError(f"a {a_nE.shape} and active {active_nE.shape} must be {(n, E)}")
    if residual_nD is not None and residual_nD.shape != (n, D):
        raise ValueError(f"the residual {tuple(residual_nD.shape)} must be x's {(n, D)}")
    check_expert_weights(x_nD.shape, E, w_up, w_down, w_gate)
    activation_fn(activation)  # an unknown name fails here, before any lowering
    if not supports(x_nD, w_up, w_gate):
        raise ValueError(f"chunk_union_decode_gpu takes 1 to {MAX_CHUNK} tokens of bfloat16 "
                         f"or float16 with D and F whole multiples of its blocks; got "
                         f"x {tuple(x_nD.shape)} {x_nD.dtype}, F {w_up.shape[-1]} (other "
                         f"chunks: chunk_union_auto's pair kernels)")
    rows = chunk_rows(n)
    tiles = blocks(x_nD.dtype, D, w_up.shape[-1], w_gate is not None, rows)
    prefetch = l2_prefetch(x_nD.dtype, D, w_up.shape[-1])
    splits = d_splits(x_nD.dtype, D, w_up.shape[-1], w_gate is not None, rows)
    bF, bD = tiles[1], tiles[2]
    dt = x_nD.dtype
    gated = w_gate is not None
    weights = [w.astype(dt) for w in (w_up, w_down) + ((w_gate,) if gated else ())]
    kernel = plgpu.kernel(
        functools.partial(_body, rows=rows, activation=activation, gated=gated,
                          interpret=interpret, tiles=tiles, prefetch=prefetch, splits=splits),
        out_type=(), grid=(E, w_up.shape[-1] // bF, splits), grid_names=("e", "f", "s"),
        kernel_name="moejax_chunk_union_decode",
        scratch_types=[plgpu.SMEM((rows, bF), dt, transforms=swizzled((rows, bF), dt, "h")),
                       plgpu.SMEM((OUT_BUFFERS, rows, bD), jnp.float32,
                                  transforms=swizzled((rows, bD), jnp.float32, "y"))],
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    y = jax.new_ref(jnp.zeros((n, D), jnp.float32) if residual_nD is None  # what the
                    else residual_nD.astype(jnp.float32))  # reduce-adds sum into
    a = a_nE if any(a_nE.dtype == d for d in (jnp.float32, *DTYPES)) else a_nE.astype(jnp.float32)
    kernel(x_nD, a, *weights[:2], *weights[2:], y)
    out_dtype = dt if residual_nD is None else residual_nD.dtype
    return y[...].astype(out_dtype)  # elementwise: fused into the output's reader
