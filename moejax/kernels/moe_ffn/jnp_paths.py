"""Token -> expert dispatch for top-k MoE layers in plain jnp (pure functions, no model code).

Every path computes, for each token ``n`` with selected experts ``ids_NK[n]`` and combine
weights ``weights_NK[n]``::
    y_N[n] = sum_k weights_NK[n, k] * E_{ids_NK[n, k]}(x_N[n])

where expert ``e`` is the FFN ``act(x W_gate[e]) * (x W_up[e]) @ W_down[e]`` (gated
activations) or ``act(x W_up[e]) @ W_down[e]`` (non-gated), see
:mod:`moejax.ops.activations`. Stacked expert weights are ``w_up_EDF [E, D, F]``,
``w_down_EFD [E, F, D]`` and, for gated activations only, ``w_gate_EDF [E, D, F]``.

Paths (all agree to float tolerance when nothing is dropped):
* :func:`dispatch_dense` -- the correctness oracle: every expert on every token
  (``N * E`` expert evaluations), combined with a masked ``[N, E]`` weight matrix.
* :func:`dispatch_capacity` -- sort assignments by expert, gather into fixed
  ``[E, C, D]`` buffers with ``C = ceil(capacity_factor * N * k / E)``, run the experts as a
  batched matmul, gather the results back and combine. Assignments over capacity are
  dropped (their contribution is zero). Fast on CPU: only gathers, no one-hot matmuls.
* :func:`dispatch_ragged` -- dropless: sort assignments by expert and run grouped matmuls
  (:func:`jax.lax.ragged_dot` by default; any function of that signature, such as the Pallas
  kernel :func:`moejax.kernels.grouped.pallas_gmm.gmm`).
* :func:`dispatch_grouped` -- dropless in plain jnp (``"grouped"``): the assignments sorted by
  expert are laid out block-padded (every expert's rows padded to a multiple of a row tile,
  megablox-style, ``ceil(N k / tile) + E`` tiles in all), each tile multiplies its expert's
  gathered weights as one batched dense matmul. Exact like the ragged path, as fast as the
  capacity path on CPU (no expert runs on rows it does not own, except tile padding).
* :func:`dispatch_bucketed` -- dropless capacity (``"bucketed"``): the capacity path with the
  smallest capacity of a fixed ladder (``BUCKET_FACTORS`` x the balanced load, then ``N``)
  that holds the fullest expert, chosen at run time by ``lax.switch``; never drops (the last
  rung holds every token). Its cost follows the fullest expert: forward as fast as the
  capacity path when the load is near balanced, forward + backward slower (each rung
  rematerialised), and slow under a skewed load. Costs more compile time (one capacity
  path per rung).

The paths by name, with the kernel paths (``"tokamax"``, ``"gmm"``, ``"host"``,
``"host_capacity"``) and
``"auto"``, are in :mod:`moejax.kernels.moe_ffn.api`.

Each returns a :class:`DispatchOut` ``(y_ND, n_dropped, dropped_fraction)``.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from moejax.kernels.grouped.layout import group_tiles
from moejax.kernels.moe_ffn.every_expert import every_expert
from moejax.kernels.moe_ffn.permute import inverse_permutation, sort_rows, unsort_rows
from moejax.ops.activations import activation_fn, is_gated

__all__ = [
    "DispatchMethod",
    "DispatchOut",
    "ffn_apply",
    "expert_capacity",
    "dispatch_dense",
    "dispatch_capacity",
    "capacity_apply",
    "dispatch_ragged",
    "dispatch_grouped",
    "dispatch_bucketed",
    "bucket_capacities",
    "BUCKET_FACTORS",
]

DispatchMethod = Literal["auto", "dense", "capacity", "ragged", "tokamax", "gmm", "host",
                         "host_capacity", "grouped", "bucketed", "expert_parallel",
                         "expert_parallel_capacity"]

# Capacity ladder of the bucketed path, as multiples of the balanced load N k / E.
BUCKET_FACTORS: tuple[float, ...] = (1.25, 1.5, 2.0, 3.0)


class DispatchOut(NamedTuple):
    """Result of a dispatch path.

    y_ND: combined expert output, dtype of ``x_ND``.
    n_dropped: int32 scalar, number of *real-token* (token, slot) assignments dropped for
        lack of capacity (always 0 for the dropless paths).
    dropped_fraction: float32 scalar, ``n_dropped / number of real-token assignments``.
    """

    y_ND: jax.Array
    n_dropped: jax.Array
    dropped_fraction: jax.Array


def _check_weights(activation: str, w_up, w_down, w_gate, stacked: bool) -> None:
    gated = is_gated(activation)
    if gated and w_gate is None:
        raise ValueError(
            f"activation {activation!r} is gated and needs w_gate; pass the gate weights "
            "or use a non-gated activation (gelu, gelu_tanh, relu, swish)"
        )
    if not gated and w_gate is not None:
        raise ValueError(
            f"activation {activation!r} is not gated but w_gate was given; drop w_gate or "
            "use a gated activation (swiglu, geglu)"
        )
    want = 3 if stacked else 2
    if w_up.ndim != want or w_down.ndim != want:
        raise ValueError(
            f"expected {'stacked [E, D, F] / [E, F, D]' if stacked else '[D, F] / [F, D]'} "
            f"weights, got w_up {w_up.shape} and w_down {w_down.shape}"
        )


def ffn_apply(x_ND, w_up_DF, w_down_FD, w_gate_DF=None, *, activation: str):
    """One (non-stacked) FFN on ``x[..., D]``: ``act(x W_gate) * (x W_up) @ W_down`` if
    gated, else ``act(x W_up) @ W_down``. Weights are cast to ``x``'s dtype."""
    _check_weights(activation, w_up_DF, w_down_FD, w_gate_DF, stacked=False)
    act = activation_fn(activation)
    dt = x_ND.dtype
    up = x_ND @ w_up_DF.astype(dt)
    h = act(x_ND @ w_gate_DF.astype(dt)) * up if w_gate_DF is not None else act(up)
    return h @ w_down_FD.astype(dt)


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``C = ceil(capacity_factor * n_tokens * top_k / n_experts)``,
    clipped to ``[1, n_tokens]`` (an expert can receive at most one assignment per token,
    so more than ``n_tokens`` slots never changes the result)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    c = math.ceil(capacity_factor * n_tokens * top_k / n_experts)
    return max(1, min(c, n_tokens))


def _combine(weights_NK, y_NKD, dtype):
    return jnp.einsum("nk,nkd->nd", weights_NK.astype(y_NKD.dtype), y_NKD).astype(dtype)


def _no_drop(x_ND):
    del x_ND
    return jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)


def dispatch_dense(
    x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None, *,
    activation: str, valid_N=None,
) -> DispatchOut:
    """Oracle path: every expert on every token, combined with the ``[N, E]`` matrix that
    holds ``weights_NK[n, k]`` at ``(n, ids_NK[n, k])`` and zero elsewhere. Costs ``E / k``
    times the FLOPs of a sparse path; use for tests and tiny models. ``valid_N`` is
    accepted for a uniform signature and ignored (nothing is dropped)."""
    del valid_N
    _check_weights(activation, w_up_EDF, w_down_EFD, w_gate_EDF, stacked=True)
    dt = x_ND.dtype
    onehot_NKE = jax.nn.one_hot(ids_NK, w_up_EDF.shape[0], dtype=weights_NK.dtype)
    comb_NE = jnp.einsum("nk,nke->ne", weights_NK, onehot_NKE)
    y_ND = every_expert(x_ND, comb_NE, w_up_EDF.astype(dt), w_down_EFD.astype(dt),
                        None if w_gate_EDF is None else w_gate_EDF.astype(dt),
                        activation_fn(activation))
    return DispatchOut(y_ND.astype(dt), *_no_drop(x_ND))


def _sort_assignments(ids_NK, valid_N, n_experts, priority: str = "choice"):
    """Flatten (token, slot) assignments and order them by expert.

    Within an expert the order is: real tokens before padding tokens, then (``priority=
    "choice"``) by the slot rank ``k`` (every token's first choice before any second choice,
    GShard), then by flat token index ``n`` (batch-major ``b * T + t``); ``priority="token"``
    skips the slot rank. Returns ``order_A`` (sorted -> flat assignment
    index), the sorted expert ids, the sorted token ids, ``counts_E``, the sorted
    ``is_real`` flags and the unsorted ``is_real`` flags."""
    n, k = ids_NK.shape
    ids_A = ids_NK.reshape(-1).astype(jnp.int32)
    if valid_N is None:
        real_A = jnp.ones((n * k,), bool)
    else:
        real_A = jnp.repeat(valid_N.reshape(-1).astype(bool), k)
    pad_A = (~real_A).astype(jnp.int32)
    if priority == "choice":
        rank_A = jnp.arange(n * k, dtype=jnp.int32) % k
        sort_key_A = ids_A * (2 * k) + pad_A * k + rank_A
    elif priority == "token":
        sort_key_A = ids_A * 2 + pad_A
    else:
        raise ValueError(f"priority={priority!r}; use 'choice' or 'token'")
    order_A = jnp.argsort(sort_key_A, stable=True)
    counts_E = jnp.zeros((n_experts,), jnp.int32).at[ids_A].add(1)
    token_A = jnp.arange(n * k, dtype=jnp.int32) // k
    return order_A, ids_A[order_A], token_A[order_A], counts_E, real_A[order_A], real_A


def dispatch_capacity(
    x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None, *,
    activation: str, capacity_factor: float, valid_N=None, priority: str = "choice",
    capacity: int | None = None,
) -> DispatchOut:
    """Capacity-limited dispatch with fixed ``[E, C, D]`` expert buffers.

    ``C = expert_capacity(N, k, E, capacity_factor)``, or ``capacity`` when given. Priority when
    an expert is over capacity: assignments of real tokens (``valid_N``, default all real) come
    before padding tokens; among those, with ``priority="choice"`` (GShard, the default) every
    token's first choice before any second choice (slot rank ``k``: ``ids_NK`` ordered by gate,
    as top-k returns them) and then the earlier flat token index ``n = b * T + t``;
    ``priority="token"`` orders by token index only (a token's second choice can then push out a
    later token's first choice). Assignments past position ``C`` in their expert's queue are
    dropped: they contribute zero to ``y_N`` (the residual stream carries the token), and
    dropped real-token assignments are counted in ``n_dropped``.
    """
    _check_weights(activation, w_up_EDF, w_down_EFD, w_gate_EDF, stacked=True)
    act = activation_fn(activation)

    def experts(x_ECD):
        dt = x_ECD.dtype
        up_ECF = jnp.einsum("ecd,edf->ecf", x_ECD, w_up_EDF.astype(dt))
        if w_gate_EDF is not None:
            h_ECF = act(jnp.einsum("ecd,edf->ecf", x_ECD, w_gate_EDF.astype(dt))) * up_ECF
        else:
            h_ECF = act(up_ECF)
        return jnp.einsum("ecf,efd->ecd", h_ECF, w_down_EFD.astype(dt))

    return capacity_apply(x_ND, ids_NK, weights_NK, w_up_EDF.shape[0], experts,
                          capacity_factor=capacity_factor, valid_N=valid_N, priority=priority,
                          capacity=capacity)


def capacity_apply(x_ND, ids_NK, weights_NK, n_experts: int, experts_fn, *,
                   capacity_factor: float, valid_N=None, priority: str = "choice",
                   capacity: int | None = None) -> DispatchOut:
    """:func:`dispatch_capacity` with the expert computation given as ``experts_fn(x_ECD) ->
    y_ECD`` (the ``[E, C, D]`` buffers in and out): the same layout, drops and combine for
    experts whose weights are not one stacked array (e.g. synthesised one at a time)."""
    dt = x_ND.dtype
    n_tok, d = x_ND.shape
    k = ids_NK.shape[1]
    cap = capacity or expert_capacity(n_tok, k, n_experts, capacity_factor)
    n_assign = n_tok * k

    order_A, eid_S, tok_S, counts_E, real_S, real_A = _sort_assignments(ids_NK, valid_N,
                                                                        n_experts, priority)
    starts_E = jnp.cumsum(counts_E) - counts_E
    pos_S = jnp.arange(n_assign, dtype=jnp.int32) - starts_E[eid_S]
    keep_S = pos_S < cap
    n_slots = n_experts * cap
    slot_S = jnp.where(keep_S, eid_S * cap + pos_S, n_slots)  # n_slots = "dropped" sentinel

    # Gather tokens into the expert buffers (empty slots read a zero row at index N).
    table_C = jnp.full((n_slots,), n_tok, jnp.int32).at[slot_S].set(tok_S, mode="drop")
    x_pad = jnp.concatenate([x_ND, jnp.zeros((1, d), dt)], axis=0)
    y_ECD = experts_fn(x_pad[table_C].reshape(n_experts, cap, d))

    # Gather each assignment's result back (dropped ones read the zero row) and combine.
    slot_A = jnp.zeros((n_assign,), jnp.int32).at[order_A].set(slot_S)
    y_pad = jnp.concatenate([y_ECD.reshape(n_slots, d), jnp.zeros((1, d), y_ECD.dtype)], axis=0)
    y_NKD = y_pad[slot_A].reshape(n_tok, k, d)
    y_ND = _combine(weights_NK, y_NKD, dt)

    n_dropped = jnp.sum((~keep_S) & real_S).astype(jnp.int32)
    n_real = jnp.maximum(jnp.sum(real_A), 1)
    return DispatchOut(y_ND, n_dropped, (n_dropped / n_real).astype(jnp.float32))


def dispatch_ragged(
    x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None, *,
    activation: str, valid_N=None, grouped_matmul=jax.lax.ragged_dot,
) -> DispatchOut:
    """Dropless dispatch: sort the ``N * k`` assignments by expert and run grouped matmuls
    (``grouped_matmul``: :func:`jax.lax.ragged_dot`,
    :func:`moejax.kernels.grouped.ragged.ragged_dot` or
    :func:`moejax.kernels.grouped.pallas_gmm.gmm`; group sizes = assignments per expert) for
    up/gate/down, then unsort and combine. ``valid_N`` is accepted for a uniform signature and
    ignored."""
    del valid_N
    _check_weights(activation, w_up_EDF, w_down_EFD, w_gate_EDF, stacked=True)
    act = activation_fn(activation)
    dt = x_ND.dtype
    order_A, inv_A, group_sizes_E = _by_expert(ids_NK, w_up_EDF.shape[0])
    x_SD = sort_rows(x_ND, order_A, inv_A, ids_NK.shape[1])
    up_SF = grouped_matmul(x_SD, w_up_EDF.astype(dt), group_sizes_E)
    if w_gate_EDF is not None:
        h_SF = act(grouped_matmul(x_SD, w_gate_EDF.astype(dt), group_sizes_E)) * up_SF
    else:
        h_SF = act(up_SF)
    y_SD = grouped_matmul(h_SF, w_down_EFD.astype(dt), group_sizes_E)
    return _unsort_combine(y_SD, order_A, inv_A, weights_NK, x_ND)


def _by_expert(ids_NK, n_experts: int):
    """``(order_A, inv_A, group_sizes_E)``: assignments sorted by expert (stable), the
    inverse permutation, group sizes."""
    ids_A = ids_NK.reshape(-1).astype(jnp.int32)
    order_A = jnp.argsort(ids_A, stable=True)
    return (order_A, inverse_permutation(order_A),
            jnp.zeros((n_experts,), jnp.int32).at[ids_A].add(1))


def _unsort_combine(y_SD, order_A, inv_A, weights_NK, x_ND) -> DispatchOut:
    """Sorted per-assignment outputs back to token order, combined with the gates."""
    n_tok, d = x_ND.shape
    y_NKD = unsort_rows(y_SD, order_A, inv_A).reshape(n_tok, weights_NK.shape[1], d)
    return DispatchOut(_combine(weights_NK, y_NKD, x_ND.dtype), *_no_drop(x_ND))


def grouped_tile(n_assignments: int, n_experts: int) -> int:
    """Row tile of the grouped layout: the power of two nearest the mean group size, in
    [8, 128] (padding costs at most ``tile`` rows per expert)."""
    mean = max(1, n_assignments // max(n_experts, 1))
    return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


def dispatch_grouped(
    x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None, *,
    activation: str, valid_N=None, tile: int | None = None,
) -> DispatchOut:
    """Dropless dispatch on the block-padded grouped layout (module docstring); ``tile`` rows
    per tile (default :func:`grouped_tile`). ``valid_N`` is accepted and ignored."""
    del valid_N
    _check_weights(activation, w_up_EDF, w_down_EFD, w_gate_EDF, stacked=True)
    act = activation_fn(activation)
    dt = x_ND.dtype
    d, k, n_experts = x_ND.shape[1], ids_NK.shape[1], w_up_EDF.shape[0]
    m = ids_NK.size
    tm = tile or grouped_tile(m, n_experts)
    order_A, inv_A, group_sizes_E = _by_expert(ids_NK, n_experts)
    padded_S, tile_group_T, _, _, T = group_tiles(group_sizes_E, m, tm)
    x_SD = sort_rows(x_ND, order_A, inv_A, k)
    x_TmD = jnp.zeros((T * tm, d), dt).at[padded_S].set(x_SD, mode="drop").reshape(T, tm, d)
    up = jnp.einsum("tmd,tdf->tmf", x_TmD, w_up_EDF.astype(dt)[tile_group_T])
    if w_gate_EDF is not None:
        h = act(jnp.einsum("tmd,tdf->tmf", x_TmD, w_gate_EDF.astype(dt)[tile_group_T])) * up
    else:
        h = act(up)
    y_TmD = jnp.einsum("tmf,tfd->tmd", h, w_down_EFD.astype(dt)[tile_group_T])
    y_SD = y_TmD.reshape(T * tm, d).at[padded_S].get(mode="fill", fill_value=0)
    return _unsort_combine(y_SD, order_A, inv_A, weights_NK, x_ND)


def bucket_capacities(n_tokens: int, top_k: int, n_experts: int,
                      factors: tuple[float, ...] = BUCKET_FACTORS) -> tuple[int, ...]:
    """The capacity ladder of :func:`dispatch_bucketed`: ``expert_capacity`` at each factor,
    then ``n_tokens`` (an expert gets at most one assignment per token), ascending."""
    return tuple(sorted({expert_capacity(n_tokens, top_k, n_experts, f) for f in factors}
                        | {n_tokens}))


def dispatch_bucketed(
    x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None, *,
    activation: str, valid_N=None, priority: str = "choice",
    factors: tuple[float, ...] = BUCKET_FACTORS,
) -> DispatchOut:
    """Dropless dispatch: :func:`dispatch_capacity` at the smallest capacity of
    :func:`bucket_capacities` that is at least the largest number of assignments (padding
    tokens' included) any expert receives, so nothing is dropped."""
    n_tok, k = ids_NK.shape
    n_experts = w_up_EDF.shape[0]
    caps = bucket_capacities(n_tok, k, n_experts, factors)
    counts_E = jnp.zeros((n_experts,), jnp.int32).at[ids_NK.reshape(-1)].add(1)
    rung = jnp.sum(jnp.max(counts_E) > jnp.asarray(caps, jnp.int32))

    def at(cap):
        # rematerialised: the backward of lax.switch keeps every rung's residuals (zeros for
        # the rungs not taken), which cost more than recomputing the taken rung's forward
        return jax.checkpoint(lambda ops: dispatch_capacity(
            *ops, activation=activation, capacity_factor=1.0, valid_N=valid_N,
            priority=priority, capacity=cap))

    ops = (x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF)
    return jax.lax.switch(rung, [at(c) for c in caps], ops)

