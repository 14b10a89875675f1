"""The dropless grouped matmul from a maintained library: tokamax's ``ragged_dot``.

:func:`ragged_dot` is ``[M, K] x [G, K, N] -> [M, N]`` with the rows of group ``g`` multiplied
by ``w[g]`` (the contract of :func:`jax.lax.ragged_dot`), differentiable in both operands.
The implementation is picked when the program is lowered (:func:`jax.lax.platform_dependent`),
per platform:

* ``cuda``: tokamax's Pallas Mosaic GPU kernels (sm80 / sm90 / sm100 variants, forward and
  both gradients, tokamax's tuned configurations);
* ``tpu``: tokamax's Pallas Mosaic TPU kernels (megablox-style tile metadata);
* anything else (the CPU): tokamax's ``"xla"`` implementation, :func:`jax.lax.ragged_dot`,
  which is also the reference the tests compare with the dense oracle.

``platform_dependent`` traces every branch, and tokamax cannot trace one platform's kernel
for another's device, so only the branch of the platform the program is being built for
names its kernel (the abstract device of :func:`moejax.kernels.targets.lowering_target`, else
the default backend); the other branches trace the reference, which is never lowered there.
Where tokamax's kernel does not take the call (it raises ``NotImplementedError``: Mosaic GPU
takes bf16 / f16 only, Mosaic TPU a contraction of at least 128; a GPU older than sm80), the
project's own Pallas kernel :func:`moejax.kernels.grouped.pallas_gmm.gmm` runs it (Triton on
GPU, Mosaic on TPU), never :func:`jax.lax.ragged_dot`, whose GPU lowering expands to dense. The same
implementation runs the three passes; a measured table may pick per pass when a GPU is at
hand.

tokamax checks the local device before it lowers a kernel, so a program exported on a machine
without the target accelerator needs :func:`cross_compile` (entered by
:func:`moejax.kernels.targets.lowering_target`): tokamax's documented ``cross_compile`` option,
which skips the device checks, and, for GPUs, the target's compute capability, which tokamax
otherwise reads from the local default device to choose its sm90 kernel.

tokamax is an optional dependency (the ``gpu`` and ``tpu`` extras; ``dev`` for the tests):
:data:`AVAILABLE` says whether it is installed.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from moejax.kernels.grouped.pallas_gmm import gmm
from moejax.kernels.tiling import target_device

try:  # optional: the gpu / tpu / dev extras
    import tokamax
    from tokamax._src import gpu_utils as _tokamax_gpu_utils
except ImportError:  # pragma: no cover - exercised where tokamax is not installed
    tokamax = None
    _tokamax_gpu_utils = None

__all__ = ["AVAILABLE", "IMPLEMENTATIONS", "ragged_dot", "cross_compile"]

AVAILABLE = tokamax is not None
# tokamax's implementation per lowering platform ("default": every other platform)
IMPLEMENTATIONS = {"cuda": "mosaic_gpu", "tpu": "mosaic_tpu", "default": "xla"}


def _one(impl: str):
    def run(x_MK, w_GKN, group_sizes_G):
        try:
            return tokamax.ragged_dot(x_MK, w_GKN, group_sizes_G, implementation=impl)
        except NotImplementedError:  # not this dtype / shape / device: the own kernel
            if impl == IMPLEMENTATIONS["default"]:
                raise
            return gmm(x_MK, w_GKN, group_sizes_G)

    return run


def ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """Grouped matmul (module docstring); ``x`` and ``w`` of one dtype, the result too."""
    if not AVAILABLE:
        raise ImportError("moejax.kernels.grouped.ragged needs tokamax: pip install "
                          "'moejax[gpu]' (or [tpu]); dispatch='gmm' is the project's own "
                          "Pallas kernel")
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"ragged_dot: x {x_MK.shape} and w {w_GKN.shape} must be [M, K] and "
                         "[G, K, N]")
    if x_MK.dtype != w_GKN.dtype:
        raise ValueError(f"ragged_dot: x is {x_MK.dtype} and w {w_GKN.dtype}; cast one")
    target = target_device()[0]
    branches = {p: _one(impl if p == target else IMPLEMENTATIONS["default"])
                for p, impl in IMPLEMENTATIONS.items() if p != "default"}
    return jax.lax.platform_dependent(x_MK, w_GKN, group_sizes_G.astype(jnp.int32),
                                      default=_one(IMPLEMENTATIONS["default"]), **branches)




@contextlib.contextmanager
def cross_compile(compute_capability: float | None = None):
    """Lower tokamax kernels for an accelerator this machine does not have: tokamax's
    ``cross_compile`` option and, for a GPU target, its ``compute_capability`` in place of the
    local default device's (tokamax reads it to choose the sm80 / sm90 / sm100 kernels; it
    has no documented option for it, so this replaces its lookup for the duration only).
    Without tokamax, nothing."""
    if not AVAILABLE:
        yield
        return
    lookup = _tokamax_gpu_utils._compute_capability
    with tokamax.config.cross_compile(True):
        if compute_capability is not None:
            _tokamax_gpu_utils._compute_capability = lambda device=None: (
                lookup(device) if device is not None else float(compute_capability))
        try:
            yield
        finally:
            _tokamax_gpu_utils._compute_capability = lookup
