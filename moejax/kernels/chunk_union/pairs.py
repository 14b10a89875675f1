"""Matmuls over (token tile, expert) pairs as Pallas kernels: the products of BlockFFN's
chunk-union computation (:mod:`moejax.kernels.chunk_union.pallas`), forward and backward.

Tokens come in tiles ``xs [S, n, K]`` (``S`` tiles of ``n`` rows). Tile ``s`` has a union of
``count_s`` experts; pair ``p = s U + j`` is tile ``s`` with its ``j``-th union member
``e_p`` (pairs are tile-major; a pair with ``j >= count_s`` is empty). Three products:

* :func:`pair_up` ``[P, n, N]``: ``out_p = xs[s_p] w[e_p]`` (``w[e_p]^T`` with ``transpose``),
  0 for an empty pair. The up-projection; ``dh = dy W_down^T`` in the backward.
* :func:`pair_down` ``[S, n, N]``: ``y_s = sum_{j < count_s} h_{sU+j} w[e_{sU+j}]``. The
  down-projection summed over the union; ``dx = dpre W_up^T`` in the backward.
* :func:`pair_wgrad` ``[E, K, N]``: ``dW[e] = sum over the pairs of e of l^T r``, with ``l``
  and ``r`` each indexed by pair or by tile (``dW_down = h^T dy``, ``dW_up = x^T dpre``); 0 for
  an expert in no union.

Each kernel is tiled over rows, output columns and the contraction, so a program holds a few
small blocks whatever ``n``, ``K`` and ``N`` are, and reads only the weight blocks of the
experts its pairs name. Per platform, chosen when the function is traced for it
(:func:`moejax.kernels.tiling.choose_platform`):

* TPU: Mosaic with scalar-prefetched pair tables: the weight BlockSpecs' index maps read the
  pair's expert, so only its blocks are copied to VMEM; empty pairs repeat the previous
  block index (no copy) and skip the matmul; f32 accumulators in VMEM scratch. ``pair_wgrad``
  walks the pairs sorted by expert and writes an expert's block when its run ends.
* GPU: on a Hopper GPU with bf16 / f16 operands, Mosaic GPU
  (:mod:`moejax.kernels.chunk_union.pairs_gpu`: TMA-pipelined blocks, wgmma); otherwise
  (float32, older GPUs) Triton (:mod:`moejax.kernels.chunk_union.pairs_triton`), kept while
  jax still has Pallas Triton (without it, the TPU kernels interpreted: correct and slow; the
  BlockFFN layer's ``auto`` then takes the jnp path). Rows and columns are zero-padded to the
  kernels' blocks.
* CPU: the TPU kernels in Pallas interpret mode (for tests); ``interpret="mosaic_gpu"``
  runs the Mosaic GPU kernels in Mosaic GPU's interpreter instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moejax.kernels.chunk_union.pairs_gpu import mgpu_down, mgpu_up, mgpu_wgrad
from moejax.kernels.chunk_union.pairs_triton import AVAILABLE as TRITON_AVAILABLE
from moejax.kernels.chunk_union.pairs_triton import triton_down, triton_up, triton_wgrad
from moejax.kernels.mgpu import DTYPES as MGPU_DTYPES
from moejax.kernels.tiling import block, choose_platform, hopper_target, pad_to, pow2
from moejax.kernels.tuning import config_for

__all__ = ["UnionPairs", "union_pairs", "pair_up", "pair_down", "pair_wgrad", "PAIR_TILES",
           "GPU_INTERPRET", "gpu_kernels_take"]

# ``interpret=GPU_INTERPRET``: the GPU's Mosaic GPU kernels in Mosaic GPU's interpreter (tests);
# ``interpret=True``: the TPU kernels in Pallas interpret mode
GPU_INTERPRET = "mosaic_gpu"

# Blocks (rows, contraction, output columns) per kernel family. TPU: 128-multiples for the
# MXU, rows up to 256 per block (a few (256, 128) f32 blocks: well inside the scoped VMEM).
# GPU: powers of two for ``tl.dot``; x, w and accumulator blocks of a program stay under
# 40 KiB of f32 with two pipeline stages.
PAIR_TILES = {"tpu": (256, 128, 128), "gpu": (64, 32, 64)}


class UnionPairs(NamedTuple):
    """The (tile, expert) pair tables, int32. Pairs ``[P = S U]``: ``src`` tile, ``expert``,
    ``fetch`` (the expert whose weights to load: past a tile's union, its last member's, so
    no new copy), ``valid`` (0/1). Per tile ``count [S]``. Sorted by expert (empty pairs last)
    for the weight gradient: ``order [P]``, ``sorted_expert [P]`` (empty pairs: the last
    expert that has pairs), ``first`` / ``last`` (0/1: the pair starts / ends its expert's
    run), ``start [E]`` and ``pairs_per_expert [E]``."""

    src: jax.Array
    expert: jax.Array
    fetch: jax.Array
    valid: jax.Array
    count: jax.Array
    order: jax.Array
    sorted_expert: jax.Array
    first: jax.Array
    last: jax.Array
    start: jax.Array
    pairs_per_expert: jax.Array


def union_pairs(ids_SU, count_S, n_experts: int) -> UnionPairs:
    """Pair tables for tiles whose union members are ``ids_SU[s, :count_S[s]]``."""
    S, U = ids_SU.shape
    E = n_experts
    j_SU = jnp.arange(U, dtype=jnp.int32)[None, :]
    valid_SU = j_SU < count_S[:, None]
    last_j = jnp.clip(count_S - 1, 0, U - 1)[:, None]
    fetch_SU = jnp.take_along_axis(ids_SU, jnp.minimum(j_SU, last_j), axis=1)
    src = jnp.repeat(jnp.arange(S, dtype=jnp.int32), U)
    expert, valid = ids_SU.reshape(-1).astype(jnp.int32), valid_SU.reshape(-1)
    key = jnp.where(valid, expert, E)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    key_sorted = key[order]
    n_valid = jnp.sum(valid.astype(jnp.int32))
    last_expert = jnp.where(n_valid > 0, key_sorted[jnp.maximum(n_valid - 1, 0)], 0)
    sorted_expert = jnp.where(key_sorted < E, key_sorted, last_expert).astype(jnp.int32)
    nxt = jnp.concatenate([sorted_expert[1:], jnp.full((1,), -1, jnp.int32)])
    prv = jnp.concatenate([jnp.full((1,), -1, jnp.int32), sorted_expert[:-1]])
    per_expert = jnp.zeros((E,), jnp.int32).at[expert].add(valid.astype(jnp.int32))
    start = (jnp.cumsum(per_expert) - per_expert).astype(jnp.int32)
    return UnionPairs(src, expert, fetch_SU.reshape(-1).astype(jnp.int32),
                      valid.astype(jnp.int32), count_S.astype(jnp.int32), order, sorted_expert,
                      (sorted_expert != prv).astype(jnp.int32),
                      (sorted_expert != nxt).astype(jnp.int32), start, per_expert)


def _dims(transpose: bool):
    return (((1,), (1,)), ((), ())) if transpose else (((1,), (0,)), ((), ()))


def _w_spec(tr, to, transpose, index):
    """Weight block ``[1, tr, to]`` (``[1, to, tr]`` transposed) of the expert ``index``."""
    if transpose:
        return pl.BlockSpec((1, to, tr), lambda *a: (index(*a), a[2], a[3]))
    return pl.BlockSpec((1, tr, to), lambda *a: (index(*a), a[3], a[2]))


def _out_cols(w, transpose):
    return w.shape[1] if transpose else w.shape[2]


def _pad_w(w, tr, to, transpose):
    return pad_to(pad_to(w, 2 if transpose else 1, tr), 1 if transpose else 2, to)


# -- TPU (Mosaic) and interpret mode -------------------------------------------------------------
def _mosaic_up_kernel(src_ref, fetch_ref, valid_ref, x_ref, w_ref, o_ref, acc_ref, *,
                      transpose):
    p, r = pl.program_id(0), pl.program_id(3)

    @pl.when(r == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(valid_ref[p] == 1)
    def _():
        acc_ref[...] += jax.lax.dot_general(x_ref[0], w_ref[0], _dims(transpose),
                                            preferred_element_type=jnp.float32)

    @pl.when(r == pl.num_programs(3) - 1)
    def _():
        o_ref[0] = acc_ref[...].astype(o_ref.dtype)


def _mosaic_up(xs, w, pairs, tiles, transpose, interpret):
    tm, tr, to = tiles
    P, n = pairs.src.shape[0], xs.shape[1]
    grid = (P, n // tm, _out_cols(w, transpose) // to, xs.shape[2] // tr)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid,
        in_specs=[pl.BlockSpec((1, tm, tr), lambda p, m, o, r, s, f, v: (s[p], m, r)),
                  _w_spec(tr, to, transpose, lambda p, m, o, r, s, f, v: f[p])],
        out_specs=pl.BlockSpec((1, tm, to), lambda p, m, o, r, s, f, v: (p, m, o)),
        scratch_shapes=[pltpu.VMEM((tm, to), jnp.float32)])
    return pl.pallas_call(
        functools.partial(_mosaic_up_kernel, transpose=transpose),
        out_shape=jax.ShapeDtypeStruct((P, n, grid[2] * to), xs.dtype), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(pairs.src, pairs.fetch, pairs.valid, xs, w)


def _mosaic_down_kernel(fetch_ref, count_ref, h_ref, w_ref, o_ref, acc_ref, *, transpose):
    s, j, r = pl.program_id(0), pl.program_id(3), pl.program_id(4)

    @pl.when((j == 0) & (r == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j < count_ref[s])
    def _():
        acc_ref[...] += jax.lax.dot_general(h_ref[0], w_ref[0], _dims(transpose),
                                            preferred_element_type=jnp.float32)

    @pl.when((j == pl.num_programs(3) - 1) & (r == pl.num_programs(4) - 1))
    def _():
        o_ref[0] = acc_ref[...].astype(o_ref.dtype)


def _mosaic_down(h, w, pairs, U, tiles, transpose, interpret):
    tm, tr, to = tiles
    S, n = pairs.count.shape[0], h.shape[1]

    def pair(s, j, cnt):  # past the union: stay on the last member (no new copy)
        return s * U + jnp.clip(jnp.minimum(j, cnt[s] - 1), 0, U - 1)

    grid = (S, n // tm, _out_cols(w, transpose) // to, U, h.shape[2] // tr)
    # the weight index map sees (s, m, o, j, r, fetch, count); _w_spec wants (.., o, r) at 2, 3
    if transpose:
        w_spec = pl.BlockSpec((1, to, tr), lambda s, m, o, j, r, f, c: (f[pair(s, j, c)], o, r))
    else:
        w_spec = pl.BlockSpec((1, tr, to), lambda s, m, o, j, r, f, c: (f[pair(s, j, c)], r, o))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid,
        in_specs=[pl.BlockSpec((1, tm, tr), lambda s, m, o, j, r, f, c: (pair(s, j, c), m, r)),
                  w_spec],
        out_specs=pl.BlockSpec((1, tm, to), lambda s, m, o, j, r, f, c: (s, m, o)),
        scratch_shapes=[pltpu.VMEM((tm, to), jnp.float32)])
    return pl.pallas_call(
        functools.partial(_mosaic_down_kernel, transpose=transpose),
        out_shape=jax.ShapeDtypeStruct((S, n, grid[2] * to), h.dtype), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(pairs.fetch, pairs.count, h, w)


def _mosaic_wgrad_kernel(lrow_ref, rrow_ref, exp_ref, valid_ref, first_ref, last_ref, l_ref,
                         r_ref, o_ref, acc_ref):
    q, m = pl.program_id(2), pl.program_id(3)

    @pl.when((first_ref[q] == 1) & (m == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(valid_ref[q] == 1)
    def _():
        acc_ref[...] += jax.lax.dot_general(l_ref[0], r_ref[0], (((0,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)

    @pl.when((last_ref[q] == 1) & (m == pl.num_programs(3) - 1))
    def _():
        o_ref[0] = acc_ref[...].astype(o_ref.dtype)


def _mosaic_wgrad(lhs, lrow, rhs, rrow, pairs, valid_sorted, E, tiles, interpret):
    tm, tk, tn = tiles
    Q, n = lrow.shape[0], lhs.shape[1]
    grid = (lhs.shape[2] // tk, rhs.shape[2] // tn, Q, n // tm)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6, grid=grid,
        in_specs=[pl.BlockSpec((1, tm, tk), lambda k, c, q, m, lr, rr, *_: (lr[q], m, k)),
                  pl.BlockSpec((1, tm, tn), lambda k, c, q, m, lr, rr, *_: (rr[q], m, c))],
        out_specs=pl.BlockSpec((1, tk, tn), lambda k, c, q, m, lr, rr, e, *_: (e[q], k, c)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
    return pl.pallas_call(
        _mosaic_wgrad_kernel,
        out_shape=jax.ShapeDtypeStruct((E, lhs.shape[2], rhs.shape[2]), lhs.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(lrow, rrow, pairs.sorted_expert, valid_sorted, pairs.first, pairs.last, lhs, rhs)


# -- tiles per platform and the public products ---------------------------------------------------
def _tiles(platform: str, n: int, R: int, n_out: int, dtype):
    """``(tm, tr, to)`` for ``n`` rows, contraction ``R``, output ``n_out`` (Mosaic GPU:
    ``(tm, tr, to, stages)`` from :func:`moejax.kernels.tuning.config_for`)."""
    if platform == "mgpu":
        c = config_for("pairs_mgpu", dtype, R, n_out)
        return c.tm, c.tk, c.tn, c.num_stages
    tm_pref, tr_pref, to_pref = PAIR_TILES[platform]
    if platform == "gpu":
        n_p = pow2(n, 16)
        return (min(n_p, tm_pref), min(pow2(R, 16), tr_pref), min(pow2(n_out, 16), to_pref))
    return (block(n, tm_pref), block(R, tr_pref), block(n_out, to_pref))


def _blocked(platform: str, a, tm: int, tc: int):
    """``a [rows, n, C]`` zero-padded to whole blocks: ``n`` to a multiple of ``tm`` (on GPU
    first to a power of two of at least 16, as ``tl.dot`` needs) and ``C`` of ``tc``."""
    if platform == "gpu":
        a = pad_to(a, 1, pow2(a.shape[1], 16))
    return pad_to(pad_to(a, 1, tm), 2, tc)


def _check(a, w, transpose, what):
    R = w.shape[2] if transpose else w.shape[1]
    if a.ndim != 3 or w.ndim != 3 or a.shape[2] != R:
        raise ValueError(f"{what}: operand {a.shape} must be [rows, n, {R}] for weights "
                         f"{w.shape}{' (transposed)' if transpose else ''}")


def _gpu_backend(dtype) -> str:
    """``"mgpu"`` (the Mosaic GPU kernels) on a Hopper GPU with bf16 / f16 operands, else
    ``"gpu"`` (Triton), or ``"tpu"`` where jax no longer ships Pallas Triton: the TPU
    kernels in interpret mode, correct and slow (:func:`gpu_kernels_take` tells callers
    with a faster path to take it instead)."""
    if hopper_target() and any(dtype == d for d in MGPU_DTYPES):
        return "mgpu"
    return "gpu" if TRITON_AVAILABLE else "tpu"


def gpu_kernels_take(dtype) -> bool:
    """Whether a GPU runs the pair products of ``dtype`` as compiled kernels (Mosaic GPU, or
    Triton while jax ships it), not interpreted."""
    return _gpu_backend(dtype) != "tpu"


def _weight_product(a_InR, w, pairs, transpose, interpret, what, mosaic_call, gpu_calls):
    """Run a pair product of ``a [rows, n, R]`` with ``w`` on the platform's kernel: operands
    padded to whole blocks, the result cut back to ``[:, :n, :n_out]``."""
    _check(a_InR, w, transpose, what)
    n, R = a_InR.shape[1:]
    n_out = _out_cols(w, transpose)

    def kernel(platform, call):
        tiles = _tiles(platform, n, R, n_out, a_InR.dtype)
        tm, tr, to = tiles[:3]

        def run(a, w, *tables):
            out = call(_blocked(platform, a, tm, tr), _pad_w(w, tr, to, transpose),
                       UnionPairs(*tables), tiles)
            return out[:, :n, :n_out]
        return run

    if interpret == GPU_INTERPRET:
        return kernel("mgpu", functools.partial(gpu_calls["mgpu"], interpret=True))(
            a_InR, w.astype(a_InR.dtype), *pairs)
    gpu = _gpu_backend(a_InR.dtype)
    gpu_call = mosaic_call(True) if gpu == "tpu" else gpu_calls[gpu]
    return choose_platform((a_InR, w.astype(a_InR.dtype), *pairs),
                           mosaic=lambda interp: kernel("tpu", mosaic_call(interp)),
                           triton=kernel(gpu, gpu_call), interpret=interpret)


def pair_up(xs_SnK, w_EKN, pairs: UnionPairs, *, transpose: bool = False,
            interpret: bool = False):
    """``[P, n, N]``: ``xs[src_p] w[e_p]`` (``w[e_p]^T`` with ``transpose``), 0 when empty."""
    return _weight_product(
        xs_SnK, w_EKN, pairs, transpose, interpret, "pair_up",
        lambda interp: lambda x, w, p, t: _mosaic_up(x, w, p, t, transpose, interp),
        {"mgpu": lambda x, w, p, t, **kw: mgpu_up(x, w, p, t, transpose, **kw),
         "gpu": lambda x, w, p, t: triton_up(x, w, p, t, transpose)})


def pair_down(h_PnK, w_EKN, pairs: UnionPairs, *, transpose: bool = False,
              interpret: bool = False):
    """``[S, n, N]``: ``y_s = sum_{j < count_s} h_{sU+j} w[e_{sU+j}]`` (``w^T`` with
    ``transpose``)."""
    U = pairs.src.shape[0] // pairs.count.shape[0]
    return _weight_product(
        h_PnK, w_EKN, pairs, transpose, interpret, "pair_down",
        lambda interp: lambda h, w, p, t: _mosaic_down(h, w, p, U, t, transpose, interp),
        {"mgpu": lambda h, w, p, t, **kw: mgpu_down(h, w, p, U, t, transpose, **kw),
         "gpu": lambda h, w, p, t: triton_down(h, w, p, U, t, transpose)})


def pair_wgrad(l_InK, r_JnN, pairs: UnionPairs, n_experts: int, *, l_by: str, r_by: str,
               interpret: bool = False):
    """``[E, K, N]``: ``dW[e] = sum over the pairs p of e of l[i_p]^T r[i_p]``, where ``l_by``
    / ``r_by`` say whether an operand is indexed by ``"pair"`` (``p``) or ``"tile"`` (the
    pair's tile); 0 for an expert in no union."""
    for name, by in (("l_by", l_by), ("r_by", r_by)):
        if by not in ("pair", "tile"):
            raise ValueError(f"pair_wgrad: {name}={by!r} must be 'pair' or 'tile'")
    if l_InK.ndim != 3 or r_JnN.ndim != 3 or l_InK.shape[1] != r_JnN.shape[1]:
        raise ValueError(f"pair_wgrad: operands {l_InK.shape} and {r_JnN.shape} must be "
                         "[rows, n, K] and [rows, n, N] with the same n")
    n, K, N = l_InK.shape[1], l_InK.shape[2], r_JnN.shape[2]
    E = n_experts
    r_JnN = r_JnN.astype(l_InK.dtype)

    def rows_of(by, order, src):
        return order if by == "pair" else src[order]

    def kernel(platform, call):
        tiles = _tiles(platform, n, K, N, l_InK.dtype)
        tm, tk, tn = tiles[:3]

        def run(lhs, rhs, *tables):
            pairs_ = UnionPairs(*tables)
            lq, rq = _blocked(platform, lhs, tm, tk), _blocked(platform, rhs, tm, tn)
            order = pairs_.order
            if platform == "tpu":  # empty pairs (sorted last) re-read the last valid pair
                n_valid = jnp.sum(pairs_.valid)
                order = order[jnp.minimum(jnp.arange(order.shape[0]),
                                          jnp.maximum(n_valid - 1, 0))]
            lrow = rows_of(l_by, order, pairs_.src)
            rrow = rows_of(r_by, order, pairs_.src)
            dw = call(lq, lrow, rq, rrow, pairs_, tiles)[:, :K, :N]
            return jnp.where(pairs_.pairs_per_expert[:, None, None] > 0, dw, 0)
        return run

    def mosaic(interp):
        def call(lq, lrow, rq, rrow, p, t):
            valid_sorted = p.valid[p.order]
            return _mosaic_wgrad(lq, lrow, rq, rrow, p, valid_sorted, E, t, interp)
        return kernel("tpu", call)

    if interpret == GPU_INTERPRET:
        return kernel("mgpu", lambda lq, lrow, rq, rrow, p, t: mgpu_wgrad(
            lq, lrow, rq, rrow, p, E, t, interpret=True))(l_InK, r_JnN, *pairs)
    gpu = _gpu_backend(l_InK.dtype)
    gpu_call = mgpu_wgrad if gpu == "mgpu" else triton_wgrad
    gpu_kernel = mosaic(True) if gpu == "tpu" else kernel(
        gpu, lambda lq, lrow, rq, rrow, p, t: gpu_call(lq, lrow, rq, rrow, p, E, t))
    return choose_platform((l_InK, r_JnN, *pairs), mosaic=mosaic, triton=gpu_kernel,
                           interpret=interpret)
