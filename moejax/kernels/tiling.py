"""Block-size arithmetic and per-platform kernel choice shared by the Pallas kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pad_to", "pow2", "block", "on_target", "choose_platform", "target_device",
           "hopper_target", "peak_flops", "PEAK_FLOPS"]

_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
# dense 16-bit tensor-core peaks (FLOP/s) by the device-kind name they appear in, the
# fastest part of each family (H100 SXM's 989 TFLOP/s; an H200 has the same cores): the
# GPU-hour estimates' rate, and a rate a benchmark measures above it is a timing error
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12}


def peak_flops(device_kind: str, dtype) -> float | None:
    """The dense tensor-core peak of ``device_kind`` for 16-bit ``dtype`` (``PEAK_FLOPS``),
    None for another dtype or a device not listed."""
    if jnp.dtype(dtype).itemsize != 2:
        return None
    return next((f for name, f in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0]))
                 if name in device_kind), None)


def pad_to(a, axis: int, multiple: int):
    """``a`` zero-padded along ``axis`` to a multiple of ``multiple``."""
    pad = (-a.shape[axis]) % multiple
    if not pad:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths)


def pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two ``>= max(n, at_least)``."""
    return max(at_least, 1 << max(0, int(n) - 1).bit_length())


def block(dim: int, pref: int) -> int:
    """The block length for an axis of ``dim``: ``pref``, or the whole axis when shorter."""
    return dim if dim <= pref else pref


_LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def on_target(*args, default=None, **branches):
    """``branches[p](*args)`` for the platform ``p`` the program is built for
    (:func:`target_device`), ``default(*args)`` where ``branches`` has none.

    Only that branch is traced: :func:`jax.lax.platform_dependent` traces every branch it is
    given, and tracing the other platforms' Pallas kernels, which this program would never
    lower, took a large share of a CPU run's time. The branch sits under ``platform_dependent``
    keyed by its platform alone, so the program lowers for that platform only: lowering it
    for another fails (jax names ``platform_index`` and the platform) instead of running the
    wrong platform's kernel. Lower for an accelerator that is not attached under
    :func:`moejax.kernels.targets.lowering_target`, which makes it the target."""
    platform = target_device()[0]
    branch = branches.get(platform, default)
    if branch is None:
        raise ValueError(f"no kernel for platform {platform!r}; there are kernels for "
                         f"{', '.join(sorted(branches))}")
    if platform in _LOWERING_PLATFORMS:
        return jax.lax.platform_dependent(*args, **{platform: branch})
    return jax.lax.platform_dependent(*args, default=branch)


def choose_platform(args, *, mosaic, triton, interpret: bool):
    """Run ``mosaic(interpret)`` on TPU (interpret mode on CPU) and ``triton`` on GPU: the
    branch of the platform the program is built for (:func:`on_target`). ``interpret=True``
    runs the interpreted Mosaic kernel everywhere."""
    if interpret:
        return mosaic(True)(*args)
    return on_target(*args, cpu=mosaic(True), tpu=mosaic(False), cuda=triton, rocm=triton)


def target_device() -> tuple[str, str]:
    """``(platform, device_kind)`` of the device a program is being built for: the abstract
    device of the mesh set for lowering (:func:`moejax.kernels.targets.lowering_target`: an
    export for an accelerator that is not attached), else the default device. The platform
    is jax's lowering name (``"cuda"`` for an NVIDIA GPU)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None:
        device = jax.devices()[0]
    platform = device.platform
    if platform == "gpu":
        platform = "rocm" if "AMD" in device.device_kind.upper() else "cuda"
    return platform, device.device_kind


def hopper_target() -> bool:
    """Whether the program is being built for a Hopper GPU: the attached GPU's compute
    capability 9.x, or the abstract device named for an export
    (:func:`moejax.kernels.targets.lowering_target`)."""
    platform, kind = target_device()
    if platform != "cuda":
        return False
    local = jax.devices()[0]
    capability = getattr(local, "compute_capability", None) if local.platform == "gpu" else None
    if capability is not None:
        return str(capability).startswith("9")
    return any(k in kind for k in _HOPPER_KINDS)
