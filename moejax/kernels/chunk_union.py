"""BlockFFN's chunk-sparse expert computation as kernels: each tile of ``tile`` consecutive
tokens reads only the weights of the experts in its union.

``y_ND, overflow = chunk_union_kernel(x_ND, a_NE, active_NE, w_up, w_down, w_gate, ...)``
equals :func:`moejax.ops.chunk_union.chunk_union_experts` (and the dense oracle when no tile
overflows ``max_union``). Per tile ``c`` the union ids (members first, ascending) and the
clipped union size ``count_c = min(|U_c|, max_union)`` are computed once in jnp and handed to
the kernel as small integer arrays. Three kernels, chosen by ``backend``:

* ``"pallas"`` with ``schedule="loop"`` (GPU-style; lowers through Triton): grid ``(C,)``;
  program ``c`` gets its ``[tile, D]`` tokens and ``[tile, E]`` combine weights as blocks and
  loops over its union with a dynamic trip count (an empty union does no work and writes 0):
  for member ``e`` it loads ``W_up[e]`` (``W_gate[e]``) and ``W_down[e]``, computes ``act(x
  W_up[e]) * A[:, e]`` and accumulates ``h W_down[e]`` in float32.
* ``"pallas"`` with ``schedule="prefetch"`` (TPU-style): the union ids and counts are *scalar
  prefetch* operands and the grid runs over them, ``(C, max_union, F / block_f)``: the weight
  BlockSpecs' index maps read ``ids[c, j]``, so only the union's ``[D, block_f]`` /
  ``[block_f, D]`` expert tiles are copied into fast memory; steps past ``count_c`` repeat the
  last member's block index (no new copy) and skip the compute. The output tile stays resident
  across the union and F axes and accumulates in a float32 scratch buffer.
* ``"triton"``: the same computation as a Triton kernel called through ``jax_triton``
  (:mod:`moejax.kernels.chunk_union_triton`; needs a GPU and the ``gpu`` extra).

Up-projection, activation, masking by the combine weight and down-projection are fused in one
program; bf16 inputs accumulate in float32. Gradients: a ``custom_vjp`` whose backward is the
vjp of the jnp reference path, so training can use any kernel's forward. ``interpret``
defaults to True on CPU (Pallas interpret mode); ``schedule=None`` picks ``"prefetch"`` on TPU
and ``"loop"`` elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moejax.ops.activations import activation_fn
from moejax.ops.chunk_union import chunk_union_experts, pad_to_tiles, union_members

__all__ = ["chunk_union_kernel", "chunk_union_pallas", "tile_unions"]

BACKENDS = ("pallas", "triton")
SCHEDULES = ("loop", "prefetch")


def tile_unions(tile: int, max_union: int, x_ND, a_NE, active_NE):
    """Tile-padded ``x``, ``a`` (in ``x``'s dtype), union ids ``[C, max_union]`` and clipped
    union sizes ``[C]`` (int32), and the overflow fraction: what every kernel needs."""
    E = a_NE.shape[-1]
    xp, ap, actp = pad_to_tiles(tile, x_ND, a_NE, active_NE)
    C = xp.shape[0] // tile
    ids_CU, _, sizes_C = union_members(actp.reshape(C, tile, E), max_union)
    count_C = jnp.minimum(sizes_C, max_union).astype(jnp.int32)
    overflow = jnp.mean((sizes_C > max_union).astype(jnp.float32))
    return xp, ap.astype(x_ND.dtype), ids_CU, count_C, overflow


def _expert_tile(x, w_up, w_gate, w_down, a_col, act):
    """``act(x W_up) [* gate] * a`` down-projected: one expert's contribution, f32."""
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    if w_gate is None:
        h = act(up)
    else:
        h = act(jnp.dot(x, w_gate, preferred_element_type=jnp.float32)) * up
    h = h * a_col.astype(jnp.float32)
    return jnp.dot(h.astype(x.dtype), w_down, preferred_element_type=jnp.float32)


def _loop_kernel(ids_ref, count_ref, x_ref, a_ref, w_up_ref, w_down_ref, *rest, activation,
                 gated):
    w_gate_ref, o_ref = rest if gated else (None, rest[0])
    c = pl.program_id(0)
    act = activation_fn(activation)
    x = x_ref[...]

    def body(j, acc):
        e = ids_ref[c, j]
        wg = w_gate_ref[e] if gated else None
        return acc + _expert_tile(x, w_up_ref[e], wg, w_down_ref[e], a_ref[:, pl.ds(e, 1)], act)

    acc = jax.lax.fori_loop(0, count_ref[c], body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _forward_loop(xp, ap, ids_CU, count_C, weights, activation, tile, interpret):
    (C, U), D = ids_CU.shape, xp.shape[1]
    E = ap.shape[1]
    gated = len(weights) == 3
    full = lambda shape: pl.BlockSpec(shape, lambda c: (0,) * len(shape))  # noqa: E731
    w_specs = [full(w.shape) for w in weights]
    return pl.pallas_call(
        functools.partial(_loop_kernel, activation=activation, gated=gated),
        out_shape=jax.ShapeDtypeStruct((C * tile, D), xp.dtype),
        grid=(C,),
        in_specs=[full((C, U)), full((C,)), pl.BlockSpec((tile, D), lambda c: (c, 0)),
                  pl.BlockSpec((tile, E), lambda c: (c, 0))] + w_specs,
        out_specs=pl.BlockSpec((tile, D), lambda c: (c, 0)),
        interpret=interpret,
    )(ids_CU, count_C, xp, ap, *weights)


def _prefetch_kernel(ids_ref, count_ref, x_ref, a_ref, w_up_ref, w_down_ref, *rest, activation,
                     gated, n_f):
    w_gate_ref, o_ref, acc_ref = rest if gated else (None, *rest)
    c, j, f = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when((j == 0) & (f == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j < count_ref[c])
    def _accumulate():
        e = ids_ref[c, j]
        wg = w_gate_ref[0] if gated else None
        acc_ref[...] += _expert_tile(x_ref[...], w_up_ref[0], wg, w_down_ref[0],
                                     a_ref[:, pl.ds(e, 1)], activation_fn(activation))

    @pl.when((j == pl.num_programs(1) - 1) & (f == n_f - 1))
    def _write():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _forward_prefetch(xp, ap, ids_CU, count_C, weights, activation, tile, interpret, block_f):
    from jax.experimental.pallas import tpu as pltpu

    (C, U), D = ids_CU.shape, xp.shape[1]
    E, F = ap.shape[1], weights[0].shape[2]
    bf = block_f if block_f and F % block_f == 0 else F
    gated = len(weights) == 3

    def member(c, j, ids, cnt):  # past the union: repeat the last member (no new copy)
        return ids[c, jnp.clip(jnp.minimum(j, cnt[c] - 1), 0, U - 1)]

    up_spec = pl.BlockSpec((1, D, bf), lambda c, j, f, ids, cnt: (member(c, j, ids, cnt), 0, f))
    down_spec = pl.BlockSpec((1, bf, D),
                             lambda c, j, f, ids, cnt: (member(c, j, ids, cnt), f, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(C, U, F // bf),
        in_specs=[pl.BlockSpec((tile, D), lambda c, j, f, ids, cnt: (c, 0)),
                  pl.BlockSpec((tile, E), lambda c, j, f, ids, cnt: (c, 0)),
                  up_spec, down_spec] + ([up_spec] if gated else []),
        out_specs=pl.BlockSpec((tile, D), lambda c, j, f, ids, cnt: (c, 0)),
        scratch_shapes=[pltpu.VMEM((tile, D), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_prefetch_kernel, activation=activation, gated=gated, n_f=F // bf),
        out_shape=jax.ShapeDtypeStruct((C * tile, D), xp.dtype),
        grid_spec=grid_spec,
        interpret=interpret,
    )(ids_CU, count_C, xp, ap, *weights)


def _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union,
             backend, schedule, interpret, block_f):
    N = x_ND.shape[0]
    xp, ap, ids_CU, count_C, overflow = tile_unions(tile, max_union, x_ND, a_NE, active_NE)
    weights = [w.astype(x_ND.dtype) for w in (w_up, w_down, w_gate) if w is not None]
    if backend == "triton":
        from moejax.kernels.chunk_union_triton import chunk_union_triton_call

        y = chunk_union_triton_call(xp, ap, ids_CU, count_C, *weights, activation=activation,
                                    tile=tile)
    elif schedule == "prefetch":
        y = _forward_prefetch(xp, ap, ids_CU, count_C, weights, activation, tile, interpret,
                              block_f)
    else:
        y = _forward_loop(xp, ap, ids_CU, count_C, weights, activation, tile, interpret)
    return y[:N], overflow


_STATIC = (6, 7, 8, 9, 10, 11, 12)


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _chunk_union(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static):
    return _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static)


def _fwd(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static):
    out = _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static)
    return out, (x_ND, a_NE, active_NE, w_up, w_down, w_gate)


def _bwd(activation, tile, max_union, backend, schedule, interpret, block_f, res, cts):
    x_ND, a_NE, active_NE, w_up, w_down, w_gate = res
    dy, _ = cts

    def reference(x, a, wu, wd, wg):
        return chunk_union_experts(x, a, active_NE, wu, wd, wg, activation, tile=tile,
                                   max_union=max_union, schedule="gather")[0]

    _, vjp = jax.vjp(reference, x_ND, a_NE, w_up, w_down, w_gate)
    dx, da, dwu, dwd, dwg = vjp(dy)
    return dx, da, None, dwu, dwd, dwg


_chunk_union.defvjp(_fwd, _bwd)


def chunk_union_kernel(x_ND, a_NE, active_NE, w_up, w_down, w_gate=None, *, activation: str,
                       tile: int, max_union: int, backend: str = "pallas",
                       schedule: str | None = None, interpret: bool | None = None,
                       block_f: int = 512):
    """``(y_ND, overflow_fraction)`` (see the module docstring)."""
    E = a_NE.shape[-1]
    if not 1 <= max_union <= E or tile < 1:
        raise ValueError(f"max_union={max_union} must be in [1, {E}] and tile={tile} >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    platform = jax.default_backend()
    schedule = schedule or ("prefetch" if platform == "tpu" else "loop")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    interpret = platform == "cpu" if interpret is None else interpret
    return _chunk_union(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile,
                        max_union, backend, schedule, bool(interpret), int(block_f))


def chunk_union_pallas(x_ND, a_NE, active_NE, w_up, w_down, w_gate=None, *, activation: str,
                       tile: int, max_union: int, schedule: str | None = None,
                       interpret: bool | None = None, block_f: int = 512):
    """The Pallas kernels (``backend="pallas"``) of :func:`chunk_union_kernel`."""
    return chunk_union_kernel(x_ND, a_NE, active_NE, w_up, w_down, w_gate,
                              activation=activation, tile=tile, max_union=max_union,
                              backend="pallas", schedule=schedule, interpret=interpret,
                              block_f=block_f)
