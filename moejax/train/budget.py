"""Whether a training step fits the machine it is about to run on.

The training loop compiles its step (XLA's buffer assignment gives the peak bytes per device:
weights, optimizer state, batch, activations, temporaries) and, before the first step runs,
compares that peak with the memory the device has: an accelerator's ``bytes_limit``, or for
CPU devices this host's physical memory shared by its local devices. A step that cannot fit
stops there with :class:`MemoryBudgetError` (a :class:`~moejax.config.ConfigError`: one line,
exit 2 from a study's command) naming the estimate, the memory and the keys that shrink it,
instead of running out of memory minutes later.
"""

from __future__ import annotations

import logging
import os

import jax

from moejax.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["MemoryBudgetError", "available_bytes", "check_fits", "check_program_fits",
           "compile_fitting", "compiled_memory", "lowered_fitting"]


def compiled_memory(compiled) -> dict:
    """``{"peak_bytes", "argument_bytes", "temp_bytes"}`` of a compiled executable (-1 when
    XLA has none): peak = arguments + outputs + temporaries - aliased (donated) buffers."""
    m = compiled.memory_analysis()
    if m is None:
        return {"peak_bytes": -1, "argument_bytes": -1, "temp_bytes": -1}
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - getattr(m, "alias_size_in_bytes", 0))
    return {"peak_bytes": int(peak), "argument_bytes": int(m.argument_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes)}


def _size(n_bytes: int) -> str:
    """``n_bytes`` in GB, or MB / kB where GB would print 0.00."""
    if n_bytes >= 1e7:
        return f"{n_bytes / 1e9:.2f} GB"
    return f"{n_bytes / 1e6:.2f} MB" if n_bytes >= 1e5 else f"{n_bytes / 1e3:.1f} kB"


class MemoryBudgetError(ConfigError):
    """The compiled training step needs more memory than the device has."""


def available_bytes(device) -> tuple[int, str] | None:
    """``(bytes one device may use, what that is)``, or ``None`` when unknown."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats: nothing to compare
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    if device.platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
        n = max(1, jax.local_device_count())
        return total // n, (f"this host's memory shared by {n} CPU devices" if n > 1
                            else "this host's memory")
    return None


def check_fits(peak_bytes: int, cfg, device) -> None:
    """Raise :class:`MemoryBudgetError` when ``peak_bytes`` (per device) exceeds what
    ``device`` has; ``cfg`` is the run's ``TrainConfig`` (its keys are named in the fix)."""
    have = available_bytes(device) if peak_bytes > 0 else None
    if have is None or peak_bytes <= have[0]:
        return
    raise MemoryBudgetError(
        f"the training step needs about {_size(peak_bytes)} per device (XLA's estimate: "
        f"weights, optimizer state, batch, activations) but {have[1]} is "
        f"{_size(have[0])}. Fix: shrink it with the run's batch_size (now "
        f"{cfg.batch_size}) or the sequence length, raise grad_accum (now {cfg.grad_accum}), "
        f"set fsdp=true (now {cfg.fsdp}) or a larger mesh (mesh_data / mesh_expert), or run "
        "on a machine with more memory")


def check_program_fits(peak_bytes: int, device, what: str, fix: str) -> None:
    """:func:`check_fits` for any compiled program (an evaluation, a benchmark step) before
    it first runs: ``what`` it is and the ``fix`` (the keys that shrink it) are named."""
    have = available_bytes(device) if peak_bytes > 0 else None
    if have is None or peak_bytes <= have[0]:
        return
    raise MemoryBudgetError(
        f"{what} needs about {_size(peak_bytes)} per device (XLA's estimate) but "
        f"{have[1]} is {_size(have[0])}. Fix: {fix}")


def compile_fitting(fn, *args, what: str, fix: str):
    """``fn`` (a jitted function) compiled for ``args`` and checked with
    :func:`check_program_fits` before it first runs; XLA's estimate is logged. Call the
    returned executable in place of ``fn`` (it keeps ``fn``'s donation)."""
    return lowered_fitting(fn.lower(*args), what=what, fix=fix)


def lowered_fitting(lowered, *, what: str, fix: str):
    """:func:`compile_fitting` for a program already lowered (``jitted.lower(...)``): the
    compiled executable, checked before it first runs. Calling the jitted function with the
    same arguments afterwards reuses this compilation."""
    compiled = lowered.compile()
    peak = compiled_memory(compiled)["peak_bytes"]
    device = jax.devices()[0]
    if peak > 0:
        log.info("%s: about %s per device (XLA's estimate)", what, _size(peak))
    check_program_fits(peak, device, what, fix)
    return compiled
