"""Device mesh and sharding by logical axis names: data, expert, fully sharded data and
tensor parallelism.

Mesh axes ``("data", "expert")`` over ``jax.devices()`` (all processes' devices), and
``"tensor"`` after them when a tensor axis of more than one device is asked for.

Every moejax parameter names its dimensions (:mod:`moejax.nn.axes`); one table, :data:`RULES`,
says which mesh roles each logical axis may take, as MaxText's logical axis rules do:

* ``"expert"``: the mesh's expert axis, for the dimension named ``experts`` of a stacked
  expert weight whose size it divides (expert parallelism);
* ``"tensor"``: the mesh's tensor axis (if any), for the first dimension named ``mlp``,
  ``heads`` or ``kv_heads`` whose size it divides (tensor parallelism, as Megatron splits a
  layer: an FFN's hidden width, attention's heads; XLA partitions the products and inserts
  their collectives; the batch is not split over it);
* ``"fsdp"``: with ``fsdp=True`` (ZeRO-3 style fully sharded data parallelism) the largest
  dimension whose name takes it and whose size the device count divides is sharded over
  ``("data", "expert")`` (over ``"data"`` alone when the leaf already uses the expert axis,
  or when only the data axis divides it). XLA gathers a layer's weights where they are used
  and reduce-scatters their gradients, so parameters and optimizer state take about
  ``1 / n`` of a device each.

Batch arrays: dim 0 over ``("data", "expert")``, so every device gets distinct rows. A leaf
without names (a user's own parameter, an optimizer counter, a buffer) is replicated;
:func:`unnamed_params` lists a model's parameters without names, which
:func:`check_named` refuses for moejax's own modules on a mesh of more than one device.
The optimizer's moments are the parameters' variables with the same names, so they are
sharded exactly like the parameters they mirror.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import ConfigError
from moejax.cpu_pool import check_pool
from moejax.nn import axes as ax

__all__ = [
    "AXES",
    "BATCH_AXES",
    "RULES",
    "unnamed_params",
    "check_named",
    "replicated_unnamed",
    "sharding_summary",
    "resolve_mesh_shape",
    "make_mesh",
    "loop_mesh",
    "TENSOR",
    "leaf_spec",
    "tree_shardings",
    "batch_sharding",
    "replicated",
    "shard_tree",
    "shard_batch",
]

log = logging.getLogger(__name__)

AXES = ("data", "expert")
BATCH_AXES = ("data", "expert")
TENSOR = "tensor"
_FSDP = ("fsdp",)
_SPLIT = ("tensor", "fsdp")
# logical axis -> the mesh roles it may take (module docstring)
RULES: dict[str, tuple[str, ...]] = {
    ax.EXPERTS: ("expert",),
    ax.MLP: _SPLIT, ax.HEADS: _SPLIT, ax.KV_HEADS: _SPLIT,
    ax.EMBED: _FSDP, ax.VOCAB: _FSDP, ax.SCORES: _FSDP, ax.NORM: _FSDP, ax.RANK: _FSDP,
    ax.KEPT: _FSDP, ax.CLASSES: _FSDP, ax.POSITIONS: _FSDP, ax.PATCH: _FSDP, ax.FEATURES: _FSDP,
}


def resolve_mesh_shape(data: int, expert: int, n_devices: int, tensor: int = 1
                       ) -> tuple[int, int]:
    """Fill a ``-1`` axis with the devices the others leave (``tensor`` devices each take
    one data x expert mesh); check the product."""
    if tensor < 1 or n_devices % tensor:
        raise ValueError(f"mesh: a tensor axis of {tensor} does not divide the {n_devices} "
                         "devices; choose mesh_tensor dividing the device count")
    n_devices //= tensor
    for name, size in (("mesh_data", data), ("mesh_expert", expert)):
        if size != -1 and size < 1:
            raise ValueError(f"mesh: {name}={size} must be -1 (all remaining devices) or >= 1")
    if data == -1 and expert == -1:
        raise ValueError("mesh: data and expert cannot both be -1; fix one of them")
    if data == -1:
        if n_devices % expert:
            raise ValueError(
                f"mesh: {n_devices} devices are not divisible by mesh_expert={expert}; "
                "choose mesh_expert dividing the device count"
            )
        data = n_devices // expert
    if expert == -1:
        if n_devices % data:
            raise ValueError(
                f"mesh: {n_devices} devices are not divisible by mesh_data={data}; "
                "choose mesh_data dividing the device count"
            )
        expert = n_devices // data
    if data * expert != n_devices or data < 1 or expert < 1:
        raise ValueError(
            f"mesh {data}x{expert} (mesh_data x mesh_expert) uses {data * expert} devices but "
            f"{n_devices} are available; use -1 for one axis or sizes whose product is "
            f"{n_devices} (restrict devices with CUDA_VISIBLE_DEVICES to use fewer)"
        )
    return data, expert


def make_mesh(data: int = -1, expert: int = 1, devices=None, tensor: int = 1) -> Mesh:
    """Mesh with axes ``("data", "expert")`` (and ``"tensor"`` when ``tensor > 1``); ``-1`` =
    all remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    d, e = resolve_mesh_shape(data, expert, len(devices), tensor)
    check_pool(devices)
    shape, names = ((d, e), AXES) if tensor == 1 else ((d, e, tensor), (*AXES, TENSOR))
    # Auto axes: XLA propagates shardings (explicit-sharding mode would require every model
    # op to spell out its output sharding). All devices: jax's topology-aware order.
    types = (AxisType.Auto,) * len(names)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, names, axis_types=types)
    return Mesh(np.asarray(devices).reshape(shape), names, axis_types=types)


def loop_mesh(mesh: Mesh) -> Mesh:
    """A caller's mesh as the training loop runs on it. Its axes must be named as
    :func:`make_mesh` names them, ``"data"`` and ``"expert"`` (and ``"tensor"``), since the
    step shards batches, experts and matrices by those names; explicit axes
    (``jax.make_mesh``'s default) become automatic, as the step leaves its shardings to XLA's
    propagation (same devices, same order)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh is a {type(mesh).__name__}; give a jax.sharding.Mesh "
                        "(moejax.train.mesh.make_mesh(data=..., expert=...))")
    names = tuple(mesh.axis_names)
    if set(AXES) - set(names) or set(names) - {*AXES, TENSOR}:
        raise ValueError(f"mesh axes {names}: the training loop shards over axes named "
                         f"{AXES} (and {TENSOR!r}); build the mesh with "
                         "moejax.train.mesh.make_mesh(data=..., expert=...) or name its axes "
                         "so (a size-1 axis where one is not split)")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))


def check_devices(cfg, n_devices: int, n_processes: int = 1, key: str = "train") -> None:
    """Refuse (:class:`~moejax.config.ConfigError`, one line naming the keys) a
    ``TrainConfig`` whose mesh does not fit ``n_devices`` or whose batch does not divide over
    the mesh and the processes, before anything is compiled or written."""
    try:
        d, e = resolve_mesh_shape(cfg.mesh_data, cfg.mesh_expert, n_devices, cfg.mesh_tensor)
    except ValueError as err:
        raise ConfigError(f"{key}.mesh_data={cfg.mesh_data} {key}.mesh_expert="
                          f"{cfg.mesh_expert} {key}.mesh_tensor={cfg.mesh_tensor}: "
                          f"{err}") from None
    micro = cfg.batch_size // cfg.grad_accum
    if micro % (d * e) or cfg.batch_size % n_processes:
        raise ConfigError(
            f"{key}.batch_size={cfg.batch_size} (micro-batches of {micro} rows) does not "
            f"divide over the {d}x{e} mesh ({d * e} devices) and {n_processes} process(es); "
            f"choose {key}.batch_size as a multiple of {d * e * cfg.grad_accum}")


def leaf_spec(names, shape, expert_size: int, data_size: int = 1, fsdp: bool = False,
              tensor_size: int = 1) -> P:
    """Partition spec of one state leaf of ``shape`` with logical axis ``names`` (None:
    replicated) by :data:`RULES` (module docstring)."""
    shape = tuple(shape)
    if names is None or not shape:
        return P()
    spec: list = [None] * len(shape)
    for role, axis, size in (("expert", "expert", expert_size), ("tensor", TENSOR, tensor_size)):
        for i, name in enumerate(names):
            if role in RULES[name] and spec[i] is None and size > 1 and shape[i] % size == 0:
                spec[i] = axis
                break
    if fsdp:  # every device (both axes), else the data axis; the data axis beside the experts
        takes = [i for i, name in enumerate(names) if "fsdp" in RULES[name] and spec[i] is None]
        for axes, size in ((("data", "expert"), data_size * expert_size), ("data", data_size)):
            if size <= 1 or (axes != "data" and "expert" in spec):
                continue
            free = [i for i in takes if shape[i] % size == 0]
            if free:
                spec[max(free, key=lambda i: shape[i])] = axes
                break
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree, mesh: Mesh, fsdp: bool = False):
    """``NamedSharding`` for every leaf of a params / optimizer / train-state tree, from the
    logical axis names its variables carry (:func:`leaf_spec`), on ``mesh`` as the loop runs
    on it (:func:`loop_mesh`)."""
    mesh = loop_mesh(mesh)
    e, d, t = mesh.shape["expert"], mesh.shape["data"], dict(mesh.shape).get(TENSOR, 1)

    def one(x):
        value = x.get_value() if _is_variable(x) else x
        if _is_variable(x) and not hasattr(value, "shape"):  # a pytree in one variable
            return x.replace(jax.tree.map(lambda _: NamedSharding(mesh, P()), value))
        sharding = NamedSharding(mesh, leaf_spec(ax.logical_axes(x), getattr(value, "shape", ()),
                                                 e, d, fsdp, t))
        return x.replace(sharding) if _is_variable(x) else sharding

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def unnamed_params(model) -> list[tuple[str, str]]:
    """``(path, owner)`` of every ``nnx.Param`` of ``model`` (a module) without logical axis
    names; ``owner`` is the module class that holds it, ``"module.Class"``."""
    nodes = dict(nnx.iter_graph(model))
    return [("/".join(map(str, path)), f"{type(nodes[path[:-1]]).__module__}."
             f"{type(nodes[path[:-1]]).__qualname__}")
            for path, node in nodes.items()
            if isinstance(node, nnx.Param) and ax.logical_axes(node) is None]


def check_named(model, n_devices: int) -> list[str]:
    """The paths of ``model``'s parameters without logical axis names, which a mesh of
    ``n_devices`` replicates; refuses (ValueError, naming each and the fix) one held by a
    moejax module when ``n_devices > 1``."""
    unnamed = unnamed_params(model)
    ours = [f"{p} ({o})" for p, o in unnamed if o.startswith("moejax.")]
    if ours and n_devices > 1:
        raise ValueError(f"moejax parameters without logical axis names cannot be sharded: "
                         f"{', '.join(ours)}; make them with moejax.nn.axes.param(value, "
                         "*names)")
    return [p for p, _ in unnamed]


def replicated_unnamed(graphdef, params, rest, n_devices: int) -> list[str]:
    """The parameters a mesh of ``n_devices`` replicates for want of logical axis names:
    a split module's (:func:`check_named`, which refuses a moejax module's), or every leaf of
    a plain pytree (``graphdef`` None). Logged once where they matter (more than one
    device)."""
    if graphdef is None:
        unnamed = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    else:
        unnamed = check_named(nnx.merge(graphdef, params, rest), n_devices)
    if unnamed and n_devices > 1:
        log.warning("%d parameters without logical axis names are replicated over the %d "
                    "devices: %s", len(unnamed), n_devices, ", ".join(unnamed[:8])
                    + (" ..." if len(unnamed) > 8 else ""))
    return unnamed


def sharding_summary(params, mesh: Mesh, fsdp: bool, unnamed) -> dict:
    """What a run's ``sharding.json`` records: the mesh, the rules, every parameter's logical
    axis names and partition spec, and the parameters replicated for want of names."""
    shardings = jax.tree.leaves(tree_shardings(params, mesh, fsdp))
    named = jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable)
    return {
        "mesh": dict(mesh.shape), "fsdp": bool(fsdp),
        "rules": {name: list(roles) for name, roles in sorted(RULES.items())},
        "params": {jax.tree_util.keystr(path): {
            "logical_axes": None if (names := ax.logical_axes(x)) is None else list(names),
            "spec": [None if a is None else a if isinstance(a, str) else list(a)
                     for a in sh.spec]}
            for (path, x), sh in zip(named, shardings)},
        "replicated_unnamed": list(unnamed),
    }


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of batch arrays: dim 0 over ``("data", "expert")`` (of :func:`loop_mesh`)."""
    return NamedSharding(loop_mesh(mesh), P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(loop_mesh(mesh), P())


def _put(x, sharding):
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    # Multi-process: every process holds the same full value; each fills its own shards.
    host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_tree(tree, mesh: Mesh, fsdp: bool = False):
    """Place a (host-identical) state tree on ``mesh`` with :func:`tree_shardings`."""
    return jax.tree.map(_put, tree, tree_shardings(tree, mesh, fsdp))


def shard_batch(batch, mesh: Mesh):
    """Place a full global batch (single process) on ``mesh``; see
    :func:`moejax.train.distributed.global_batch` for the multi-process version."""
    sh = batch_sharding(mesh)
    return jax.tree.map(lambda v: _put(np.asarray(v), sh), batch)
