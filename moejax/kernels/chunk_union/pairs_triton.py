"""The (tile, expert) pair products of :mod:`moejax.kernels.chunk_union.pairs` as Pallas Triton
kernels: the GPU backend where the Mosaic GPU kernels (:mod:`moejax.kernels.chunk_union.pairs_gpu`)
do not apply (float32 operands, GPUs before Hopper), kept while jax still has Pallas Triton.

Each program loops over the contraction (and, for the down product / the weight gradient, over
the tile's union / the expert's pairs) loading blocks by dynamic offsets, with a float32
accumulator in registers. Blocks are powers of two (``tl.dot``: at least 16 rows); operands
arrive zero-padded to them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moejax.kernels.tiling import pad_to, pow2

try:  # deprecated since jax 0.12: these kernels run while jax still ships it
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    pltriton = None

__all__ = ["triton_up", "triton_down", "triton_wgrad", "AVAILABLE"]

AVAILABLE = pltriton is not None


def _triton_up_kernel(src_ref, exp_ref, valid_ref, x_ref, w_ref, o_ref, *, tr, n_red,
                      transpose):
    p, m, o = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, e = src_ref[p], exp_ref[p]
    tm, to = o_ref.shape[1], o_ref.shape[2]

    def body(r, acc):
        x = x_ref[s, pl.ds(m * tm, tm), pl.ds(r * tr, tr)]
        if transpose:
            return acc + pltriton.dot(x, w_ref[e, pl.ds(o * to, to), pl.ds(r * tr, tr)],
                                      trans_b=True)
        return acc + pltriton.dot(x, w_ref[e, pl.ds(r * tr, tr), pl.ds(o * to, to)])

    # integer arithmetic, not jnp.where: Triton's scf.for wants i32 bounds, and a select of
    # two literals lowers to i1 (rejected when the GPU compiles the module)
    steps = valid_ref[p] * n_red
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((tm, to), jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


def _full(a):
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _vec(v):
    """A 1-D table padded to a power of two (Triton blocks must be)."""
    return pad_to(v, 0, pow2(v.shape[0]))


_TRITON = dict(num_warps=4, num_stages=2)


def _launch(kernel, tables, operands, out_shape, dtype, blocks):
    """``kernel`` over the grid of ``out_shape``'s ``blocks`` (3-d), the 1-D ``tables`` and
    whole ``operands`` in, each program writing its own output block."""
    tables = [_vec(t) for t in tables]
    grid = tuple(d // b for d, b in zip(out_shape, blocks))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(out_shape, dtype), grid=grid,
        in_specs=[_full(a) for a in (*tables, *operands)],
        out_specs=pl.BlockSpec(blocks, lambda i, j, k: (i, j, k)),
        compiler_params=pltriton.CompilerParams(**_TRITON),
    )(*tables, *operands)


def triton_up(xs, w, pairs, tiles, transpose):
    tm, tr, to = tiles
    P, n, K = pairs.src.shape[0], xs.shape[1], xs.shape[2]
    n_out = w.shape[1] if transpose else w.shape[2]
    return _launch(functools.partial(_triton_up_kernel, tr=tr, n_red=K // tr,
                                     transpose=transpose),
                   (pairs.src, pairs.expert, pairs.valid), (xs, w), (P, n, n_out), xs.dtype,
                   (1, tm, to))


def _triton_down_kernel(exp_ref, count_ref, h_ref, w_ref, o_ref, *, U, tr, n_red, transpose):
    s, m, o = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tm, to = o_ref.shape[1], o_ref.shape[2]

    def body(i, acc):
        p = s * U + jax.lax.div(i, n_red)  # lax div/rem: i >= 0, and Triton lowers them
        r, e = jax.lax.rem(i, n_red), exp_ref[p]
        h = h_ref[p, pl.ds(m * tm, tm), pl.ds(r * tr, tr)]
        if transpose:
            return acc + pltriton.dot(h, w_ref[e, pl.ds(o * to, to), pl.ds(r * tr, tr)],
                                      trans_b=True)
        return acc + pltriton.dot(h, w_ref[e, pl.ds(r * tr, tr), pl.ds(o * to, to)])

    acc = jax.lax.fori_loop(0, count_ref[s] * n_red, body, jnp.zeros((tm, to), jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


def triton_down(h, w, pairs, U, tiles, transpose):
    tm, tr, to = tiles
    S, n = pairs.count.shape[0], h.shape[1]
    n_out = w.shape[1] if transpose else w.shape[2]
    return _launch(functools.partial(_triton_down_kernel, U=U, tr=tr, n_red=h.shape[2] // tr,
                                     transpose=transpose),
                   (pairs.expert, pairs.count), (h, w), (S, n, n_out), h.dtype, (1, tm, to))


def _triton_wgrad_kernel(lrow_ref, rrow_ref, start_ref, per_ref, l_ref, r_ref, o_ref, *, tm,
                         n_m):
    e, k, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tk, tn = o_ref.shape[1], o_ref.shape[2]

    def body(i, acc):
        q, m = start_ref[e] + jax.lax.div(i, n_m), jax.lax.rem(i, n_m)
        lb = l_ref[lrow_ref[q], pl.ds(m * tm, tm), pl.ds(k * tk, tk)]
        rb = r_ref[rrow_ref[q], pl.ds(m * tm, tm), pl.ds(c * tn, tn)]
        return acc + pltriton.dot(lb, rb, trans_a=True)

    acc = jax.lax.fori_loop(0, per_ref[e] * n_m, body, jnp.zeros((tk, tn), jnp.float32))
    o_ref[0] = acc.astype(o_ref.dtype)


def triton_wgrad(lhs, lrow, rhs, rrow, pairs, E, tiles):
    tm, tk, tn = tiles
    n, K, N = lhs.shape[1], lhs.shape[2], rhs.shape[2]
    return _launch(functools.partial(_triton_wgrad_kernel, tm=tm, n_m=n // tm),
                   (lrow, rrow, pairs.start, pairs.pairs_per_expert), (lhs, rhs), (E, K, N),
                   lhs.dtype, (1, tk, tn))
