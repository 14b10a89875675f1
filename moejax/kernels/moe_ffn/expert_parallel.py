"""Expert-parallel MoE dispatch: tokens travel to the devices that hold their experts with an
explicit all-to-all, and the results travel back (GShard / MaxText style).

Under a mesh with axes ``("data", "expert")``, tokens are sharded over both axes and the
stacked expert weights ``[E, ...]`` over ``"expert"`` (``E / n_ep`` local experts per device).
Per device, in a :func:`jax.shard_map`:

1. each (token, slot) row goes to the expert-axis device ``e // E_local`` that holds its expert:
   rows are packed into a send buffer ``[n_ep, C, D]`` (one block of ``C`` rows per
   destination, in token order; rows past ``C`` are dropped and counted);
2. ``all_to_all`` over ``"expert"`` delivers every device the rows for its experts, with their
   local expert ids;
3. the device runs its local experts on the received rows with a single-device dispatch path
   (``local``: the host kernel on a CPU, the Pallas grouped matmul on GPU/TPU);
4. a second ``all_to_all`` sends the results back; each token sums its slots' results weighted
   by the router's combine weights.

``capacity_factor=None`` is dropless: the devices agree (``pmax``) on the fullest block any of
them sends and take the smallest rung of a ladder of compiled buffer sizes that holds it
(``1.25, 1.5, 2, 3`` times the balanced load ``N_local K / n_ep``, then every row), so the
volume follows the routing's imbalance and nothing is dropped. A number is the capacity
variant: ``C = ceil(cf N_local K / n_ep)``, the all-to-all volume ``cf`` times the balanced
one, rows past ``C`` dropped (their slot contributes 0, as in the capacity path).

The router, its losses and everything outside the expert FFN stay ordinary SPMD code over the
global batch, so they are computed as on one device. Gradients come from differentiating the
``shard_map`` (an all-to-all's transpose is the reverse all-to-all); the expert weights'
gradients are reduced over ``"data"`` only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moejax.kernels.moe_ffn.jnp_paths import DispatchOut

__all__ = ["expert_parallel_dispatch", "expert_axis_size", "check_expert_parallel",
           "send_capacity", "capacity_rungs", "dropless_need"]

TOKENS = ("data", "expert")
# Dropless send-buffer rungs, as multiples of the balanced load; the last rung is every row.
DROPLESS_RUNGS: tuple[float, ...] = (1.25, 1.5, 2.0, 3.0)


def expert_axis_size(mesh, axes: tuple[str, str] = TOKENS) -> int:
    """Size of the mesh's expert axis (``axes[1]``; 1 when there is no mesh or no such axis)."""
    if mesh is None or axes[1] not in getattr(mesh, "axis_names", ()):
        return 1
    return int(mesh.shape[axes[1]])


def check_expert_parallel(mesh, n_tokens: int, n_experts: int,
                          axes: tuple[str, str] = TOKENS) -> None:
    """Refuse, before compiling, shapes the expert-parallel layout cannot take."""
    n_ep = expert_axis_size(mesh, axes)
    n_dev = math.prod(int(mesh.shape[a]) for a in axes)
    if n_experts % n_ep:
        raise ValueError(f"expert parallelism: the mesh's expert axis ({n_ep} devices) does not "
                         f"divide the {n_experts} experts; use an expert axis that divides "
                         f"{n_experts} (mesh_expert=...)")
    if n_tokens % n_dev:
        raise ValueError(f"expert parallelism: {n_tokens} tokens do not divide over the "
                         f"{n_dev} devices of the data x expert axes; use a batch size x "
                         f"sequence length divisible by {n_dev}")


def send_capacity(n_local_rows: int, n_ep: int, capacity_factor: float | None) -> int:
    """Rows per destination device in the send buffer (see the module docstring)."""
    if capacity_factor is None:
        return n_local_rows
    return max(1, min(n_local_rows, math.ceil(capacity_factor * n_local_rows / n_ep)))


def capacity_rungs(n_local_rows: int, n_ep: int) -> list[int]:
    """The dropless path's send-buffer sizes (rows per destination), ascending."""
    return sorted({send_capacity(n_local_rows, n_ep, f) for f in DROPLESS_RUNGS}
                  | {n_local_rows})


def dropless_need(ids_NK, n_devices: int, n_ep: int, e_local: int) -> int:
    """Host-side: the most rows any device sends to one destination for routing ``ids_NK``
    (tokens in contiguous blocks per device, as the dispatch shards them)."""
    ids = np.asarray(ids_NK).reshape(n_devices, -1)
    dest = ids // e_local
    return int(max(np.bincount(row, minlength=n_ep).max() for row in dest))


def _pack(ids_NK, valid_N, n_ep: int, e_local: int, C: int):
    """Each row's destination device, its slot in the flat send buffer (``n_ep C`` = dropped),
    its local expert id and whether it is kept."""
    N, K = ids_NK.shape
    e_R = ids_NK.reshape(-1).astype(jnp.int32)
    dest_R, local_R = e_R // e_local, e_R % e_local
    valid_R = jnp.ones((N * K,), bool) if valid_N is None else jnp.repeat(valid_N, K)
    onehot_RD = (dest_R[:, None] == jnp.arange(n_ep)[None, :]) & valid_R[:, None]
    pos_R = jnp.take_along_axis(jnp.cumsum(onehot_RD, axis=0), dest_R[:, None], 1)[:, 0] - 1
    keep_R = valid_R & (pos_R < C)
    slot_R = jnp.where(keep_R, dest_R * C + pos_R, n_ep * C)
    return slot_R, local_R, valid_R, keep_R


def expert_parallel_dispatch(x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None,
                             *, mesh, local: Callable[..., DispatchOut], activation: str,
                             capacity_factor: float | None = None, valid_N=None,
                             axes: tuple[str, str] = TOKENS) -> DispatchOut:
    """``DispatchOut`` of the expert-parallel dispatch over ``mesh`` (module docstring).
    ``local(x, ids, weights, w_up, w_down, w_gate, activation=..., valid_N=...)`` computes a
    device's own experts; ``axes``: the mesh's ``(data, expert)`` axis names."""
    N, K = ids_NK.shape
    E = w_up_EDF.shape[0]
    check_expert_parallel(mesh, N, E, axes)
    n_ep = expert_axis_size(mesh, axes)
    n_dev = math.prod(int(mesh.shape[a]) for a in axes)
    tokens, expert = tuple(axes), axes[1]
    e_local = E // n_ep
    rows = (N // n_dev) * K
    C = send_capacity(rows, n_ep, capacity_factor)
    rungs = [C] if capacity_factor is not None else capacity_rungs(rows, n_ep)
    gated = w_gate_EDF is not None
    masked = valid_N is not None

    a2a = lambda a: jax.lax.all_to_all(a, expert, 0, 0, tiled=True)  # noqa: E731
    R = max(rungs)

    def send(C, x, ids, valid):
        """Pack and exchange with blocks of ``C`` rows; the received rows padded to ``R`` per
        source (so the local experts are traced once), their slots and kept rows."""
        D = x.shape[1]
        slot_R, local_R, valid_R, keep_R = _pack(ids, valid, n_ep, e_local, C)
        send_x = jnp.zeros((n_ep * C, D), x.dtype).at[slot_R].set(jnp.repeat(x, K, axis=0),
                                                                  mode="drop")
        send_e = jnp.full((n_ep * C,), -1, jnp.int32).at[slot_R].set(local_R, mode="drop")
        recv_x = a2a(send_x).reshape(n_ep, C, D)
        recv_e = a2a(send_e).reshape(n_ep, C)
        recv_x = jnp.pad(recv_x, ((0, 0), (0, R - C), (0, 0))).reshape(n_ep * R, D)
        recv_e = jnp.pad(recv_e, ((0, 0), (0, R - C)), constant_values=-1).reshape(-1)
        return recv_x, recv_e, slot_R, keep_R, valid_R

    def back(C, y_full, slot_R):
        """Return each source its ``C``-row block of results; each row's result by slot."""
        y_blocks = y_full.reshape(n_ep, R, -1)[:, :C].reshape(n_ep * C, -1)
        return a2a(y_blocks).at[slot_R].get(mode="fill", fill_value=0)

    def body(x, ids, wts, wu, wd, *rest):
        wg = rest[0] if gated else None
        valid = rest[-1] if masked else None
        n, D = x.shape
        if capacity_factor is not None:
            recv_x, recv_e, slot_R, keep_R, valid_R = send(C, x, ids, valid)
        else:  # dropless: the smallest capacity rung that holds every device's fullest send
            dest_R = ids.reshape(-1) // e_local
            ok_R = jnp.ones_like(dest_R, bool) if valid is None else jnp.repeat(valid, K)
            sent = jnp.zeros((n_ep,), jnp.int32).at[dest_R].add(ok_R.astype(jnp.int32))
            rung = jnp.sum(jnp.asarray(rungs[:-1]) < jax.lax.pmax(jnp.max(sent), tokens))
            recv_x, recv_e, slot_R, keep_R, valid_R = jax.lax.switch(
                rung, [functools.partial(send, c) for c in rungs], x, ids, valid)
        got = recv_e >= 0
        out = local(recv_x, jnp.maximum(recv_e, 0)[:, None],
                    jnp.ones((recv_x.shape[0], 1), x.dtype), wu, wd, wg,
                    activation=activation, valid_N=got)
        y_full = jnp.where(got[:, None], out.y_ND, 0).astype(x.dtype)
        if capacity_factor is not None:
            y_R = back(C, y_full, slot_R)
        else:
            y_R = jax.lax.switch(rung, [functools.partial(back, c) for c in rungs], y_full,
                                 slot_R)
        y = jnp.einsum("nk,nkd->nd", wts.astype(y_R.dtype), y_R.reshape(n, K, D))
        dropped = jax.lax.psum(jnp.sum(valid_R & ~keep_R), tokens)
        real = jax.lax.psum(jnp.sum(valid_R), tokens)
        return (y.astype(x.dtype), dropped,
                (dropped / jnp.maximum(real, 1)).astype(jnp.float32))

    tok, w = P(tokens), P(expert)
    args = [x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD]
    specs = [tok, tok, tok, w, w]
    if gated:
        args.append(w_gate_EDF)
        specs.append(w)
    if masked:
        args.append(valid_N)
        specs.append(tok)
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(tok, P(), P()),
                       check_vma=False)
    y, dropped, frac = fn(*args)
    return DispatchOut(y, dropped, frac)
