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
  selects the CPU collectives implementation for CPU-only tests; on a jaxlib that deadlocks
  on the programs jax's persistent compilation cache loads, the cache is then off for the
  process (:func:`moejax.cpu_pool.compile_here`).

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

When a process dies, the others cannot go on. A watcher thread started by
:func:`initialize_from_env` notices (the coordination service's view of who is alive, with a
``MOEJAX_HEARTBEAT_TIMEOUT``, default 30 s) and exits each survivor with one line saying what
happened and how to resume, and :data:`EXIT_PEER_LOST`; a collective that fails first
becomes :class:`PeerLostError` in the training loop (naming the step and the checkpoint that
resumes it), which :func:`moejax.harness.experiment.main` prints and exits with the same code.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import jax
import numpy as np

from moejax.cpu_pool import compile_here, pool_env
from moejax.data.source import local_slice
from moejax.train.mesh import batch_sharding

__all__ = ["initialize_from_env", "local_batch", "assemble", "global_batch", "is_main_process",
           "cpu_devices_env", "PeerLostError", "PeerWatch", "is_peer_failure", "EXIT_PEER_LOST",
           "HEARTBEAT_TIMEOUT_S"]

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: try again (every process, the same command)
HEARTBEAT_TIMEOUT_S = 30  # MOEJAX_HEARTBEAT_TIMEOUT: a process silent this long is dead
_WATCH_EVERY_S = 2.0
_EXIT_WAIT_S = 600  # how long a finished process waits for the others to finish
# how a collective or the coordination service reports a process that died (gloo, NCCL, gRPC)
_PEER_FAILURE = ("connection reset", "connection refused", "connection closed", "broken pipe",
                 "socket closed", "gloo", "nccl", "unavailable", "heartbeat",
                 "deadline_exceeded", "deadline exceeded", "coordination service")
_RESUME = ("checkpoints already written are complete and verified: start the same command on "
           "every process again to resume from the newest")


class PeerLostError(RuntimeError):
    """Another process of a multi-process run died. The others cannot finish the step (every
    collective needs all of them) nor close the checkpointer (its barriers too); the run is
    resumed by starting the same command on every process again. A program that catches this
    should exit at once (``os._exit``): an orderly exit waits on the processes that are
    gone."""


def is_peer_failure(error: BaseException, processes: int | None = None) -> bool:
    """Whether ``error``, raised in a run of ``processes`` processes (default: this run's),
    says another process is gone."""
    if (jax.process_count() if processes is None else processes) == 1:
        return False
    text = f"{type(error).__name__}: {error}".lower()
    return any(m in text for m in _PEER_FAILURE)

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


def initialize_from_env(env=None) -> PeerWatch | bool:
    """Call ``jax.distributed.initialize`` when launched as one of several processes.

    Returns the :class:`PeerWatch` on the other processes (or True where the runtime cannot
    say who is alive) when the distributed runtime was initialised, False for a single
    process.
    Raises ``ValueError`` naming the variable when the ``MOEJAX_*`` settings are incomplete
    or malformed, before anything is set up.
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
        n = _whole(env, "MOEJAX_NUM_PROCESSES", least=1)
        pid = _whole(env, "MOEJAX_PROCESS_ID")
        if pid >= n:
            raise ValueError(f"MOEJAX_PROCESS_ID={pid} must be in [0, MOEJAX_NUM_PROCESSES={n})")
        local = env.get("MOEJAX_LOCAL_DEVICE_IDS")
        ids = None
        if local:
            ids = local.split(",")
            if not all(i.strip().isdigit() for i in ids):
                raise ValueError(f"MOEJAX_LOCAL_DEVICE_IDS={local!r} must be device numbers "
                                 "separated by commas, e.g. 0,1")
            ids = [int(i) for i in ids]
        heartbeat = _heartbeat(env)
        _maybe_cpu_collectives(env, n)
        return _start(heartbeat, coordinator_address=coord, num_processes=n, process_id=pid,
                      local_device_ids=ids)
    if _auto_detectable(env):
        return _start(_heartbeat(env))
    return False


def _start(heartbeat: int, **where) -> PeerWatch | bool:
    """``jax.distributed.initialize(**where)``, recoverable (``jax_enable_recoverability``:
    the coordination service then reports a dead process to the others instead of aborting
    them, so they outlive it long enough to say so), and the watch on the others."""
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat, **where)
    return _watch_peers() or True


def _whole(env, name: str, least: int = 0, unit: str = "", default: int | None = None) -> int:
    """The whole number ``env[name]`` (at least ``least``; ``default`` where it is not set),
    or ``ValueError`` naming it."""
    raw = env.get(name, str(default))
    if not raw.strip().isdigit() or int(raw) < least:
        raise ValueError(f"{name}={raw!r} must be a whole number{unit} >= {least}")
    return int(raw)


def _heartbeat(env) -> int:
    """The heartbeat timeout: a process silent this long is dead (``MOEJAX_HEARTBEAT_TIMEOUT``
    seconds, default ``HEARTBEAT_TIMEOUT_S``)."""
    return _whole(env, "MOEJAX_HEARTBEAT_TIMEOUT", least=1, unit=" of seconds",
                  default=HEARTBEAT_TIMEOUT_S)


class PeerWatch:
    """The watch on the other processes of a multi-process run (:func:`initialize_from_env`):
    a daemon thread asks the coordination service every few seconds which processes are alive
    (every process asks, barrier-like, as ``multihost_utils.live_devices`` does) and, when one
    is gone, prints one line and exits with :data:`EXIT_PEER_LOST`: the main thread may then be
    blocked for good in a collective that waits on the dead process, so the watcher exits the
    process itself.

    At exit (before jax's own shutdown: atexit runs last-registered first) a process that
    finished stops watching, waits for the others to finish too, and the others disconnect
    before process 0, which hosts the coordination service: recoverable processes do not wait
    for each other at shutdown, so without this one could take another's orderly exit for a
    death, or disconnect from a service already gone. A process that failed leaves at once
    (a study's ``main`` exits it directly; after an uncaught exception, or :meth:`abandon`,
    it skips the wait), so the others stop within the heartbeat timeout instead of waiting
    on it."""

    def __init__(self, client):
        self.client, self.me = client, jax.process_index()
        self.everyone = list(range(jax.process_count()))
        self.leaving, self.abandoned = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._watch, name="moejax-peer-watch",
                                       daemon=True)
        self.thread.start()
        atexit.register(self._leave)

    def abandon(self) -> None:
        """This process failed: at exit, leave without waiting for the others."""
        self.abandoned.set()

    def _watch(self) -> None:
        while not self.leaving.is_set():
            try:
                live = set(self.client.get_live_nodes(self.everyone))
            except Exception as e:  # the service itself is gone (process 0 died)
                if self.leaving.is_set():
                    return
                _exit_lost(self.me, f"the coordination service stopped answering: {e}")
            gone = sorted(set(self.everyone) - live)
            if gone and not self.leaving.is_set():
                _exit_lost(self.me, f"process {', '.join(map(str, gone))} stopped")
            self.leaving.wait(_WATCH_EVERY_S)

    def _leave(self) -> None:
        self.leaving.set()
        if self.abandoned.is_set() or getattr(sys, "last_value", None) is not None:
            return  # failed: the others notice within the heartbeat timeout
        try:
            self.client.wait_at_barrier("moejax_exit", timeout_in_ms=_EXIT_WAIT_S * 1000)
        except Exception:  # a peer died meanwhile: nothing to wait for  # noqa: BLE001
            return
        if self.me != 0:
            jax.distributed.shutdown()
            return
        self.thread.join(timeout=_EXIT_WAIT_S)
        deadline = time.time() + _EXIT_WAIT_S
        while time.time() < deadline:  # until every other process has disconnected
            try:
                if set(self.client.get_live_nodes(self.everyone)) <= {0}:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.1)


def _watch_peers() -> PeerWatch | None:
    """Start the watch when the runtime's client can say who is alive."""
    from jax._src import distributed as jax_distributed  # the runtime's client, as live_devices

    client = jax_distributed.global_state.client
    if client is None or not hasattr(client, "get_live_nodes"):
        return None
    return PeerWatch(client)


def _exit_lost(me: int, what: str) -> None:
    first = (what.strip().splitlines() or [""])[0][:300]
    sys.stdout.flush()
    print(f"error: process {me} of {jax.process_count()} lost another process ({first}); "
          f"{_RESUME}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def _maybe_cpu_collectives(env, n_processes: int) -> None:
    impl = env.get("MOEJAX_CPU_COLLECTIVES")
    if impl is None and n_processes > 1 and env.get("JAX_PLATFORMS", "") == "cpu":
        impl = "gloo"
    if impl:
        jax.config.update("jax_cpu_collectives_implementation", impl)
        if impl == "gloo":
            compile_here()


def is_main_process() -> bool:
    return jax.process_index() == 0


def cpu_devices_env(n_devices: int, env=None) -> dict[str, str]:
    """The environment (a copy of ``env``, default ``os.environ``) for a new Python process
    that sees ``n_devices`` simulated CPU devices: ``JAX_PLATFORMS=cpu`` and jax's
    ``JAX_NUM_CPU_DEVICES`` (a jax option, so no XLA flag that a jaxlib may not know), with a
    ``--xla_force_host_platform_device_count`` flag of the caller's removed and the other XLA
    flags kept (the device count is fixed when JAX starts, so multi-device runs on one CPU
    need a new process); on a jaxlib whose CPU client needs it, a worker pool that cannot
    deadlock in a collective (:mod:`moejax.cpu_pool`)."""
    env = dict(os.environ if env is None else env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["JAX_NUM_CPU_DEVICES"] = str(n_devices)
    env["JAX_PLATFORMS"] = "cpu"
    env.update(pool_env(n_devices, env))
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
