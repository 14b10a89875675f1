"""Every MoE dispatch path by name: the jnp paths of :mod:`moejax.kernels.moe_ffn.jnp_paths`
and the kernel paths, behind one signature, and ``"auto"``.

* ``"dense"``, ``"capacity"``, ``"ragged"``, ``"grouped"``, ``"bucketed"``: plain jnp
  (:mod:`moejax.kernels.moe_ffn.jnp_paths`).
* ``"tokamax"``: dropless, :func:`~moejax.kernels.moe_ffn.jnp_paths.dispatch_ragged` with
  tokamax's grouped matmul (:func:`moejax.kernels.grouped.ragged.ragged_dot` with
  ``kernel="library"``: Mosaic GPU / Mosaic TPU kernels at every size, but dW on a GPU on the
  project's Mosaic GPU kernel, tokamax's being wrong there; :func:`jax.lax.ragged_dot`
  elsewhere).
* ``"gmm"``: dropless, :func:`~moejax.kernels.moe_ffn.jnp_paths.dispatch_ragged` with the
  project's Pallas grouped matmul :func:`moejax.kernels.grouped.pallas_gmm.gmm` (forward and
  backward kernels; Pallas interpret mode on CPU, so only for tests there).
* ``"host"``: dropless, :func:`moejax.kernels.moe_ffn.host.host_moe`, the whole expert FFN on the
  host's BLAS (one callback forward, one backward), experts spread over the cores. CPU only.
* ``"host_capacity"``: the capacity path's semantics (same capacity, priority and drops)
  computed by the same host kernel over the kept rows only. CPU only.

* ``"expert_parallel"`` (dropless) and ``"expert_parallel_capacity"``: under a mesh with axes
  ``("data", "expert")`` set for tracing (``jax.set_mesh``; the train step sets it), tokens go
  to the devices holding their experts by all-to-all, each device runs its local experts with
  the one-device choice below (:mod:`moejax.kernels.moe_ffn.expert_parallel`).

``"auto"`` (the models' default): under such a mesh, ``"expert_parallel"``; otherwise, with one
device, ``"host"`` when the program is built for a CPU and ``"tokamax"`` when it is built
for a GPU or TPU (:func:`moejax.kernels.tiling.on_target`; ``"gmm"`` where tokamax is not
installed), and ``"grouped"`` with several devices and no mesh: see :func:`resolve_dispatch`.
On a GPU, ``"auto"``'s grouped matmul runs each pass on the project's kernel of the size
tier the product reaches (:data:`~moejax.kernels.grouped.ragged.OWN_TIERS`), where that was
measured faster than tokamax's (``"tokamax"`` named explicitly keeps the library's).

With every expert active (``k = E``: a teacher distilled with ALL or SAR) the dropless
one-device paths and ``"auto"`` without a mesh run ``"dense"``: the same sum, without sorting E
copies of every token.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moejax.kernels.grouped.pallas_gmm import gmm
from moejax.kernels.grouped.ragged import AVAILABLE as RAGGED_DOT_AVAILABLE
from moejax.kernels.grouped.ragged import IMPLEMENTATIONS, OWN_TIERS, ragged_dot
from moejax.kernels.moe_ffn.expert_parallel import expert_parallel_dispatch
from moejax.kernels.moe_ffn.host import HOST_ACTIVATIONS, host_moe
from moejax.kernels.moe_ffn.jnp_paths import (
    DispatchMethod,
    DispatchOut,
    dispatch_bucketed,
    dispatch_capacity,
    dispatch_dense,
    dispatch_grouped,
    dispatch_ragged,
    expert_capacity,
)
from moejax.kernels.tiling import on_target, target_device

__all__ = ["PATHS", "dispatch", "resolve_dispatch", "describe_dispatch", "experts_in_xla",
           "expert_mesh_axes"]

log = logging.getLogger(__name__)


def _dense(*args, activation, capacity_factor, valid_N, priority):
    return dispatch_dense(*args, activation=activation, valid_N=valid_N)


def _capacity(*args, activation, capacity_factor, valid_N, priority):
    return dispatch_capacity(*args, activation=activation, capacity_factor=capacity_factor,
                             valid_N=valid_N, priority=priority)


def _ragged(*args, activation, capacity_factor, valid_N, priority):
    return dispatch_ragged(*args, activation=activation, valid_N=valid_N)


def _gmm(*args, activation, capacity_factor, valid_N, priority):
    return dispatch_ragged(*args, activation=activation, valid_N=valid_N, grouped_matmul=gmm)


def _tokamax(*args, activation, capacity_factor, valid_N, priority, kernel="library"):
    return dispatch_ragged(*args, activation=activation, valid_N=valid_N,
                           grouped_matmul=functools.partial(ragged_dot, kernel=kernel))


def _grouped(*args, activation, capacity_factor, valid_N, priority):
    return dispatch_grouped(*args, activation=activation, valid_N=valid_N)


def _bucketed(*args, activation, capacity_factor, valid_N, priority):
    return dispatch_bucketed(*args, activation=activation, valid_N=valid_N, priority=priority)


def _host(*args, activation, capacity_factor, valid_N, priority, capacity=None,
          check_backend=True, widths_E=None):
    x_ND, ids_NK = args[0], args[1]
    y, n_dropped = host_moe(*args, activation=activation, capacity=capacity, valid_N=valid_N,
                            priority=priority, widths_E=widths_E, check_backend=check_backend)
    n_real = x_ND.shape[0] if valid_N is None else jnp.sum(valid_N)
    frac = n_dropped / jnp.maximum(n_real * ids_NK.shape[1], 1)
    return DispatchOut(y, n_dropped, frac.astype(jnp.float32))


def _host_capacity(*args, activation, capacity_factor, valid_N, priority, widths_E=None):
    x_ND, ids_NK, w_up_EDF = args[0], args[1], args[3]
    cap = expert_capacity(x_ND.shape[0], ids_NK.shape[1], w_up_EDF.shape[0], capacity_factor)
    return _host(*args, activation=activation, capacity_factor=capacity_factor,
                 valid_N=valid_N, priority=priority, capacity=cap, widths_E=widths_E)


def _one_device(*args, activation, capacity_factor, valid_N, priority, widths_E=None):
    """The fastest dropless path of the platform the program is lowered for: the host kernel
    on a CPU, tokamax's grouped matmul on a GPU or TPU with the project's kernel where it was
    measured faster (the project's Pallas gmm alone where tokamax is not installed)."""
    kw = dict(activation=activation, capacity_factor=capacity_factor, valid_N=valid_N,
              priority=priority)
    every = (*args, widths_E)
    arrays = [a for a in every if a is not None]

    def rebuild(flat):
        it = iter(flat)
        return tuple(next(it) if a is not None else None for a in every)

    def cpu(*flat):
        *a, widths = rebuild(flat)
        if activation in HOST_ACTIVATIONS and not _IN_XLA.value:
            return _host(*a, check_backend=False, widths_E=widths, **kw)
        return _grouped(*a, **kw)

    def accelerator(*flat):  # each picks the target platform's kernel itself
        if not RAGGED_DOT_AVAILABLE:
            return _gmm(*rebuild(flat)[:-1], **kw)
        return _tokamax(*rebuild(flat)[:-1], kernel="measured", **kw)

    return on_target(*arrays, cpu=cpu, default=accelerator)


# a jit-cache-sensitive context: a step traced inside experts_in_xla() is traced anew
_IN_XLA = jax.make_user_context(False)
# The (data, expert) mesh axis names expert parallelism runs over; part of jax's tracing cache
# key, as _IN_XLA is.
_EXPERT_AXES = jax.make_user_context(("data", "expert"))


def expert_mesh_axes(data: str = "data", expert: str = "expert"):
    """While tracing inside this block, expert parallelism (``"auto"`` and the
    ``expert_parallel`` paths) runs over a mesh whose token axes are ``(data, expert)`` and
    whose experts are split over ``expert``: for a mesh of the caller's own axis names, e.g.
    ``with jax.set_mesh(mesh), expert_mesh_axes("batch", "model"): ...``. The training loop's
    mesh (:mod:`moejax.train.mesh`) is ``("data", "expert")``, the default."""
    if not (isinstance(data, str) and isinstance(expert, str) and data and expert
            and data != expert):
        raise ValueError(f"expert_mesh_axes(data={data!r}, expert={expert!r}): two distinct "
                         "axis names of the mesh")
    return _EXPERT_AXES((data, expert))


def experts_in_xla():
    """While tracing inside this block, ``"auto"`` on a CPU runs the plain-jnp ``"grouped"``
    path instead of the host kernel, and so do ``"tokamax"`` and ``"gmm"`` (lowered for a CPU
    they are a dense fallback over every expert and an interpret-mode loop, neither what their
    GPU and TPU kernels do), so XLA sees the experts' work: its cost and memory analyses then
    count the expert matmuls (a host callback is opaque to them). Same values;
    for ahead-of-time estimates (:mod:`moejax.train.aot`), not for speed. Part of jax's
    tracing cache key, so an already traced step is traced again inside it."""
    return _IN_XLA(True)


def _mesh():
    """The mesh set for tracing, when it has the expert-parallel axes
    (:func:`expert_mesh_axes`, default ``("data", "expert")``) and more than one device,
    else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if not set(_EXPERT_AXES.value) <= set(mesh.axis_names) or mesh.size <= 1:
        return None
    return mesh


def _expert_parallel(*args, activation, capacity_factor, valid_N, priority, capacity=False):
    mesh = _mesh()
    if mesh is None:  # no expert mesh here (an evaluation of host arrays, one device): the
        # same products on this device, with the capacity the expert-parallel one would take
        return _one_device(*args, activation=activation, capacity_factor=capacity_factor,
                           valid_N=valid_N, priority=priority)

    def local(*a, activation, valid_N):
        return _one_device(*a, activation=activation, capacity_factor=capacity_factor,
                           valid_N=valid_N, priority=priority)

    return expert_parallel_dispatch(*args, mesh=mesh, local=local, activation=activation,
                                    capacity_factor=capacity_factor if capacity else None,
                                    valid_N=valid_N, axes=tuple(_EXPERT_AXES.value))


def _auto(*args, activation, capacity_factor, valid_N, priority, widths_E=None):
    """Expert parallelism under a data x expert mesh; one device: the platform's kernel;
    several devices and no mesh: ``grouped`` (plain jnp for the SPMD partitioner)."""
    kw = dict(activation=activation, capacity_factor=capacity_factor, valid_N=valid_N,
              priority=priority)
    if _mesh() is not None:
        return _expert_parallel(*args, **kw)
    if jax.device_count() > 1:
        names = tuple(jax.sharding.get_abstract_mesh().axis_names)
        if names:  # a mesh of the caller's own: say why it gets no expert parallelism
            log.warning("dispatch='auto' under a mesh with axes %s: expert parallelism runs "
                        "over the axes %s (name yours with moejax.kernels.moe_ffn.api."
                        "expert_mesh_axes(data=..., expert=...)); the experts run on the "
                        "'grouped' path, partitioned by XLA", names, tuple(_EXPERT_AXES.value))
        return _grouped(*args, **kw)
    return _one_device(*args, widths_E=widths_E, **kw)


PATHS: dict[str, Callable[..., DispatchOut]] = {
    "dense": _dense, "capacity": _capacity, "ragged": _ragged, "gmm": _gmm, "tokamax": _tokamax,
    "host": _host, "host_capacity": _host_capacity, "grouped": _grouped, "bucketed": _bucketed,
    "expert_parallel": _expert_parallel,
    "expert_parallel_capacity": functools.partial(_expert_parallel, capacity=True),
}


def resolve_dispatch(method: DispatchMethod) -> DispatchMethod:
    """The path ``"auto"`` runs on this machine's default backend: with one device ``"host"``
    on a CPU (the fused expert kernel on the host's BLAS, the fastest dropless path there) and
    ``"tokamax"`` on a GPU or TPU (``"gmm"``, the project's Pallas grouped matmul, where
    tokamax is not installed); with several devices ``"grouped"``
    (plain jnp, which the SPMD partitioner shards). Inside a jitted function ``"auto"`` picks
    the kernel of the platform the function is built for, so a program exported for another
    platform (:func:`moejax.kernels.targets.lowering_target`) gets that platform's kernel.
    Under a data x expert mesh set for tracing, ``"expert_parallel"``. Other names are
    returned as they are."""
    if method != "auto":
        return method
    if _mesh() is not None:
        return "expert_parallel"
    if jax.device_count() > 1:
        return "grouped"
    if jax.default_backend() == "cpu":
        return "host"
    return "tokamax" if RAGGED_DOT_AVAILABLE else "gmm"


def describe_dispatch(method: DispatchMethod) -> str:
    """:func:`resolve_dispatch` in words, for tables: ``"auto"`` resolved to ``"tokamax"``
    for a platform where the project's own kernels take some products also says which kernel
    runs each pass from what size (:func:`moejax.kernels.grouped.ragged.implementation`)."""
    runs = resolve_dispatch(method)
    platform = target_device()[0]
    tiers = OWN_TIERS.get(platform, {})
    if method == "auto" and runs == "tokamax" and tiers:
        default = IMPLEMENTATIONS.get(platform, IMPLEMENTATIONS["default"])
        runs += " (" + "; ".join(
            f"{which}: " + ", ".join([default[which]] + [
                f"{kernel} from {flops / 1e9:g} GFLOP" for flops, kernel in
                tiers.get(which, ())]) for which in default) + ")"
    return runs


_TAKE_WIDTHS = ("auto", "host", "host_capacity")
# The dropless one-device paths, which with k = E (every expert active: a teacher distilled
# with ALL or SAR) run the dense path instead: the same weighted sum of every expert, without
# sorting E copies of each token (the grouped paths' [N E, D] rows). Capacity paths keep
# their own (a capacity factor below 1 drops even then); expert parallelism keeps its
# all-to-all, whose experts live on other devices.
_EVERY_EXPERT_DENSE = ("auto", "ragged", "gmm", "tokamax", "grouped", "bucketed", "host")


def dispatch(
    method: DispatchMethod, x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF=None,
    *, activation: str, capacity_factor: float = 1.0, valid_N=None, priority: str = "choice",
    expert_widths_E=None,
) -> DispatchOut:
    """Run the dispatch path named ``method`` (``"auto"`` or a key of :data:`PATHS`).
    ``expert_widths_E`` (int ``[E]``, optional): experts of different widths zero-padded to one
    width; the host kernel skips each expert's padding when it runs, every other path computes
    it (zeros: the result is the same)."""
    path = _auto if method == "auto" else PATHS.get(method)
    if path is None:
        raise ValueError(f"unknown dispatch method {method!r}; allowed: 'auto', "
                         + ", ".join(repr(k) for k in PATHS))
    if method in ("tokamax", "gmm") and _IN_XLA.value:  # the kernels' work, as XLA can count it
        path = _grouped
    if ids_NK.shape[-1] == w_up_EDF.shape[0] and method in _EVERY_EXPERT_DENSE and (
            method != "auto" or _mesh() is None):
        path = _dense  # every token takes every expert: the same sum, without E copies
    kw = {"widths_E": expert_widths_E} if expert_widths_E is not None and (
        method in _TAKE_WIDTHS) else {}
    return path(x_ND, ids_NK, weights_NK, w_up_EDF, w_down_EFD, w_gate_EDF,
                activation=activation, capacity_factor=capacity_factor, valid_N=valid_N,
                priority=priority, **kw)
