"""The (tile, expert) pair products of :mod:`moejax.kernels.chunk_union.pairs` as Pallas Mosaic GPU
kernels for Hopper (wgmma; bf16 / f16 operands), the GPU backend that replaces Triton there.

Same products, tables and padding contract as the Triton kernels (operands arrive padded to
whole blocks; :func:`moejax.kernels.chunk_union.pairs.pair_up` and friends choose and pad):

* :func:`mgpu_up` ``[P, n, N]``: program (pair, row block, column block) pipelines the
  contraction through TMA copies of the pair's tile rows and its expert's weight block into
  swizzled shared memory, wgmma into a float32 accumulator; an empty pair writes zeros and
  reads no weights.
* :func:`mgpu_down` ``[S, n, N]``: program (tile, row block, column block) pipelines over the
  tile's union members and the contraction (``count_s x R / tr`` steps, a dynamic grid), each
  step's expert read from the pair table in its block index.
* :func:`mgpu_wgrad` ``[E, K, N]``: program (expert, K block, N block) pipelines over the
  expert's pairs (sorted by expert) and their row blocks, ``l^T r`` through wgmma's
  transposed left operand.

Transposed weights (the backward's ``W^T``) are read as stored and given to wgmma as a
transposed shared-memory view, never materialised. ``tiles`` is ``(rows, contraction,
output columns, pipeline stages)`` (:func:`moejax.kernels.tuning.config_for`'s
``"pairs_mgpu"``; rows a multiple of 64, wgmma's M).
``interpret=True`` runs the kernels in Mosaic GPU's interpreter on the CPU (for tests).
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moejax.kernels.mgpu import block_spec as _spec
from moejax.kernels.mgpu import mgpu_kernel as _kernel
from moejax.kernels.mgpu import mma as _mma
from moejax.kernels.mgpu import store_block as _store
from moejax.kernels.mgpu import weight_spec as _w_spec

__all__ = ["mgpu_up", "mgpu_down", "mgpu_wgrad"]


def mgpu_up(xs, w, pairs, tiles, transpose: bool, interpret: bool = False):
    """``[P, n, N]``: ``xs[src_p] w[e_p]`` (``w^T`` with ``transpose``), 0 for an empty pair."""
    tm, tr, to, stages = tiles
    P, n, K = pairs.src.shape[0], xs.shape[1], xs.shape[2]
    n_out = w.shape[1] if transpose else w.shape[2]
    dt = xs.dtype

    def body(src_g, exp_g, valid_g, x_g, w_g, o_g):
        p, m, o = (jax.lax.axis_index(a) for a in ("p", "m", "o"))
        s, e = src_g[p], exp_g[p]

        def product(acc):
            @pl.when(valid_g[p] > 0)
            def _():
                plgpu.emit_pipeline(
                    lambda _, x_s, w_s: _mma(acc, x_s, w_s, transpose), grid=(K // tr,),
                    in_specs=(_spec((None, tm, tr), lambda r: (s, m, r), dt, "x"),
                              _w_spec(tr, to, transpose, dt, lambda r: e, o)),
                    max_concurrent_steps=stages)(x_g, w_g)
            return acc[...]

        acc = pl.run_scoped(product, plgpu.ACC((tm, to)))
        _store(acc, o_g, (p, pl.ds(m * tm, tm), pl.ds(o * to, to)), dt)

    return _kernel(body, ((P, n, n_out), dt), (P, n // tm, n_out // to), ("p", "m", "o"),
                   interpret, "moejax_pairs_up")(pairs.src, pairs.expert, pairs.valid, xs, w)


def mgpu_down(h, w, pairs, U: int, tiles, transpose: bool, interpret: bool = False):
    """``[S, n, N]``: ``y_s = sum_{j < count_s} h_{sU+j} w[e_{sU+j}]`` (``w^T`` with
    ``transpose``)."""
    tm, tr, to, stages = tiles
    S, n, R = pairs.count.shape[0], h.shape[1], h.shape[2]
    n_red = R // tr
    n_out = w.shape[1] if transpose else w.shape[2]
    dt = h.dtype

    def body(exp_g, count_g, h_g, w_g, o_g):
        s, m, o = (jax.lax.axis_index(a) for a in ("s", "m", "o"))
        count = count_g[s]

        def pair(i):
            return s * U + jax.lax.div(i, n_red)

        def expert(i):
            return exp_g[pair(i)]

        def product(acc):
            @pl.when(count > 0)
            def _():
                if transpose:
                    w_spec = _spec((None, to, tr),
                                   lambda i: (expert(i), o, jax.lax.rem(i, n_red)), dt, "wT")
                else:
                    w_spec = _spec((None, tr, to),
                                   lambda i: (expert(i), jax.lax.rem(i, n_red), o), dt, "w")
                plgpu.emit_pipeline(
                    lambda _, h_s, w_s: _mma(acc, h_s, w_s, transpose), grid=(count * n_red,),
                    in_specs=(_spec((None, tm, tr),
                                    lambda i: (pair(i), m, jax.lax.rem(i, n_red)), dt, "h"),
                              w_spec),
                    max_concurrent_steps=stages)(h_g, w_g)
            return acc[...]

        acc = pl.run_scoped(product, plgpu.ACC((tm, to)))
        _store(acc, o_g, (s, pl.ds(m * tm, tm), pl.ds(o * to, to)), dt)

    return _kernel(body, ((S, n, n_out), dt), (S, n // tm, n_out // to), ("s", "m", "o"),
                   interpret, "moejax_pairs_down")(pairs.expert, pairs.count, h, w)


def mgpu_wgrad(lhs, lrow, rhs, rrow, pairs, E: int, tiles, interpret: bool = False):
    """``[E, K, N]``: ``dW[e] = sum over e's pairs q and row blocks of l[lrow_q]^T r[rrow_q]``
    (pairs sorted by expert: ``pairs.start`` / ``pairs.pairs_per_expert``)."""
    tm, tk, tn, stages = tiles
    n, K, N = lhs.shape[1], lhs.shape[2], rhs.shape[2]
    n_m = n // tm
    dt = lhs.dtype

    def body(lrow_g, rrow_g, start_g, per_g, l_g, r_g, o_g):
        e, k, c = (jax.lax.axis_index(a) for a in ("e", "k", "c"))
        start, per = start_g[e], per_g[e]

        def q(i):
            return start + jax.lax.div(i, n_m)

        def product(acc):
            @pl.when(per > 0)
            def _():
                def step(_, l_s, r_s):
                    plgpu.wgmma(acc, l_s.T, r_s)
                    plgpu.wgmma_wait(1)

                plgpu.emit_pipeline(
                    step, grid=(per * n_m,),
                    in_specs=(_spec((None, tm, tk),
                                    lambda i: (lrow_g[q(i)], jax.lax.rem(i, n_m), k), dt, "l"),
                              _spec((None, tm, tn),
                                    lambda i: (rrow_g[q(i)], jax.lax.rem(i, n_m), c), dt, "r")),
                    max_concurrent_steps=stages)(l_g, r_g)
            return acc[...]

        acc = pl.run_scoped(product, plgpu.ACC((tk, tn)))
        _store(acc, o_g, (e, pl.ds(k * tk, tk), pl.ds(c * tn, tn)), dt)

    return _kernel(body, ((E, K, N), dt), (E, K // tk, N // tn), ("e", "k", "c"),
                   interpret, "moejax_pairs_dw")(lrow, rrow, pairs.start,
                                                 pairs.pairs_per_expert, lhs, rhs)
