"""Named accelerators to lower for when none is attached (ahead-of-time proof).

A Pallas GPU kernel reads its target's compute capability while it lowers; with no GPU on
the machine it takes it from the abstract device of the current abstract mesh. So an export
for ``cuda`` or ``tpu`` from a CPU host names its device:

    with lowering_target("cuda"):             # an H100 (sm90)
        jax.export.export(jax.jit(f), platforms=("cuda",))(*args)

``mesh`` keeps a concrete mesh's axes (expert parallelism) with the device swapped.
"""

from __future__ import annotations

import contextlib

from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from moejax.kernels.grouped.ragged import cross_compile

__all__ = ["TARGETS", "COMPUTE_CAPABILITY", "lowering_target"]

# device_kind as jax reports it on that device; num_cores: SMs (GPU) or TensorCores (TPU)
TARGETS: dict[str, AbstractDevice] = {
    "cuda": AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"),
    "tpu": AbstractDevice(device_kind="TPU v5p", num_cores=2, platform="tpu"),
}

# what tokamax reads from a local GPU to pick its kernels (sm90 for the H100)
COMPUTE_CAPABILITY: dict[str, float] = {"cuda": 9.0}


@contextlib.contextmanager
def lowering_target(platform: str, mesh=None):
    """Lower under ``TARGETS[platform]`` (``mesh``: a concrete or abstract mesh whose axes
    to keep; default one device), with tokamax's kernels lowered for it too
    (:func:`moejax.kernels.grouped.ragged.cross_compile`). Yields the abstract device."""
    if platform not in TARGETS:
        raise ValueError(f"no lowering target for platform {platform!r}; "
                         f"known: {', '.join(TARGETS)}")
    device = TARGETS[platform]
    if mesh is None:
        target = AbstractMesh((1,), ("target",), (AxisType.Auto,), abstract_device=device)
    else:
        target = getattr(mesh, "abstract_mesh", mesh).update(abstract_device=device)
    with use_abstract_mesh(target), cross_compile(COMPUTE_CAPABILITY.get(platform)):
        yield device
