"""The dropless grouped matmul from a maintained library: tokamax's ``ragged_dot``.

:func:`ragged_dot` is ``[M, K] x [G, K, N] -> [M, N]`` with the rows of group ``g`` multiplied
by ``w[g]`` (the contract of :func:`jax.lax.ragged_dot`), differentiable in both operands:
its forward and its VJP are three products (``PASSES``: ``fwd`` x w_g, ``dlhs`` dy w_g^T,
``drhs`` x_g^T dy_g), each a :func:`ragged_pass` with the implementation ``IMPLEMENTATIONS``
names for that platform and pass (``experiments.benchmarks.grouped`` times every implementation
per pass and names the fastest). The platform is picked when the program is lowered
(:func:`jax.lax.platform_dependent`):

* ``cuda``: tokamax's Pallas Mosaic GPU kernels (sm80 / sm90 / sm100 variants, tokamax's
  tuned configurations) for the forward product and dX; dW on the project's own Mosaic GPU
  kernel (:mod:`moejax.kernels.grouped.gmm_mgpu`), since tokamax's measured wrong
  (``IMPLEMENTATIONS``);
* ``tpu``: tokamax's Pallas Mosaic TPU kernels (megablox-style tile metadata);
* anything else (the CPU): tokamax's ``"xla"`` implementation, :func:`jax.lax.ragged_dot`,
  which is also the reference the tests compare with the dense oracle.

``platform_dependent`` traces every branch, and tokamax cannot trace one platform's kernel
for another's device, so the program gets one branch beside the default (the reference): that
of the platform it is being built for (the abstract device of
:func:`moejax.kernels.targets.lowering_target`, else the default backend), none on the CPU.
Where tokamax's kernel does not take the call (it raises ``NotImplementedError``: Mosaic GPU
takes bf16 / f16 only, Mosaic TPU a contraction of at least 128; a GPU older than sm80), the
project's own Pallas kernel :func:`moejax.kernels.grouped.pallas_gmm.gmm` runs it (Triton on
GPU, Mosaic on TPU), never :func:`jax.lax.ragged_dot`, whose GPU lowering expands to dense.
The own kernels also run the passes of at least ``OWN_FROM_FLOPS`` on the platforms where
``experiments.benchmarks.grouped``'s per-pass table measured them faster than tokamax's at such
sizes, each in the size tiers where it was the faster own kernel (``OWN_TIERS``;
:func:`implementation` says which runs a given product).
Shapes off Mosaic GPU's tiles are zero-padded to them (``ALIGN``), which is exact.

tokamax checks the local device before it lowers a kernel, so a program exported on a machine
without the target accelerator needs :func:`cross_compile` (entered by
:func:`moejax.kernels.targets.lowering_target`): tokamax's documented ``cross_compile`` option,
which skips the device checks, and, for GPUs, the target's compute capability, which tokamax
otherwise reads from the local default device to choose its sm90 kernel.

tokamax is an optional dependency (the ``gpu`` and ``tpu`` extras; ``dev`` for the tests):
:data:`AVAILABLE` says whether it is installed, and :func:`tokamax` imports it where a kernel
is first traced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp

from moejax.extras import require
from moejax.kernels.grouped.gmm_mgpu import PASSES as MGPU_PASSES
from moejax.kernels.grouped.layout import RAGGED_DIMS
from moejax.kernels.grouped.pallas_gmm import gmm, gmm_t, tgmm
from moejax.kernels.tiling import target_device

__all__ = ["AVAILABLE", "IMPLEMENTATIONS", "OWN_FROM_FLOPS", "OWN_TIERS", "OWN_KERNELS", "PASSES",
           "ALIGN", "KERNEL_CHOICES", "ragged_dot", "ragged_pass", "implementation",
           "cross_compile", "tokamax", "tokamax_gpu_utils"]

# tokamax is imported where a kernel is first traced, not with moejax: importing it takes
# about as long as jax, flax, optax and orbax together, which every process that imports the
# training loop would otherwise pay, a command refused before any compute included
AVAILABLE = importlib.util.find_spec("tokamax") is not None


def tokamax():
    """The ``tokamax`` module (imported on first use), or :class:`MissingExtraError` naming
    the extra that installs it."""
    return require("tokamax", "moejax.kernels.grouped.ragged")


def tokamax_gpu_utils():
    """tokamax's GPU utilities (where it reads the local device's compute capability)."""
    return require("tokamax._src.gpu_utils", "moejax.kernels.grouped.ragged")


PASSES = ("fwd", "dlhs", "drhs")
# what runs each pass per lowering platform ("default": every other platform): tokamax's
# implementation, except cuda's drhs. tokamax's sm90 ragged-contracting kernel (dW = x_g^T
# dy_g) disagreed with experiments.benchmarks.grouped's float32 oracle by 0.10-0.13 of the largest
# value at all three of its bf16 shapes on an H200 (tokamax 0.0.17; its fwd and dlhs agreed,
# and both own kernels' dW agreed), so on cuda dW runs on the project's Mosaic GPU kernel
# ("gmm_mgpu"; Triton where that declines: float32, a GPU without wgmma) at every size, for
# kernel="library" too. The benchmark keeps checking tokamax's (its "mosaic_gpu" rows).
IMPLEMENTATIONS = {
    "cuda": {"fwd": "mosaic_gpu", "dlhs": "mosaic_gpu", "drhs": "gmm_mgpu"},
    "tpu": {"fwd": "mosaic_tpu", "dlhs": "mosaic_tpu", "drhs": "mosaic_tpu"},
    "default": {"fwd": "xla", "dlhs": "xla", "drhs": "xla"},
}
# per platform and pass, the project's own kernels by product size (2 M K N FLOPs): (from
# FLOPs, kernel) tiers in ascending order; a product runs the kernel of the last tier it
# reaches, a smaller one IMPLEMENTATIONS'. cuda, from bench_grouped's bf16 table on an H200:
# fwd, the Triton gmm 1.63x and 1.57x faster than tokamax's Mosaic GPU kernel at 47 and 378
# GFLOP, even with it at 1.5 GFLOP; the Mosaic GPU gmm 2.3x slower than tokamax's at 1.5,
# 1.35x slower than Triton at 47 and 1.08x faster than it at 378, so it takes the forward
# product from 130 GFLOP (the geometric mean of 47 and 378: between them nothing was
# measured); dlhs, the Mosaic GPU gmm 1.48x and 1.85x faster than tokamax's at 47 and 378
# GFLOP, 1.19x slower at 1.5 (the Triton one slower than it at all three). 8 GFLOP lies
# between 1.5 and 47 (not measured there).
OWN_TIERS = {"cuda": {"fwd": ((8e9, "gmm"), (1.3e11, "gmm_mgpu")),
                      "dlhs": ((8e9, "gmm_mgpu"),)}}
# per platform and pass, the size from which one of the project's own kernels runs
OWN_FROM_FLOPS = {platform: {which: tiers[0][0] for which, tiers in by_pass.items()}
                  for platform, by_pass in OWN_TIERS.items()}
# the project's own kernels for each product: "gmm" also runs what tokamax's kernel does not
# take (it takes every dtype), "gmm_mgpu" bf16 / f16 on a Hopper GPU
_OWN = {"fwd": gmm, "dlhs": gmm_t, "drhs": tgmm}
OWN_KERNELS = {"gmm": _OWN, "gmm_mgpu": MGPU_PASSES}


# each operand's and the result's axes: M rows, K, N, G groups
_AXES = {"fwd": ("MK", "GKN", "MN"), "dlhs": ("MN", "GKN", "MK"), "drhs": ("MK", "MN", "GKN")}
# the multiples of M, K and N an implementation's kernel tiles take (Mosaic GPU lowers M, K
# and N in tiles of 64; zero padding is exact: padded rows lie past the groups'
# total, padded K contracts zeros, padded N is sliced off)
ALIGN = {"mosaic_gpu": {"M": 64, "K": 64, "N": 64}}


def _pad(x, axes: str, align: dict):
    widths = [(0, -n % align.get(a, 1)) for n, a in zip(x.shape, axes)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _sizes(which: str, a, b, group_sizes_G) -> dict[str, int]:
    ax_a, ax_b, _ = _AXES[which]
    return dict(zip(ax_a + ax_b, a.shape + b.shape), G=group_sizes_G.shape[0])


def implementation(platform: str, which: str, m: int, k: int, n: int) -> str:
    """What runs pass ``which`` of an ``[m, k] x [G, k, n]`` grouped product lowered for
    ``platform``: the project's own kernel of the last ``OWN_TIERS`` tier its FLOPs reach,
    else ``IMPLEMENTATIONS``' (that kernel may still decline the call, :func:`ragged_pass`)."""
    if which not in PASSES:
        raise ValueError(f"which={which!r}; one of {PASSES}")
    own = [kernel for flops, kernel in OWN_TIERS.get(platform, {}).get(which, ())
           if 2 * m * k * n >= flops]
    return own[-1] if own else IMPLEMENTATIONS.get(platform, IMPLEMENTATIONS["default"])[which]


def ragged_pass(which: str, a, b, group_sizes_G, implementation: str, *,
                fallback: bool = True):
    """One of the three products (``PASSES``) with tokamax's ``implementation`` ("xla":
    :func:`jax.lax.ragged_dot_general`) or the project's own (``OWN_KERNELS``: ``"gmm"``,
    ``"gmm_mgpu"``), its operands zero-padded to the multiples tokamax's kernel takes
    (``ALIGN``); where that kernel does not take the call (it raises
    ``NotImplementedError``), the project's own ``"gmm"``. Not differentiable itself: the
    three make :func:`ragged_dot`'s forward and its VJP. ``fallback=False``: raise instead
    of running ``"gmm"`` (the benchmarks time each implementation on its own)."""
    out_dtype = b.dtype if which == "drhs" else a.dtype
    try:
        if implementation in OWN_KERNELS:
            out = OWN_KERNELS[implementation][which](a, b, group_sizes_G)
            return out.astype(out_dtype)
        ax_a, ax_b, ax_out = _AXES[which]
        align = ALIGN.get(implementation, {})
        out = tokamax().ragged_dot_general(
            _pad(a, ax_a, align), _pad(b, ax_b, align), group_sizes_G, RAGGED_DIMS[which],
            preferred_element_type=out_dtype, implementation=implementation)
    except NotImplementedError:  # not this dtype / shape / device: the own kernel
        if implementation in ("xla", "gmm") or not fallback:
            raise
        return _OWN[which](a, b, group_sizes_G).astype(out_dtype)
    size = _sizes(which, a, b, group_sizes_G)
    return out[tuple(slice(0, size[ax]) for ax in ax_out)]


def _on_target(which: str, a, b, group_sizes_G, kernel: str):
    """``which`` with the implementation of the platform the program is lowered for (only
    that platform's branch is traced beside the default: every other platform would take the
    default anyway), as ``kernel`` says (:func:`ragged_dot`)."""
    target = target_device()[0]
    default = IMPLEMENTATIONS["default"][which]

    def branch(impl):
        return lambda a, b, gs: ragged_pass(which, a, b, gs, impl)

    if target not in IMPLEMENTATIONS or target == "default":
        return branch(default)(a, b, group_sizes_G)
    size = _sizes(which, a, b, group_sizes_G)
    if kernel == "library":
        impl = IMPLEMENTATIONS[target][which]
    elif kernel in OWN_KERNELS:
        impl = kernel
    else:
        impl = implementation(target, which, size["M"], size["K"], size["N"])
    return jax.lax.platform_dependent(a, b, group_sizes_G, default=branch(default),
                                      **{target: branch(impl)})


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot(x_MK, w_GKN, group_sizes_G, kernel):
    return _on_target("fwd", x_MK, w_GKN, group_sizes_G, kernel)


def _ragged_dot_fwd(x_MK, w_GKN, group_sizes_G, kernel):
    return (_on_target("fwd", x_MK, w_GKN, group_sizes_G, kernel),
            (x_MK, w_GKN, group_sizes_G))


def _ragged_dot_bwd(kernel, res, dy_MN):
    x_MK, w_GKN, group_sizes_G = res
    dy_MN = dy_MN.astype(x_MK.dtype)
    return (_on_target("dlhs", dy_MN, w_GKN, group_sizes_G, kernel),
            _on_target("drhs", x_MK, dy_MN, group_sizes_G, kernel), None)


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)

# what ragged_dot's ``kernel`` may name: the measured choice, the library's kernels (where
# right) at every size, or one of the project's own kernels at every size
KERNEL_CHOICES = ("measured", "library", *OWN_KERNELS)


def ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, *,
               kernel: str = "measured") -> jax.Array:
    """Grouped matmul (module docstring); ``x`` and ``w`` of one dtype, the result too.
    ``kernel`` (on GPU and TPU; the CPU runs the reference): ``"measured"``,
    ``IMPLEMENTATIONS`` with the own kernel from ``OWN_FROM_FLOPS``; ``"library"``,
    ``IMPLEMENTATIONS`` (tokamax's kernels where they are right) at every size; ``"gmm"`` /
    ``"gmm_mgpu"``, that own kernel at every size (each falling back to the Triton ``"gmm"``
    where its kernel declines the call)."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"ragged_dot: kernel={kernel!r}; one of {KERNEL_CHOICES}")
    if not AVAILABLE:
        raise ImportError("moejax.kernels.grouped.ragged needs tokamax: pip install "
                          "'moejax[gpu]' (or [tpu]); dispatch='gmm' is the project's own "
                          "Pallas kernel")
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"ragged_dot: x {x_MK.shape} and w {w_GKN.shape} must be [M, K] and "
                         "[G, K, N]")
    if x_MK.dtype != w_GKN.dtype:
        raise ValueError(f"ragged_dot: x is {x_MK.dtype} and w {w_GKN.dtype}; cast one")
    return _ragged_dot(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), kernel)


@contextlib.contextmanager
def cross_compile(compute_capability: float | None = None):
    """Lower tokamax kernels for an accelerator this machine does not have: tokamax's
    ``cross_compile`` option and, for a GPU target, its ``compute_capability`` in place of the
    local default device's (tokamax reads it to choose the sm80 / sm90 / sm100 kernels; it
    has no documented option for it, so this replaces its lookup for the duration only).
    tokamax logs an autotuning-cache miss each time it traces a kernel whose shapes its shipped
    cache lacks for the target (the heuristic configuration then runs), and an export traces
    each kernel many times (forward, VJP, every layer): inside, each distinct miss is logged
    once. Without tokamax, nothing."""
    if not AVAILABLE:
        yield
        return
    gpu_utils = tokamax_gpu_utils()
    lookup = gpu_utils._compute_capability
    once = _OnceEach(AUTOTUNING_MISS)
    absl_log = logging.getLogger("absl")  # tokamax logs through absl.logging
    with tokamax().config.cross_compile(True):
        if compute_capability is not None:
            gpu_utils._compute_capability = lambda device=None: (
                lookup(device) if device is not None else float(compute_capability))
        absl_log.addFilter(once)
        try:
            yield
        finally:
            absl_log.removeFilter(once)
            gpu_utils._compute_capability = lookup


# the start of tokamax's log line for a kernel's shapes missing from its autotuning cache
AUTOTUNING_MISS = "Autotuning cache miss"


class _OnceEach(logging.Filter):
    """Pass each distinct message that starts with ``prefix`` once; all others always."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.seen = prefix, set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        return True
