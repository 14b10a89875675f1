"""BlockFFN's chunk-sparse expert computation (BlockFFN paper, Sec. 3.3) as kernels: each tile
of ``tile`` consecutive tokens reads only the weights of the experts in its union, in the
forward and in the backward.

``y_ND, overflow = chunk_union_kernel(x_ND, a_NE, active_NE, w_up, w_down, w_gate, ...)``
equals :func:`moejax.kernels.chunk_union.reference.chunk_union_experts` (and the dense oracle
when no tile overflows ``max_union``), with gradients in ``x``, the combine weights ``a`` (the
router's path) and every expert weight. Per tile ``c`` the union (members first, ascending) and its
clipped size ``count_c = min(|U_c|, max_union)`` are computed once in jnp; the (tile, member)
pairs are the rows of three pair products (:mod:`moejax.kernels.chunk_union.pairs`, Mosaic on TPU,
Triton on GPU, chosen for the platform the function is built for):

* forward: ``pre = x_c W_up[e]`` per pair (``pair_up``); ``h = act(pre) * A[:, e]`` (gated:
  ``act(x_c W_gate[e]) * pre * A[:, e]``) elementwise; ``y_c = sum_j h_cj W_down[e_cj]``
  (``pair_down``);
* backward: ``dh = dy_c W_down[e]^T`` (``pair_up``), the elementwise vjp gives ``dpre`` (and
  ``dgate``) and the combine weights' gradient ``dA[:, e] = sum_f dh * act(pre)``;
  ``dx_c = sum_j dpre_cj W_up[e]^T`` (``pair_down``); ``dW_down[e] = sum h^T dy_c`` and
  ``dW_up[e] = sum x_c^T dpre`` over the expert's pairs (``pair_wgrad``).

Every product is tiled over rows, the contraction and the output columns, so any ``D``, ``F``
and tile length fits; the largest intermediates are the ``[C, max_union, tile, F]`` pair
activations, at most the dense path's ``[N, E, F]``.

``backend="triton"``: the forward as the fused Triton kernel of
:mod:`moejax.kernels.chunk_union.fused_triton` through ``jax_triton`` (GPU and the ``gpu`` extra);
its backward is the one above. ``interpret=True`` (or lowering for the CPU) runs the Mosaic
kernels in Pallas interpret mode: for tests. :func:`chunk_union_auto` is the path for models:
the jnp loop on the CPU, these kernels on GPU and TPU, and for one exact chunk of at most 64
tokens the decode kernels (:mod:`moejax.kernels.chunk_union.decode` on TPU,
:mod:`moejax.kernels.chunk_union.decode_gpu` on a Hopper GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.kernels.chunk_union.decode import MAX_CHUNK, check_expert_weights, chunk_union_decode
from moejax.kernels.chunk_union.decode_gpu import chunk_union_decode_gpu, supports
from moejax.kernels.chunk_union.pairs import (
    GPU_INTERPRET,
    gpu_kernels_take,
    pair_down,
    pair_up,
    pair_wgrad,
    union_pairs,
)
from moejax.kernels.chunk_union.reference import (
    chunk_union_experts,
    dense_chunk,
    pad_to_tiles,
    union_members,
)
from moejax.kernels.tiling import hopper_target, on_target, target_device
from moejax.ops.activations import activation_fn

__all__ = ["chunk_union_kernel", "chunk_union_pallas", "chunk_union_auto", "tile_unions",
           "decode_chunk", "decode_route", "DECODE_ROUTES", "add_residual"]

BACKENDS = ("pallas", "triton")


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


def _hidden(pre, gate, a_Pn, activation):
    """``act(pre) * a`` (gated: ``act(gate) * pre * a``), computed in float32."""
    act = activation_fn(activation)
    pre = pre.astype(jnp.float32)
    h = act(pre) if gate is None else act(gate.astype(jnp.float32)) * pre
    return h * a_Pn[..., None]


def _pair_weights(ap_NE, ids_CU, valid_P, tile):
    """``[P, tile]`` float32: each pair's combine-weight column over its tile's tokens."""
    C, U = ids_CU.shape
    a_CnE = ap_NE.reshape(C, tile, -1).astype(jnp.float32)
    a_CnU = jnp.take_along_axis(a_CnE, ids_CU[:, None, :], axis=2)
    return jnp.swapaxes(a_CnU, 1, 2).reshape(C * U, tile) * valid_P[:, None]


def _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile, max_union,
             backend, interpret, keep: bool = False):
    """``((y_ND, overflow), residuals or None)``; ``keep``: also what the backward needs."""
    N, D = x_ND.shape
    E = a_NE.shape[-1]
    xp, ap, ids_CU, count_C, overflow = tile_unions(tile, max_union, x_ND, a_NE, active_NE)
    C = xp.shape[0] // tile
    dt = x_ND.dtype
    wu, wd = w_up.astype(dt), w_down.astype(dt)
    wg = None if w_gate is None else w_gate.astype(dt)
    xs = xp.reshape(C, tile, D)
    pairs = union_pairs(ids_CU, count_C, E)
    a_Pn = _pair_weights(pad_to_tiles(tile, a_NE)[0], ids_CU, pairs.valid, tile)
    pre = gate = None
    if keep or backend != "triton":
        pre = pair_up(xs, wu, pairs, interpret=interpret)
        gate = None if wg is None else pair_up(xs, wg, pairs, interpret=interpret)
    if backend == "triton":
        # imported on use: importing triton fixes its interpreter mode (TRITON_INTERPRET)
        from moejax.kernels.chunk_union.fused_triton import chunk_union_triton_call

        weights = [w for w in (wu, wd, wg) if w is not None]
        y = chunk_union_triton_call(xp, ap, ids_CU, count_C, *weights, activation=activation,
                                    tile=tile)
    else:
        h = _hidden(pre, gate, a_Pn, activation).astype(dt)
        y = pair_down(h, wd, pairs, interpret=interpret).reshape(C * tile, D)
    residuals = (xs, pre, gate, a_Pn, pairs, ids_CU, a_NE, w_up, w_down, w_gate) if keep else None
    return (y[:N].astype(dt), overflow), residuals


_STATIC = (6, 7, 8, 9, 10)


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _chunk_union(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static):
    return _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static)[0]


def _fwd(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static):
    return _forward(x_ND, a_NE, active_NE, w_up, w_down, w_gate, *static, keep=True)


def _bwd(activation, tile, max_union, backend, interpret, res, cts):
    del max_union, backend
    xs, pre, gate, a_Pn, pairs, ids_CU, a_NE, w_up, w_down, w_gate = res
    C, U = ids_CU.shape
    (N, E), D, dt = a_NE.shape, xs.shape[2], xs.dtype
    wu, wd = w_up.astype(dt), w_down.astype(dt)
    dys = jnp.pad(cts[0].astype(dt), ((0, C * tile - N), (0, 0))).reshape(C, tile, D)
    kw = dict(interpret=interpret)
    dh = pair_up(dys, wd, pairs, transpose=True, **kw).astype(jnp.float32)
    if gate is None:
        h, vjp = jax.vjp(lambda p, a: _hidden(p, None, a, activation), pre.astype(jnp.float32),
                         a_Pn)
        (dpre, da_Pn), dgate = vjp(dh), None
    else:
        h, vjp = jax.vjp(lambda p, g, a: _hidden(p, g, a, activation),
                         pre.astype(jnp.float32), gate.astype(jnp.float32), a_Pn)
        dpre, dgate, da_Pn = vjp(dh)
    dpre = dpre.astype(dt)
    dxs = pair_down(dpre, wu, pairs, transpose=True, **kw).astype(jnp.float32)
    dw_up = pair_wgrad(xs, dpre, pairs, E, l_by="tile", r_by="pair", **kw)
    dw_down = pair_wgrad(h.astype(dt), dys, pairs, E, l_by="pair", r_by="tile", **kw)
    dw_gate = None
    if gate is not None:
        dgate = dgate.astype(dt)
        dxs = dxs + pair_down(dgate, w_gate.astype(dt), pairs, transpose=True,
                              **kw).astype(jnp.float32)
        dw_gate = pair_wgrad(xs, dgate, pairs, E, l_by="tile", r_by="pair",
                             **kw).astype(w_gate.dtype)
    # the combine weights' gradient: each pair's column back to its (token, expert) entries
    da_CnU = jnp.swapaxes((da_Pn * pairs.valid[:, None]).reshape(C, U, tile), 1, 2)
    da_CnE = jnp.zeros((C, tile, E), jnp.float32).at[
        jnp.arange(C)[:, None, None], jnp.arange(tile)[None, :, None], ids_CU[:, None, :]
    ].add(da_CnU)
    dx = dxs.reshape(C * tile, D)[:N].astype(dt)
    da = da_CnE.reshape(C * tile, E)[:N].astype(a_NE.dtype)
    return dx, da, None, dw_up.astype(w_up.dtype), dw_down.astype(w_down.dtype), dw_gate


_chunk_union.defvjp(_fwd, _bwd)


def _check(x_ND, a_NE, w_up, w_down, w_gate, tile, max_union):
    E = a_NE.shape[-1]
    if not 1 <= max_union <= E or tile < 1:
        raise ValueError(f"max_union={max_union} must be in [1, {E}] and tile={tile} >= 1")
    check_expert_weights(x_ND.shape, E, w_up, w_down, w_gate)


def chunk_union_kernel(x_ND, a_NE, active_NE, w_up, w_down, w_gate=None, *, activation: str,
                       tile: int, max_union: int, backend: str = "pallas",
                       interpret: bool | None = None):
    """``(y_ND, overflow_fraction)`` (see the module docstring). ``interpret``: None runs the
    platform's kernels (interpret mode when lowered for the CPU), True interpret mode
    everywhere, ``"mosaic_gpu"`` the GPU's Mosaic GPU pair kernels in Mosaic GPU's
    interpreter."""
    _check(x_ND, a_NE, w_up, w_down, w_gate, tile, max_union)
    activation_fn(activation)  # an unknown name fails here, before any lowering
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    interpret = interpret if interpret == GPU_INTERPRET else bool(interpret)
    return _chunk_union(x_ND, a_NE, active_NE, w_up, w_down, w_gate, activation, tile,
                        max_union, backend, interpret)


def chunk_union_pallas(x_ND, a_NE, active_NE, w_up, w_down, w_gate=None, *, activation: str,
                       tile: int, max_union: int, interpret: bool | None = None):
    """The Pallas kernels (``backend="pallas"``) of :func:`chunk_union_kernel`."""
    return chunk_union_kernel(x_ND, a_NE, active_NE, w_up, w_down, w_gate,
                              activation=activation, tile=tile, max_union=max_union,
                              backend="pallas", interpret=interpret)


DECODE_KERNELS = {"tpu": chunk_union_decode, "mosaic_gpu": chunk_union_decode_gpu}


def add_residual(residual, y):
    """``residual + y`` in the residual's dtype (a decoder block's residual add); ``y`` where
    there is no residual."""
    return y if residual is None else residual + y.astype(residual.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def decode_chunk(x_nD, a_nE, active_nE, w_up, w_down, w_gate, residual_nD, activation,
                 interpret, kernel):
    """One chunk through a decode kernel (``kernel``: ``"tpu"``,
    :mod:`moejax.kernels.chunk_union.decode`, or ``"mosaic_gpu"``,
    :mod:`moejax.kernels.chunk_union.decode_gpu`), plus ``residual_nD`` where one is given
    (the Mosaic GPU kernel sums into it, the TPU kernels' output is added to it); its
    gradient, where one is asked for, recomputes the chunk through the pair kernels."""
    if kernel == "mosaic_gpu":
        return chunk_union_decode_gpu(x_nD, a_nE, active_nE, w_up, w_down, w_gate,
                                      activation=activation, interpret=interpret,
                                      residual_nD=residual_nD)
    y = DECODE_KERNELS[kernel](x_nD, a_nE, active_nE, w_up, w_down, w_gate,
                               activation=activation, interpret=interpret)
    return add_residual(residual_nD, y)


def _decode_fwd(x_nD, a_nE, active_nE, w_up, w_down, w_gate, residual_nD, activation,
                interpret, kernel):
    y = decode_chunk(x_nD, a_nE, active_nE, w_up, w_down, w_gate, residual_nD, activation,
                     interpret, kernel)
    return y, (x_nD, a_nE, active_nE, w_up, w_down, w_gate, residual_nD)


def _decode_bwd(activation, interpret, kernel, res, ct):
    x_nD, a_nE, active_nE, w_up, w_down, w_gate, residual_nD = res

    def pairs(x, a, wu, wd, wg):
        return chunk_union_kernel(x, a, active_nE, wu, wd, wg, activation=activation,
                                  tile=x.shape[0], max_union=a.shape[-1],
                                  interpret=interpret)[0]

    y, vjp = jax.vjp(pairs, x_nD, a_nE, w_up, w_down, w_gate)
    dx, da, dwu, dwd, dwg = vjp(ct.astype(y.dtype))
    dr = None if residual_nD is None else ct.astype(residual_nD.dtype)
    return dx, da, None, dwu, dwd, dwg, dr


decode_chunk.defvjp(_decode_fwd, _decode_bwd)


DECODE_ROUTES = ("jnp loop", "decode kernel (TPU)", "decode kernel (Mosaic GPU)",
                 "dense product, non-members weighted 0", "pair kernels")


def decode_route(x_nD, w_up, w_gate=None, platform: str | None = None) -> str:
    """What :func:`chunk_union_auto` computes one exact decode chunk ``x_nD`` (``n`` up to
    ``MAX_CHUNK`` tokens, the union not capped) with on ``platform`` (default: the device
    being lowered for, :func:`moejax.kernels.tiling.target_device`), one of
    :data:`DECODE_ROUTES`; ``x_nD`` and ``w_up`` may be shapes (``jax.ShapeDtypeStruct``)."""
    platform = platform or target_device()[0]
    if platform == "cpu":
        return DECODE_ROUTES[0]
    if platform == "tpu":
        return DECODE_ROUTES[1]
    if platform != "cuda":
        return DECODE_ROUTES[4]
    if hopper_target() and supports(x_nD, w_up, w_gate):
        return DECODE_ROUTES[2]
    return DECODE_ROUTES[3]


def chunk_union_auto(x_ND, a_NE, active_NE, w_up, w_down, w_gate=None, *, activation: str,
                     tile: int, max_union: int, residual_ND=None):
    """The chunk-union experts on the fast path of the platform the program is built for
    (:func:`moejax.kernels.tiling.on_target`): the jnp loop
    (:func:`moejax.kernels.chunk_union.reference.chunk_union_experts`) on the CPU, the Pallas
    pair kernels on GPU and TPU. A single exact chunk of at most ``MAX_CHUNK`` tokens
    (batch-1 decoding, a verified draft block) takes a decode kernel (:func:`decode_chunk`)
    instead: on TPU always, on a Hopper GPU where the Mosaic GPU kernel takes the chunk
    (bf16 / f16, :func:`moejax.kernels.chunk_union.decode_gpu.supports`). A decode chunk on a
    GPU that no decode kernel takes (float32; a width off the kernel's blocks; a GPU before
    Hopper) runs as one dense product with the non-members weighted 0
    (:func:`moejax.kernels.chunk_union.reference.dense_chunk`): at these sizes the pair
    kernels are slower than computing every expert. Where a GPU has no compiled pair kernel
    for the dtype (float32 or a GPU before Hopper once jax no longer ships Pallas Triton),
    the jnp loop runs there too.

    ``residual_ND``: ``(residual + y, overflow)``, ``y`` in the residual's dtype first (a
    decoder block's residual add); the Mosaic GPU decode kernel sums into the residual
    itself, rounding once (:func:`moejax.kernels.chunk_union.decode_gpu.chunk_union_decode_gpu`)."""
    _check(x_ND, a_NE, w_up, w_down, w_gate, tile, max_union)
    if residual_ND is not None and residual_ND.shape != x_ND.shape:
        raise ValueError(f"the residual {tuple(residual_ND.shape)} must be x's "
                         f"{tuple(x_ND.shape)}")
    N, E = a_NE.shape
    decode = N <= min(tile, MAX_CHUNK) and max_union == E
    no_overflow = jnp.zeros((), jnp.float32)

    def jnp_path(x, a, act, wu, wd, wg, r):
        y, o = chunk_union_experts(x, a, act, wu, wd, wg, activation, tile=tile,
                                   max_union=max_union)
        return add_residual(r, y.astype(x.dtype)), o

    def kernel_path(x, a, act, wu, wd, wg, r):
        y, o = chunk_union_pallas(x, a, act, wu, wd, wg, activation=activation, tile=tile,
                                  max_union=max_union)
        return add_residual(r, y), o

    def gpu_path(x, a, act, wu, wd, wg, r):
        if not decode:  # the pair kernels; the jnp loop where they would run interpreted
            fast = gpu_kernels_take(x.dtype)
            return (kernel_path if fast else jnp_path)(x, a, act, wu, wd, wg, r)
        if decode_route(x, wu, wg, "cuda") == DECODE_ROUTES[2]:
            return (decode_chunk(x, a, act, wu, wd, wg, r, activation, False, "mosaic_gpu"),
                    no_overflow)
        # with the union capped at E, as here, the pair kernels ran slower than this dense
        # product of every expert at each decode size measured (H100 float32; H200 bf16 at
        # width 48, which the decode kernel's blocks do not divide)
        return add_residual(r, dense_chunk(x, a, act, wu, wd, wg, activation)), no_overflow

    def tpu_path(x, a, act, wu, wd, wg, r):
        if not decode:
            return kernel_path(x, a, act, wu, wd, wg, r)
        return decode_chunk(x, a, act, wu, wd, wg, r, activation, False, "tpu"), no_overflow

    return on_target(x_ND, a_NE, active_NE, w_up, w_down, w_gate, residual_ND, cpu=jnp_path,
                     tpu=tpu_path, cuda=gpu_path, default=kernel_path)
