"""BlockFFN's chunk-sparse expert computation as a Pallas kernel: each tile of ``tile``
consecutive tokens reads only the weights of the experts in its union.

``y_ND, overflow = chunk_union_pallas(x_ND, a_NE, active_NE, w_up, w_down, w_gate, ...)``
equals :func:`moejax.ops.chunk_union.chunk_union_experts` (and the dense oracle when no tile
overflows ``max_union``).

Kernel: grid ``(C,)`` over the tiles. Program ``c`` gets its ``[tile, D]`` tokens and
``[tile, E]`` combine weights as blocks, the per-tile union ids (members first, ascending) and
union size as small integer inputs, and loops over its union with a dynamic trip count
``min(|U_c|, max_union)`` (an empty union does no work and writes 0): for member ``e`` it
loads ``W_up[e]`` (``W_gate[e]``) and ``W_down[e]``, computes ``act(x W_up[e]) * A[:, e]`` and
accumulates ``h W_down[e]`` in float32 (bf16 inputs allowed). Up-projection, activation,
masking by the combine weight and down-projection are fused in one program; every program
writes only its own output tile, as GPU lowering needs.

Gradients: a ``custom_vjp`` whose backward is the vjp of the jnp reference path (so training
can use the kernel's forward; a Pallas backward is not written yet). ``interpret`` defaults
to True on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moejax.ops.activations import activation_fn
from moejax.ops.chunk_union import chunk_union_experts, pad_to_tiles, union_members

__all__ = ["chunk_union_pallas"]


def _kernel(ids_ref, count_ref, x_ref, a_ref, w_up_ref, w_down_ref, *rest, activation: str,
            gated: bool):
    if gated:
        w_gate_ref, o_ref = rest
    else:
        (o_ref,) = rest
    c = pl.program_id(0)
    act = activation_fn(activation)
    x = x_ref[...]

    def body(j, acc):
        e = ids_ref[c, j]
        up = jnp.dot(x, w_up_ref[e], preferred_element_type=jnp.float32)
        if gated:
            h = act(jnp.dot(x, w_gate_ref[e], preferred_element_type=jnp.float32)) * up
        else:
            h = act(up)
        h = h * a_ref[:, pl.ds(e, 1)].astype(jnp.float32)
        return acc + jnp.dot(h.astype(x.dtype), w_down_ref[e],
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, count_ref[c], body,
                            jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union,
             interpret):
    N, D = x_ND.shape
    E, F = w_up.shape[0], w_up.shape[2]
    xp, ap, actp = pad_to_tiles(tile, x_ND, a_NE, active_NE)
    C = xp.shape[0] // tile
    ids_CU, _, sizes_C = union_members(actp.reshape(C, tile, E), max_union)
    count_C = jnp.minimum(sizes_C, max_union).astype(jnp.int32)
    gated = w_gate is not None
    weights = [w_up, w_down] + ([w_gate] if gated else [])
    full = lambda shape: pl.BlockSpec(shape, lambda c: (0,) * len(shape))  # noqa: E731
    y = pl.pallas_call(
        functools.partial(_kernel, activation=activation, gated=gated),
        out_shape=jax.ShapeDtypeStruct((C * tile, D), x_ND.dtype),
        grid=(C,),
        in_specs=[full((C, max_union)), full((C,)),
                  pl.BlockSpec((tile, D), lambda c: (c, 0)),
                  pl.BlockSpec((tile, E), lambda c: (c, 0)),
                  full((E, D, F)), full((E, F, D))] + ([full((E, D, F))] if gated else []),
        out_specs=pl.BlockSpec((tile, D), lambda c: (c, 0)),
        interpret=interpret,
    )(ids_CU, count_C, xp, ap.astype(x_ND.dtype), *[w.astype(x_ND.dtype) for w in weights])
    overflow = jnp.mean((sizes_C > max_union).astype(jnp.float32))
    return y[:N], overflow


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _chunk_union(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union,
                 interpret):
    return _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union,
                    interpret)


def _reference(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union):
    return chunk_union_experts(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation,
                               tile=tile, max_union=max_union)


def _fwd(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union, interpret):
    out = _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union,
                   interpret)
    return out, (x_ND, a_NE, active_NE, w_up, w_down, w_gate)


def _bwd(activation, tile, max_union, interpret, res, cts):
    x_ND, a_NE, active_NE, w_up, w_down, w_gate = res
    dy, _ = cts

    def f(x, a, wu, wd, wg):
        return _reference(x, a, active_NE, wu, wd, wg, activation, tile, max_union)[0]

    _, vjp = jax.vjp(f, x_ND, a_NE, w_up, w_down, w_gate)
    dx, da, dwu, dwd, dwg = vjp(dy)
    return dx, da, None, dwu, dwd, dwg


_chunk_union.defvjp(_fwd, _bwd)


def chunk_union_pallas(x_ND, a_NE, active_NE, w_up, w_down, w_gate=None, *, activation: str,
                       tile: int, max_union: int, interpret=None):
    """``(y_ND, overflow_fraction)`` (see the module docstring)."""
    E = a_NE.shape[-1]
    if not 1 <= max_union <= E or tile < 1:
        raise ValueError(f"max_union={max_union} must be in [1, {E}] and tile={tile} >= 1")
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    return _chunk_union(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile,
                        max_union, interpret)
