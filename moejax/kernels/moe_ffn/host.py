"""The whole routed-expert FFN on the host, fused: one callback forward, one backward.

``host_moe(x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF, activation=...)``
computes what every dispatch path computes (:mod:`moejax.kernels.moe_ffn.jnp_paths`)::
    y_N[n] = sum_k weights_NK[n, k] * E_{ids_NK[n, k]}(x_N[n])

the way an eager framework's expert loop does, but without its per-op dispatch: for each
expert, its tokens are gathered, ``act(x W_gate) * (x W_up)`` and ``@ W_down`` run on that
block while it is in cache, and the results are combined once at the end. The forward and the
backward (gate, up, down and input gradients, the activation's derivative, the combine
weights' gradient) are each one ``buffer_callback`` (numpy writes XLA's output buffers in
place) under a ``custom_vjp``. Experts run as tasks on the machine's cores, each task's
matmuls on one BLAS thread (the elementwise work of an expert loop is single-threaded in
numpy, so splitting by expert parallelises it too); an expert holding more than its share of
the rows is split into row chunks whose weight gradients are summed. The result is
deterministic: every sum runs in a fixed order.

``capacity=None`` is dropless (``dispatch="host"``). ``capacity=C`` keeps, per expert, the
first ``C`` assignments in :func:`moejax.kernels.moe_ffn.jnp_paths.dispatch_capacity`'s priority
order
and drops the rest, with that path's semantics (``dispatch="host_capacity"``), but only the
kept rows are computed: no padded buffers.

The forward keeps, per kept assignment, what the backward needs so that it evaluates no
activation (:func:`_residual_names`): with a gate ``act(g)``, ``act(g) u`` and ``u act'(g)``,
without ``act(u)`` and ``act'(u)``, and the unweighted output, in float32 (``3 N k F + N k D``
floats with a gate, ``2 N k F + N k D`` without); the backward's elementwise work is then two
products: numpy's float32 ``exp`` costs as much as several multiplies, so computing it once
instead of twice is worth a residual. They are fresh XLA buffers every step: they are advised
onto transparent huge pages before the first write
(:func:`moejax.kernels.host_memory.advise_huge_pages`), and ``dx`` is written over ``dy``'s
buffer.

Inputs of any float dtype are computed in float32 and cast back. First-order gradients only;
CPU backend only (tracing on another backend raises: an accelerator would copy every
activation to the host).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from moejax.kernels.host_memory import advise_huge_pages
from moejax.kernels.moe_ffn.host_act import HOST_ACTIVATIONS, act_into, base_activation
from moejax.ops.activations import is_gated

__all__ = ["host_moe", "HOST_ACTIVATIONS", "host_threads"]

_MIN_CHUNK_ROWS = 128   # below this BLAS runs far under its rate; never split an expert finer
_SERIAL_ROWS = 64       # this few rows in all: no thread pool (decode steps, tests)


# -- layout: which assignments each expert keeps, in priority order -------------------------

class _Layout(NamedTuple):
    order_S: np.ndarray     # kept assignments (flat n * K + k), grouped by expert
    starts_E1: np.ndarray   # expert e's kept rows are order_S[starts[e]:starts[e + 1]]
    row_A: np.ndarray       # flat assignment -> its row in order_S, or S (dropped)
    n_dropped: int          # real-token assignments dropped


def _layout(ids_NK, real_N, n_experts: int, capacity: int | None, priority: str) -> _Layout:
    """Assignments ordered as :func:`moejax.kernels.moe_ffn.jnp_paths._sort_assignments`
    orders them; with a capacity, each expert keeps the first ``capacity`` of its queue."""
    n, k = ids_NK.shape
    ids_A = ids_NK.reshape(-1).astype(np.int64)
    if capacity is None:
        order = np.argsort(ids_A, kind="stable")
        counts = np.bincount(ids_A, minlength=n_experts)
        n_dropped = 0
    else:
        pad_A = np.repeat(~real_N, k).astype(np.int64)
        if priority == "choice":
            key = ids_A * (2 * k) + pad_A * k + np.arange(n * k) % k
        else:
            key = ids_A * 2 + pad_A
        order = np.argsort(key, kind="stable")
        counts_all = np.bincount(ids_A, minlength=n_experts)
        starts_all = np.concatenate([[0], np.cumsum(counts_all)])
        pos = np.arange(n * k) - starts_all[ids_A[order]]
        keep = pos < capacity
        n_dropped = int(np.sum(~keep & (pad_A[order] == 0)))
        order = order[keep]
        counts = np.minimum(counts_all, capacity)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    row_A = np.full(n * k, order.size, np.int64)
    row_A[order] = np.arange(order.size)
    return _Layout(order, starts, row_A, n_dropped)


def host_threads() -> int:
    """Cores this process may run on (the expert tasks' thread count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _tasks(starts_E1: np.ndarray, threads: int, busy_E: np.ndarray | None = None):
    """Row ranges ``(e, a, b)``, largest first: each expert whole unless it holds more than
    half a thread's share, then split into chunks of at least ``_MIN_CHUNK_ROWS`` rows.
    ``busy_E`` (bool, optional): only those experts (the others have nothing to compute)."""
    experts = range(starts_E1.size - 1)
    if busy_E is not None:
        experts = [e for e in experts if busy_E[e]]
    total = sum(int(starts_E1[e + 1] - starts_E1[e]) for e in experts)
    chunk = max(_MIN_CHUNK_ROWS, math.ceil(total / max(2 * threads, 1)))
    out = []
    for e in experts:
        a, b = int(starts_E1[e]), int(starts_E1[e + 1])
        pieces = max(1, math.ceil((b - a) / chunk)) if threads > 1 else 1
        edges = np.linspace(a, b, pieces + 1).round().astype(int)
        out += [(e, int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]
    return sorted(out, key=lambda t: t[1] - t[2])


class _Scratch:
    """One thread's buffers for one callback, reused by every task the thread runs (``np.empty``
    touches no memory: a buffer a task never uses costs nothing)."""

    def __init__(self, rows: int, d: int, f: int):
        self.wide = [np.empty((rows, f), np.float32) for _ in range(5)]
        self.narrow = [np.empty((rows, d), np.float32) for _ in range(3)]


@functools.cache
def _blas():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()   # scanning the loaded libraries costs ~1 ms: once


def _run(fn, tasks, d: int, f: int):
    """``[fn(*task, scratch) for task in tasks]``, on the cores (one BLAS thread each, one
    scratch per thread) when there is enough work."""
    rows = max((b - a for _, a, b in tasks), default=0)
    threads = min(host_threads(), len(tasks))
    if threads <= 1 or sum(b - a for _, a, b in tasks) < _SERIAL_ROWS:
        scratch = _Scratch(rows, d, f)
        with _blas().limit(limits=1, user_api="blas"):  # idle BLAS threads spin, slowing
            return [fn(*t, scratch) for t in tasks]     # the XLA ops that follow
    # allocated here, in the calling thread, and handed out: the workers of a fresh pool would
    # each take new pages
    free = [_Scratch(rows, d, f) for _ in range(threads)]
    lock, local = threading.Lock(), threading.local()

    def call(t):
        if not hasattr(local, "scratch"):
            with lock:
                local.scratch = free.pop()
        return fn(*t, local.scratch)

    with _blas().limit(limits=1, user_api="blas"), ThreadPoolExecutor(threads) as pool:
        return list(pool.map(call, tasks))


def _f32(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _target(out) -> np.ndarray:
    """``out`` itself when float32 (written in place), else a float32 buffer for :func:`_put`."""
    out = np.asarray(out)
    return out if out.dtype == np.float32 else np.empty(out.shape, np.float32)


def _put(out, value: np.ndarray) -> None:
    out = np.asarray(out)
    if not np.may_share_memory(value, out):   # the same buffer when _target returned out
        out[...] = value.astype(out.dtype)


def _combine_into(y: np.ndarray, rows_S: np.ndarray, row_A: np.ndarray, wts_NK,
                  chunk: int = 256) -> None:
    """``y[n] = sum_k wts[n, k] rows_S[row_A[n K + k]]`` (``wts`` None: weight 1), ``chunk``
    tokens at a time (a small scratch that stays in cache, not a fresh ``y``-sized one).
    Every ``np.take`` here uses ``mode="clip"``: the rows are in range by construction, and
    the default "raise" buffers ``out`` (a copy per call)."""
    n, k = y.shape[0], row_A.size // y.shape[0]
    row_NK = row_A.reshape(n, k)
    tmp = np.empty((min(chunk, n), y.shape[1]), np.float32)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        yc, tc = y[lo:hi], tmp[:hi - lo]
        for j in range(k):
            dst = yc if j == 0 else tc
            np.take(rows_S, row_NK[lo:hi, j], axis=0, out=dst, mode="clip")
            if wts_NK is not None:
                dst *= wts_NK[lo:hi, j:j + 1]
            if j:
                yc += tc


# -- the two callbacks -----------------------------------------------------------------------

def _rows(buf: np.ndarray, r: int, f: int) -> np.ndarray:
    """A contiguous ``[r, f]`` view of the start of the scratch buffer ``buf``."""
    return buf.reshape(-1)[:r * f].reshape(r, f)


def _forward_np(ctx, outs, x_ND, ids_NK, weights_NK, real_N, widths_E, w_up, w_down, *w_gate,
                activation: str, capacity, priority: str, keep: bool):
    """``outs = (y_ND, n_dropped[, *residuals])``, the residuals (only with ``keep``) those of
    :func:`_residual_names`: row ``i`` for the layout's ``i``-th kept assignment, the rest 0.
    Without ``keep``, expert ``e`` computes only its first ``widths_E[e]`` hidden units."""
    del ctx
    advise_huge_pages(*outs)
    x, w_up, w_down = _f32(x_ND), _f32(w_up), _f32(w_down)
    w_gate = _f32(w_gate[0]) if w_gate else None
    ids, wts = np.asarray(ids_NK), _f32(weights_NK)
    widths = np.asarray(widths_E)
    n, k = ids.shape
    d, f = x.shape[1], w_up.shape[2]
    lay = _layout(ids, np.asarray(real_N), w_up.shape[0], capacity, priority)
    s_rows = lay.order_S.size
    res = [np.asarray(o) for o in outs[2:]] if keep else []
    # gated: A = act(g), H = A u, M = u act'(g); plain: H = act(u), M = act'(u)
    A, H, M, Y = (res if w_gate is not None else [None, *res]) if keep else [None] * 4
    if Y is None:
        Y = np.empty((s_rows + 1, d), np.float32)
    tok_S = lay.order_S // k
    act = base_activation(activation)

    def expert(e, a, b, ws):
        r = b - a
        fe = f if keep else min(f, int(widths[e]))
        xe = ws.narrow[0][:r]
        np.take(x, tok_S[a:b], axis=0, out=xe, mode="clip")
        u = _rows(ws.wide[0], r, fe)
        np.matmul(xe, w_up[e][:, :fe], out=u)
        h = H[a:b] if H is not None else _rows(ws.wide[1], r, fe)
        m = M[a:b] if M is not None else None
        tmp, tmp2 = _rows(ws.wide[3], r, fe), _rows(ws.wide[4], r, fe)
        if w_gate is not None:
            g = _rows(ws.wide[2], r, fe)
            np.matmul(xe, w_gate[e][:, :fe], out=g)
            act_g = A[a:b] if A is not None else h
            act_into(act, g, act_g, m, tmp, tmp2)   # A = act(g), M = act'(g) ...
            if m is not None:
                m *= u                              # ... * u
            np.multiply(act_g, u, out=h)
        else:
            act_into(act, u, h, m, tmp, tmp2)
        np.matmul(h, w_down[e][:fe], out=Y[a:b])

    busy = np.ones(w_up.shape[0], bool) if keep else widths > 0
    for e in np.flatnonzero(~busy):  # experts of width 0 add nothing: their rows are zero
        Y[lay.starts_E1[e]:lay.starts_E1[e + 1]] = 0
    _run(expert, _tasks(lay.starts_E1, host_threads(), busy), d, f)
    for r in (res if keep else [Y]):  # rows no assignment owns: zero (the dropped ones' row)
        r[s_rows:] = 0
    y = _target(outs[0])
    _combine_into(y, Y, lay.row_A, wts)
    _put(outs[0], y)
    np.asarray(outs[1])[...] = lay.n_dropped


def _backward_np(ctx, outs, dy_ND, x_ND, ids_NK, weights_NK, real_N, w_up, w_down, *rest,
                 activation: str, capacity, priority: str):
    """``outs = (dx_ND, dweights_NK, dw_up, dw_down[, dw_gate])``; ``rest`` is the forward's
    residuals (:func:`_residual_names`), then ``w_gate`` when gated."""
    del ctx
    advise_huge_pages(*outs)
    gated = len(rest) == 5
    x, w_up, w_down = _f32(x_ND), _f32(w_up), _f32(w_down)
    w_gate = _f32(rest[4]) if gated else None
    A, H, M, Y = [np.asarray(a) for a in rest[:4]] if gated else [None, *map(np.asarray, rest)]
    ids, wts, dy = np.asarray(ids_NK), _f32(weights_NK), _f32(dy_ND)
    n, k = ids.shape
    d, f = x.shape[1], w_up.shape[2]
    lay = _layout(ids, np.asarray(real_N), w_up.shape[0], capacity, priority)
    s_rows = lay.order_S.size
    tok_S, w_S = lay.order_S // k, wts.reshape(-1)[lay.order_S]
    dw_S = np.zeros(n * k, np.float32)
    dX = np.empty((s_rows + 1, d), np.float32)
    advise_huge_pages(dX)       # fresh each call; numpy advises only arrays of >= 4 MiB itself
    dX[s_rows] = 0                                  # the dropped assignments' row
    bufs = [_target(o) for o in outs[2:]]           # dW_up, dW_down[, dW_gate]
    dWu, dWd = bufs[:2]
    dWg = bufs[2] if gated else None
    tasks = _tasks(lay.starts_E1, host_threads())
    whole = {e for e, a, b in tasks if (a, b) == (lay.starts_E1[e], lay.starts_E1[e + 1])}
    for buf in bufs:                                # experts not written whole by one task
        buf[[e for e in range(buf.shape[0]) if e not in whole]] = 0

    def expert(e, a, b, ws):
        r = b - a
        t = tok_S[a:b]
        dye = ws.narrow[0][:r]
        np.take(dy, t, axis=0, out=dye, mode="clip")
        dw_S[lay.order_S[a:b]] = np.einsum("md,md->m", dye, Y[a:b])
        dye *= w_S[a:b, None]
        da = ws.wide[0][:r]                         # dL/dH
        np.matmul(dye, w_down[e].T, out=da)
        xe = ws.narrow[1][:r]
        np.take(x, t, axis=0, out=xe, mode="clip")
        if gated:
            du = ws.wide[1][:r]
            np.multiply(da, A[a:b], out=du)         # dU = dH act(g)
            da *= M[a:b]                            # dG = dH u act'(g)
            np.matmul(du, w_up[e].T, out=dX[a:b])
            np.matmul(da, w_gate[e].T, out=ws.narrow[2][:r])
            dX[a:b] += ws.narrow[2][:r]
            grads = ((dWd, H[a:b], dye), (dWu, xe, du), (dWg, xe, da))
        else:
            da *= M[a:b]                            # dU = dH act'(u)
            np.matmul(da, w_up[e].T, out=dX[a:b])
            grads = ((dWd, H[a:b], dye), (dWu, xe, da))
        if e not in whole:
            return e, [lhs.T @ rhs for _, lhs, rhs in grads]
        for buf, lhs, rhs in grads:
            np.matmul(lhs.T, rhs, out=buf[e])
        return e, None

    parts = _run(expert, tasks, d, f)
    order = [dWd, dWu, dWg]
    for e, partial in sorted((p for p in parts if p[1] is not None), key=lambda p: p[0]):
        for buf, p in zip(order, partial):          # fixed order: deterministic sums
            buf[e] += p
    dx = _target(outs[0])
    _combine_into(dx, dX, lay.row_A, None)          # dX rows already carry the gates
    _put(outs[0], dx)
    _put(outs[1], dw_S.reshape(n, k))
    for o, buf in zip(outs[2:], bufs):
        _put(o, buf)


# -- jax wrapper -----------------------------------------------------------------------------

def _check_backend():
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"host_moe runs on the host's BLAS and is for the CPU backend (this one is "
            f"{jax.default_backend()!r}); use dispatch='grouped', 'gmm' or 'capacity' there")


def _call(fn, shapes, *args, aliases=None):
    return buffer_callback(fn, shapes, vmap_method="sequential",
                           input_output_aliases=aliases)(*args)


def _residual_names(gated: bool) -> tuple[str, ...]:
    """What the forward keeps for the backward, each ``[N k, F]`` (``Y``: ``[N k, D]``), rows in
    the layout's order: with a gate ``A = act(g)``, ``H = A u``, ``M = u act'(g)``; without,
    ``H = act(u)``, ``M = act'(u)``; ``Y = H W_down`` (for the combine weights' gradient).
    The backward then needs no activation and no exp: two products per element."""
    return ("A", "H", "M", "Y") if gated else ("H", "M", "Y")


def _fwd_shapes(x, ids, w_up, w_gate, keep: bool):
    s, f = ids.size, w_up.shape[2]
    y = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.int32))
    if not keep:
        return y
    return (*y, *(jax.ShapeDtypeStruct((s, x.shape[1] if name == "Y" else f), jnp.float32)
                  for name in _residual_names(w_gate is not None)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _host_moe(x, ids, weights, real, widths, w_up, w_down, w_gate, activation, capacity,
              priority):
    fn = functools.partial(_forward_np, activation=activation, capacity=capacity,
                           priority=priority, keep=False)
    gate = () if w_gate is None else (w_gate,)
    return _call(fn, _fwd_shapes(x, ids, w_up, w_gate, False), x, ids, weights, real, widths,
                 w_up, w_down, *gate)


def _fwd(x, ids, weights, real, widths, w_up, w_down, w_gate, activation, capacity, priority):
    # the residuals cover every hidden unit: the backward runs at full width (equal to the
    # truncated forward's gradient when the weights past each width are zero)
    fn = functools.partial(_forward_np, activation=activation, capacity=capacity,
                           priority=priority, keep=True)
    gate = () if w_gate is None else (w_gate,)
    y, n_drop, *res = _call(fn, _fwd_shapes(x, ids, w_up, w_gate, True), x, ids, weights, real,
                            widths, w_up, w_down, *gate)
    return (y, n_drop), (x, ids, weights, real, widths, w_up, w_down, w_gate, tuple(res))


def _bwd(activation, capacity, priority, saved, cts):
    x, ids, weights, real, widths, w_up, w_down, w_gate, res = saved
    dy = cts[0]
    fn = functools.partial(_backward_np, activation=activation, capacity=capacity,
                           priority=priority)
    gate = () if w_gate is None else (w_gate,)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                   for a in (x, weights, w_up, w_down, *gate))
    # dx is written over dy's buffer (read before dx is written): no fresh pages for dx
    aliases = {0: 0} if dy.dtype == x.dtype else None
    dx, dweights, dw_up, dw_down, *dw_gate = _call(fn, shapes, dy, x, ids, weights, real,
                                                   w_up, w_down, *res, *gate, aliases=aliases)
    f0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return (dx, f0(ids), dweights, f0(real), f0(widths), dw_up, dw_down,
            dw_gate[0] if w_gate is not None else None)


_host_moe.defvjp(_fwd, _bwd)


def host_moe(x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None, *,
             activation: str, capacity: int | None = None, valid_N=None,
             priority: str = "choice", widths_E=None, check_backend: bool = True):
    """``(y_ND, n_dropped)``: the routed experts' combined output computed on the host
    (module docstring). ``capacity=None`` drops nothing; ``capacity=C`` has
    :func:`moejax.kernels.moe_ffn.jnp_paths.dispatch_capacity`'s drop rule (``valid_N``:
    padding tokens yield first; ``priority``: "choice" or "token"). Weights are cast to
    ``x_ND``'s dtype.
    ``widths_E`` (int ``[E]``, optional): expert ``e``'s hidden units past ``widths_E[e]`` are
    zero-padding (experts of different widths in one padded array): the forward skips them
    (the result is the same; under differentiation every unit is computed).
    ``check_backend=False``: trace it on any backend (for a branch that is only lowered for
    the CPU: :func:`moejax.kernels.tiling.on_target`)."""
    if check_backend:
        _check_backend()
    if activation not in HOST_ACTIVATIONS:
        raise ValueError(f"host_moe: activation {activation!r} not supported; allowed: "
                         f"{HOST_ACTIVATIONS}")
    if (w_gate_EDF is not None) != is_gated(activation):
        raise ValueError(f"host_moe: activation {activation!r} "
                         f"{'needs' if is_gated(activation) else 'takes no'} w_gate")
    if priority not in ("choice", "token"):
        raise ValueError(f"priority={priority!r}; use 'choice' or 'token'")
    if capacity is not None and capacity < 1:
        raise ValueError(f"host_moe: capacity must be >= 1 or None, got {capacity}")
    dt = x_ND.dtype
    real = (jnp.ones(x_ND.shape[:1], bool) if valid_N is None
            else jnp.asarray(valid_N).reshape(-1).astype(bool))
    cast = lambda w: None if w is None else w.astype(dt)  # noqa: E731
    E, _, F = w_up_EDF.shape
    widths = (jnp.full((E,), F, jnp.int32) if widths_E is None
              else jnp.asarray(widths_E).reshape(E).astype(jnp.int32))
    return _host_moe(x_ND, jnp.asarray(ids_NK, jnp.int32), weights_NK, real, widths,
                     cast(w_up_EDF), cast(w_down_EFD), cast(w_gate_EDF), activation, capacity,
                     priority)
