"""BlockFFN's chunk-union forward at decode: one chunk of ``n`` tokens (1 to 64: a decoded token,
or the draft block that speculative decoding verifies) reads only the weights of the experts in
its union (BlockFFN paper, Sec. 3.3 and its decode kernels), in two launches:

1. :func:`chunk_union_ids`, a small kernel: the union of the chunk's active experts
   (``active [n, E]``), members first in ascending order, and its size. The rank of each
   member is a matmul of the expert mask with a triangular matrix of ones, and slot ``u``'s
   expert the one whose rank is ``u + 1``: vector work only, no sort.
2. the experts over (union slot ``u``, F block ``f``) programs, with the union from launch 1 as
   scalar-prefetched tables: program ``(u, f)`` copies expert ``e_u``'s up (and gate) columns
   ``[D, bF]`` and down rows ``[bF, D]``, computes ``h = act(x W_up) * a[:, e_u]`` (gated:
   ``act(x W_gate) * x W_up * a[:, e_u]``) and adds ``h W_down`` to the chunk's output, held
   in VMEM across the grid. A slot past the union exits early: its index maps repeat the last
   member's blocks (no copy) and it computes nothing, so the weights read are the union's
   only, each once.

The forward only (decoding); training keeps the pair kernels or the grouped path
(:mod:`moejax.kernels.chunk_union.pallas`). On TPU both launches are Mosaic kernels; on the CPU
they run in Pallas interpret mode (for tests). :func:`~moejax.kernels.chunk_union.pallas.
chunk_union_auto` takes them for a decode-sized chunk on TPU; a Hopper GPU decodes through the
Mosaic GPU kernel of :mod:`moejax.kernels.chunk_union.decode_gpu`.

``y_nD = chunk_union_decode(x_nD, a_nE, active_nE, w_up, w_down, w_gate, activation=...)``
equals :func:`moejax.kernels.chunk_union.reference.dense_experts` for every ``n``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moejax.kernels.activation_forms import kernel_activation
from moejax.kernels.tiling import on_target
from moejax.ops.activations import activation_fn

__all__ = ["chunk_union_decode", "chunk_union_ids", "check_expert_weights", "MAX_CHUNK",
           "F_BLOCK"]

MAX_CHUNK = 64  # tokens per chunk: a decoded token up to a long verified draft block
F_BLOCK = 256  # expert-width columns per program (a multiple of 128 for the MXU)
_SUBLANES = 8  # a TPU block's second-to-last dimension: a multiple of 8 (tokens are padded)


def _union_kernel(active_ref, ids_ref, count_ref):
    """``ids [1, E]``: the union's members in ascending order, then ``E`` past its size;
    ``count [1, 1]``: its size. Vector work on ``[E, E]`` tiles (row ``e``, column ``j``)."""
    E = active_ref.shape[1]
    mask_1E = jnp.max(active_ref[...], axis=0, keepdims=True)  # [1, E]: in the union
    row = jax.lax.broadcasted_iota(jnp.int32, (E, E), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (E, E), 1)
    mask_EE = jnp.broadcast_to(mask_1E, (E, E))  # [e, j] = member j
    rank_E1 = jnp.sum(jnp.where(col <= row, mask_EE, 0), axis=1, keepdims=True)  # 1-based
    member_E1 = jnp.sum(jnp.where(col == row, mask_EE, 0), axis=1, keepdims=True)
    onehot = (member_E1 > 0) & (rank_E1 == col + 1)  # [e, u]: member e fills slot u
    filled_1E = jnp.sum(onehot.astype(jnp.int32), axis=0, keepdims=True)
    ids_1E = jnp.sum(jnp.where(onehot, row, 0), axis=0, keepdims=True)
    ids_ref[...] = ids_1E + (1 - filled_1E) * E
    count_ref[...] = jnp.sum(mask_1E, axis=1, keepdims=True)


def chunk_union_ids(active_nE, *, interpret: bool = False):
    """``(ids [E] int32, count [] int32)``: the union of the chunk's active experts, members
    first in ascending order (then ``E``), and its size; one small kernel."""
    n, E = active_nE.shape
    ids, count = pl.pallas_call(
        _union_kernel,
        out_shape=(jax.ShapeDtypeStruct((1, E), jnp.int32),
                   jax.ShapeDtypeStruct((1, 1), jnp.int32)),
        interpret=interpret,
    )(active_nE.astype(jnp.int32))
    return ids[0], count[0, 0]


def _experts_kernel(ids_ref, count_ref, x_ref, a_ref, wu_ref, wd_ref, *rest, activation,
                    gated):
    wg_ref, o_ref, acc_ref = rest if gated else (None, *rest)
    u, f = pl.program_id(0), pl.program_id(1)

    @pl.when((u == 0) & (f == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(u < count_ref[0])  # past the union: nothing to compute (and nothing was copied)
    def _():
        act = kernel_activation(activation)
        x = x_ref[...]
        pre = jnp.dot(x, wu_ref[...], preferred_element_type=jnp.float32)
        if gated:
            gate = jnp.dot(x, wg_ref[...], preferred_element_type=jnp.float32)
            h = act(gate) * pre
        else:
            h = act(pre)
        h = h * a_ref[...].astype(jnp.float32)  # [n, 1]: the member's combine weights
        acc_ref[...] += jnp.dot(h.astype(wd_ref.dtype), wd_ref[...],
                                preferred_element_type=jnp.float32)

    @pl.when((u == pl.num_programs(0) - 1) & (f == pl.num_programs(1) - 1))
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _experts(ids, count, x, a_En1, w_up, w_down, w_gate, activation, interpret):
    n, D = x.shape
    E, _, F = w_up.shape
    bF = F_BLOCK if F % F_BLOCK == 0 else F

    def slot(u, count):  # past the union: the last member's blocks again (no new copy)
        return jnp.clip(jnp.minimum(u, count[0] - 1), 0, E - 1)

    def member(u, ids, count):
        return jnp.clip(ids[slot(u, count)], 0, E - 1)

    w_spec = pl.BlockSpec((None, D, bF), lambda u, f, ids, c: (member(u, ids, c), 0, f))
    in_specs = [pl.BlockSpec((n, D), lambda u, f, ids, c: (0, 0)),
                pl.BlockSpec((None, n, 1), lambda u, f, ids, c: (member(u, ids, c), 0, 0)),
                w_spec,
                pl.BlockSpec((None, bF, D), lambda u, f, ids, c: (member(u, ids, c), f, 0))]
    weights = [w_up, w_down]
    if w_gate is not None:
        in_specs.append(w_spec)
        weights.append(w_gate)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(E, F // bF), in_specs=in_specs,
        out_specs=pl.BlockSpec((n, D), lambda u, f, ids, c: (0, 0)),
        scratch_shapes=[pltpu.VMEM((n, D), jnp.float32)])
    return pl.pallas_call(
        functools.partial(_experts_kernel, activation=activation, gated=w_gate is not None),
        out_shape=jax.ShapeDtypeStruct((n, D), x.dtype), grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
    )(ids, count.reshape(1), x, a_En1, *weights)


def _check(x_nD, a_nE, active_nE, w_up, w_down, w_gate):
    n, D = x_nD.shape
    E = a_nE.shape[-1]
    if not 1 <= n <= MAX_CHUNK:
        raise ValueError(f"chunk_union_decode: a chunk of {n} tokens; it takes 1 to "
                         f"{MAX_CHUNK} (longer inputs: the pair kernels, chunk_union_kernel)")
    if a_nE.shape != (n, E) or active_nE.shape != (n, E):
        raise ValueError(f"a {a_nE.shape} and active {active_nE.shape} must be {(n, E)}")
    check_expert_weights(x_nD.shape, E, w_up, w_down, w_gate)


def check_expert_weights(x_shape, E: int, w_up, w_down, w_gate) -> None:
    """Refuse expert weights whose shapes do not fit ``x [N, D]`` and ``E`` experts."""
    D, F = x_shape[-1], w_up.shape[-1]
    want = {"w_up": (E, D, F), "w_down": (E, F, D), "w_gate": (E, D, F)}
    for name, w in (("w_up", w_up), ("w_down", w_down), ("w_gate", w_gate)):
        if w is not None and tuple(w.shape) != want[name]:
            raise ValueError(f"{name} {tuple(w.shape)} must be {want[name]} for x "
                             f"{tuple(x_shape)} and {E} experts")


def chunk_union_decode(x_nD, a_nE, active_nE, w_up, w_down, w_gate=None, *, activation: str,
                       interpret: bool | None = None):
    """``y [n, D]``: the chunk's expert output through the union's weights only (module
    docstring). ``interpret``: None runs the TPU kernels, or interpret mode when lowered for
    the CPU; True interpret mode everywhere."""
    _check(x_nD, a_nE, active_nE, w_up, w_down, w_gate)
    activation_fn(activation)  # an unknown name fails here, before any lowering
    n, D = x_nD.shape
    pad = (-n) % _SUBLANES
    dt = x_nD.dtype
    xp = jnp.pad(x_nD, ((0, pad), (0, 0)))
    a_En1 = jnp.pad(a_nE.astype(jnp.float32), ((0, pad), (0, 0))).T[:, :, None]
    active = jnp.pad(active_nE.astype(jnp.int32), ((0, pad), (0, 0)))
    weights = (w_up.astype(dt), w_down.astype(dt), None if w_gate is None else w_gate.astype(dt))

    def run(interp):
        ids, count = chunk_union_ids(active, interpret=interp)
        return _experts(ids, count, xp, a_En1, *weights, activation, interp)

    if interpret:
        return run(True)[:n]
    return on_target(cpu=lambda: run(True), default=lambda: run(False))[:n]
