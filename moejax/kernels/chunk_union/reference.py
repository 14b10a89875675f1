"""BlockFFN's expert computation as pure array functions (the reference paths; the Pallas
kernel :mod:`moejax.kernels.chunk_union.pallas` is tested against them).

``y = sum_e A_e E_e(x)`` over experts ``E_e(x) = W_down^(e)T act(W_up^(e)T x)`` (gated:
``act(W_gate^(e)T x) * W_up^(e)T x``), with combine weights ``A [N, E]`` that are zero for
inactive (token, expert) pairs.

* :func:`dense_experts`: every expert on every token (the oracle).
* :func:`dense_chunk`: one tile as :func:`dense_experts` with the combine weights of the
  experts outside its union zeroed: :func:`chunk_union_experts` of that tile with
  ``max_union = E`` computed densely (the fast form of a small chunk on a device whose
  union kernels do not take it).
* :func:`chunk_union_experts`: tokens cut into tiles of ``tile`` consecutive tokens; per tile
  the union ``U`` of the experts active for any of its tokens; only those experts run, on all
  tokens of the tile (the inactive pairs weigh 0). ``U`` is padded to the static size
  ``max_union``; a tile whose union is larger keeps its lowest-index members and counts as an
  overflow. Exact whenever no tile overflows. Two schedules of the same sum:
  ``"loop"`` (default) walks the union with a ``fori_loop`` whose trip count is the largest
  actual union over the tiles (so ``max_union = E`` stays exact and costs only the union),
  gathering one member's weights per tile per step (each weight is read once and the copy
  stays in cache, where ``"gather"`` materialises every member's copy; the members' running
  sum is float32, as the kernels' accumulators), with the
  gradient of ``"gather"`` (a
  ``custom_vjp``: the loop's own reverse pass would carry full-size weight cotangents through
  every step); ``"gather"`` gathers every member's weights at once (``[C, U, D, F]``) and runs
  batched einsums.
* :func:`union_members`: per tile, the union's expert ids (members first, ascending) and sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.kernels.moe_ffn.every_expert import every_expert, expert_hidden
from moejax.ops.activations import activation_fn

__all__ = ["dense_experts", "dense_chunk", "chunk_union_experts", "union_members", "pad_to_tiles"]


def dense_experts(x_ND, a_NE, w_up, w_down, w_gate, activation: str):
    """Reference: ``y = sum_e A_e E_e(x)`` with every expert evaluated on every token
    (:func:`moejax.kernels.moe_ffn.every_expert.every_expert`, whose layout follows the token
    count)."""
    return every_expert(x_ND, a_NE, w_up, w_down, w_gate, activation_fn(activation))


def dense_chunk(x_nD, a_nE, active_nE, w_up, w_down, w_gate, activation: str):
    """One tile of ``n`` tokens: ``chunk_union_experts(..., tile=n, max_union=E)`` as one
    dense product, every expert run and the ones outside the tile's union weighted 0."""
    in_union_E = jnp.any(active_nE, axis=0)
    return dense_experts(x_nD, a_nE * in_union_E.astype(a_nE.dtype), w_up, w_down, w_gate,
                         activation)


def pad_to_tiles(tile: int, *arrays):
    """Pad the leading (token) axis of every array to a multiple of ``tile`` with zeros."""
    pad = (-arrays[0].shape[0]) % tile
    if not pad:
        return arrays
    return tuple(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) for a in arrays)


def union_members(active_CnE, max_union: int):
    """``(ids_CU int32, in_union_CU bool, sizes_C int32)``: per tile the union members first
    (lowest index first), then the other experts, cut to ``max_union``; the union sizes."""
    E = active_CnE.shape[-1]
    union_CE = jnp.any(active_CnE, axis=1)
    score_CE = union_CE.astype(jnp.float32) * E - jnp.arange(E, dtype=jnp.float32)
    _, ids_CU = jax.lax.top_k(score_CE, max_union)
    in_union_CU = jnp.take_along_axis(union_CE, ids_CU, axis=1)
    return ids_CU.astype(jnp.int32), in_union_CU, jnp.sum(union_CE, -1).astype(jnp.int32)


def _tiles(x_ND, a_NE, active_NE, tile, max_union):
    E = a_NE.shape[-1]
    x_ND, a_NE, active_NE = pad_to_tiles(tile, x_ND, a_NE, active_NE)
    C = x_ND.shape[0] // tile
    ids_CU, in_union_CU, sizes_C = union_members(active_NE.reshape(C, tile, E), max_union)
    a_CnU = jnp.take_along_axis(a_NE.reshape(C, tile, E), ids_CU[:, None, :], axis=2)
    a_CnU = a_CnU * in_union_CU[:, None, :]
    overflow = jnp.mean((sizes_C > max_union).astype(jnp.float32))
    return x_ND.reshape(C, tile, -1), ids_CU, a_CnU, overflow, sizes_C


def _union_gather(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union):
    N, D = x_ND.shape
    x_CnD, ids_CU, a_CnU, overflow, _ = _tiles(x_ND, a_NE, active_NE, tile, max_union)
    act = activation_fn(activation)
    w_gate_g = None if w_gate is None else w_gate[ids_CU]
    h = expert_hidden(x_CnD, w_up[ids_CU], w_gate_g, act, "cnd,cudf->cnuf")
    y_CnD = jnp.einsum("cnuf,cufd,cnu->cnd", h, w_down[ids_CU], a_CnU.astype(h.dtype))
    return y_CnD.reshape(-1, D)[:N], overflow


def _union_loop(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union):
    N, D = x_ND.shape
    x_CnD, ids_CU, a_CnU, overflow, sizes_C = _tiles(x_ND, a_NE, active_NE, tile, max_union)
    act = activation_fn(activation)
    # dynamic trip count: the largest (capped) union over the tiles; members past a tile's own
    # union are non-members with weight 0
    n_steps = jnp.max(jnp.minimum(sizes_C, max_union))

    def member(j, acc_CnD):
        e_C = ids_CU[:, j]
        w_gate_g = None if w_gate is None else w_gate[e_C]
        h = expert_hidden(x_CnD, w_up[e_C], w_gate_g, act, "cnd,cdf->cnf")
        h = h * a_CnU[:, :, j, None].astype(h.dtype)
        return acc_CnD + jnp.einsum("cnf,cfd->cnd", h, w_down[e_C],
                                    preferred_element_type=jnp.float32)

    # the members' sum in float32, as the kernels' accumulators (a 16-bit running sum over
    # 64 members drifts by several of its steps)
    y_CnD = jax.lax.fori_loop(0, n_steps, member, jnp.zeros(x_CnD.shape, jnp.float32))
    return y_CnD.astype(x_ND.dtype).reshape(-1, D)[:N], overflow


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _union_loop_vjp(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union):
    return _union_loop(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile,
                       max_union)


def _loop_fwd(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union):
    out = _union_loop(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union)
    return out, (x_ND, a_NE, active_NE, w_up, w_down, w_gate)


def _loop_bwd(activation, tile, max_union, res, cts):
    x_ND, a_NE, active_NE, w_up, w_down, w_gate = res

    def gather(x, a, wu, wd, wg):
        return _union_gather(x, a, active_NE, wu, wd, wg, activation, tile, max_union)[0]

    _, vjp = jax.vjp(gather, x_ND, a_NE, w_up, w_down, w_gate)
    dx, da, dwu, dwd, dwg = vjp(cts[0])
    return dx, da, None, dwu, dwd, dwg


_union_loop_vjp.defvjp(_loop_fwd, _loop_bwd)

SCHEDULES = ("loop", "gather")


def chunk_union_experts(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation: str, *,
                        tile: int, max_union: int, schedule: str = "loop"):
    """Per-tile union of active experts (static cap ``max_union``). Returns ``(y_ND,
    overflow_fraction)``; exact whenever no tile's union exceeds ``max_union``. ``schedule``:
    ``"loop"`` or ``"gather"`` (module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    fn = _union_loop_vjp if schedule == "loop" else _union_gather
    w_up, w_down = jnp.asarray(w_up), jnp.asarray(w_down)
    w_gate = None if w_gate is None else jnp.asarray(w_gate)
    return fn(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union)
