"""Device mesh and sharding rules for data + expert parallelism.

Mesh axes ``("data", "expert")`` over ``jax.devices()`` (all processes' devices).

Rules (:func:`leaf_spec`):

* batch arrays: dim 0 over ``("data", "expert")`` -- every device gets distinct rows;
* params whose path contains a component named ``experts`` and whose leading dim is divisible
  by the ``expert`` axis size: ``P("expert")`` (expert-parallel stacked weights ``[E, ...]``);
* everything else: replicated, unless ``fsdp=True`` (ZeRO-3 style fully sharded data
  parallelism): then a non-expert leaf shards its largest dimension divisible by the device
  count over ``("data", "expert")`` (else one divisible by the ``data`` axis over ``"data"``),
  and an expert leaf its largest free dimension over ``"data"``. XLA gathers a layer's
  weights where they are used and reduce-scatters their gradients, so parameters and
  optimizer state take about ``1 / n`` of a device each;
* optimizer state: the same path rule, so ``mu``/``nu`` (whose paths end with the param's path)
  are sharded exactly like the params they mirror; scalar counters are replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import ConfigError
from moejax.pytree import path_names

__all__ = [
    "AXES",
    "BATCH_AXES",
    "resolve_mesh_shape",
    "make_mesh",
    "leaf_spec",
    "tree_shardings",
    "batch_sharding",
    "replicated",
    "shard_tree",
    "shard_batch",
]

AXES = ("data", "expert")
BATCH_AXES = ("data", "expert")


def resolve_mesh_shape(data: int, expert: int, n_devices: int) -> tuple[int, int]:
    """Fill a ``-1`` axis with the remaining devices; check the product."""
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


def make_mesh(data: int = -1, expert: int = 1, devices=None) -> Mesh:
    """Mesh with axes ``("data", "expert")``; ``-1`` = all remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    d, e = resolve_mesh_shape(data, expert, len(devices))
    # Auto axes: XLA propagates shardings (explicit-sharding mode would require every model
    # op to spell out its output sharding). All devices: jax's topology-aware order.
    if devices == list(jax.devices()):
        return jax.make_mesh((d, e), AXES, axis_types=(AxisType.Auto, AxisType.Auto))
    return Mesh(np.asarray(devices).reshape(d, e), AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def check_devices(cfg, n_devices: int, n_processes: int = 1, key: str = "train") -> None:
    """Refuse (:class:`~moejax.config.ConfigError`, one line naming the keys) a
    ``TrainConfig`` whose mesh does not fit ``n_devices`` or whose batch does not divide over
    the mesh and the processes, before anything is compiled or written."""
    try:
        d, e = resolve_mesh_shape(cfg.mesh_data, cfg.mesh_expert, n_devices)
    except ValueError as err:
        raise ConfigError(f"{key}.mesh_data={cfg.mesh_data} {key}.mesh_expert="
                          f"{cfg.mesh_expert}: {err}") from None
    micro = cfg.batch_size // cfg.grad_accum
    if micro % (d * e) or cfg.batch_size % n_processes:
        raise ConfigError(
            f"{key}.batch_size={cfg.batch_size} (micro-batches of {micro} rows) does not "
            f"divide over the {d}x{e} mesh ({d * e} devices) and {n_processes} process(es); "
            f"choose {key}.batch_size as a multiple of {d * e * cfg.grad_accum}")


def leaf_spec(path, x, expert_size: int, data_size: int = 1, fsdp: bool = False) -> P:
    """Partition spec of one state leaf (see module docstring)."""
    names = path_names(path)
    shape = tuple(getattr(x, "shape", ()))
    spec: list = [None] * len(shape)
    if "experts" in names and len(shape) >= 1 and expert_size > 1 and shape[0] % expert_size == 0:
        spec[0] = "expert"
    if fsdp:  # experts: the data axis; the rest: every device (both axes), else the data axis
        for axes, size in ((("data", "expert"), data_size * expert_size), ("data", data_size)):
            if size <= 1 or (axes != "data" and spec and spec[0] == "expert"):
                continue
            free = [i for i, n in enumerate(shape) if spec[i] is None and n % size == 0]
            if free:
                spec[max(free, key=lambda i: shape[i])] = axes
                break
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def tree_shardings(tree, mesh: Mesh, fsdp: bool = False):
    """``NamedSharding`` for every leaf of a params / optimizer / train-state tree."""
    e, d = mesh.shape["expert"], mesh.shape["data"]
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, leaf_spec(p, x, e, d, fsdp)), tree
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of batch arrays: dim 0 over ``("data", "expert")``."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


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
