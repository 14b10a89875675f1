"""Multi-process (multi-host) training on JAX's distributed runtime.

Every process runs the same program. :func:`initialize_from_env` connects the processes
(call it first, before any other JAX call); the mesh from :func:`moejax.train.mesh.make_mesh`
then spans all processes' devices; each process loads only its own rows of every global batch
(:func:`local_batch`, via ``source.local_batch`` or :func:`moejax.data.source.local_slice`) and
:func:`global_batch` assembles the global ``jax.Array`` with
``jax.make_array_from_process_local_data``. The training loop does this automatically.

Environment read by :func:`initialize_from_env`:

* explicit: ``MOEJAX_COORDINATOR=host:port``, ``MOEJAX_NUM_PROCESSES=N``,
  ``MOEJAX_PROCESS_ID=i`` (optional ``MOEJAX_LOCAL_DEVICE_IDS=0,1``);
* otherwise JAX's own cluster auto-detection when a launcher is recognised: SLURM
  (``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1), Cloud TPU pod slices (``TPU_WORKER_HOSTNAMES``
  / ``MEGASCALE_COORDINATOR_ADDRESS``), Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1);
* nothing of the above: single process, nothing to do.
* ``MOEJAX_CPU_COLLECTIVES=gloo`` (default when ``JAX_PLATFORMS=cpu`` and multi-process)
  selects the CPU collectives implementation for CPU-only tests.

Launching
---------
Single multi-GPU node: ONE process drives all local GPUs; no initialisation is needed::

    python -m experiments.lm_demo train.mesh_data=-1 train.mesh_expert=2

(or one process per GPU: ``MOEJAX_COORDINATOR=localhost:1234 MOEJAX_NUM_PROCESSES=8
MOEJAX_PROCESS_ID=$i CUDA_VISIBLE_DEVICES=$i python ...`` for ``i`` in 0..7.)

Several GPU nodes under SLURM: ``srun --ntasks-per-node=1 --gpus-per-task=8 python ...``
(JAX reads the SLURM variables). Without SLURM, on every node ``k`` of ``N``::

    MOEJAX_COORDINATOR=node0:1234 MOEJAX_NUM_PROCESSES=N MOEJAX_PROCESS_ID=k python ...

TPU pod slice: run the same command on every worker, e.g.
``gcloud compute tpus tpu-vm ssh NAME --worker=all --command="cd moejax && python ..."``;
JAX detects the slice topology itself.

Batch sizes must be divisible by the process count (each process loads
``batch_size / process_count`` rows) and by the mesh size.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from moejax.data.source import local_slice
from moejax.train.mesh import batch_sharding

__all__ = ["initialize_from_env", "local_batch", "assemble", "global_batch", "is_main_process",
           "cpu_devices_env"]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _auto_detectable(env) -> bool:
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1")) > 1:
        return True
    if env.get("TPU_WORKER_HOSTNAMES") and "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return True
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    return False


def initialize_from_env(env=None) -> bool:
    """Call ``jax.distributed.initialize`` when launched as one of several processes.

    Returns True when the distributed runtime was initialised, False for a single process.
    Raises ``ValueError`` naming the variable when the ``MOEJAX_*`` settings are incomplete.
    """
    env = os.environ if env is None else env
    coord = env.get("MOEJAX_COORDINATOR")
    if coord:
        missing = [k for k in ("MOEJAX_NUM_PROCESSES", "MOEJAX_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(
                f"MOEJAX_COORDINATOR={coord} is set but {missing} are not; set all of "
                "MOEJAX_COORDINATOR, MOEJAX_NUM_PROCESSES and MOEJAX_PROCESS_ID"
            )
        n, pid = int(env["MOEJAX_NUM_PROCESSES"]), int(env["MOEJAX_PROCESS_ID"])
        if not 0 <= pid < n:
            raise ValueError(f"MOEJAX_PROCESS_ID={pid} must be in [0, MOEJAX_NUM_PROCESSES={n})")
        local = env.get("MOEJAX_LOCAL_DEVICE_IDS")
        _maybe_cpu_collectives(env, n)
        jax.distributed.initialize(
            coordinator_address=coord,
            num_processes=n,
            process_id=pid,
            local_device_ids=[int(i) for i in local.split(",")] if local else None,
        )
        return True
    if _auto_detectable(env):
        jax.distributed.initialize()
        return True
    return False


def _maybe_cpu_collectives(env, n_processes: int) -> None:
    impl = env.get("MOEJAX_CPU_COLLECTIVES")
    if impl is None and n_processes > 1 and env.get("JAX_PLATFORMS", "") == "cpu":
        impl = "gloo"
    if impl:
        jax.config.update("jax_cpu_collectives_implementation", impl)


def is_main_process() -> bool:
    return jax.process_index() == 0


def cpu_devices_env(n_devices: int, env=None) -> dict[str, str]:
    """The environment (a copy of ``env``, default ``os.environ``) for a new Python process
    that sees ``n_devices`` simulated CPU devices: ``JAX_PLATFORMS=cpu`` and jax's
    ``JAX_NUM_CPU_DEVICES`` (a jax option, so no XLA flag that a jaxlib may not know), with a
    ``--xla_force_host_platform_device_count`` flag of the caller's removed and the other XLA
    flags kept (the device count is fixed when JAX starts, so multi-device runs on one CPU
    need a new process)."""
    env = dict(os.environ if env is None else env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["JAX_NUM_CPU_DEVICES"] = str(n_devices)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def local_batch(source, position: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch ``position``."""
    pi, pc = jax.process_index(), jax.process_count()
    if pc == 1:
        return source.batch(position)
    if hasattr(source, "local_batch"):
        return source.local_batch(position, pi, pc)
    return local_slice(source.batch(position), pi, pc)


def assemble(local, mesh):
    """Global ``jax.Array`` s (dim 0 over ``("data", "expert")``) from each process's rows;
    ``local`` is any pytree of arrays (a dict of named arrays, a tuple ...)."""
    sh = batch_sharding(mesh)
    if jax.process_count() == 1:  # arrays already on a device stay there (no host round trip)
        return jax.tree.map(lambda v: jax.device_put(v, sh), local)
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sh, np.asarray(v)),
                        local)


def global_batch(source, position: int, mesh) -> dict[str, jax.Array]:
    """Global batch ``position`` as ``jax.Array`` s sharded over ``mesh`` (dim 0 over
    ``("data", "expert")``), each process contributing only its local rows."""
    return assemble(local_batch(source, position), mesh)
