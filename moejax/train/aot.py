"""Ahead-of-time proof of a training step for accelerators that are not attached, as
MaxText's ``train_compile`` does: the step is exported with ``jax.export`` for each platform at
its real shapes, lowered for a named device (:mod:`moejax.kernels.targets`), and the size of
the run is read from XLA.

:func:`prove_step` takes a :class:`~moejax.capture.CapturedStep` and returns one row
(:func:`prove_decode` does the same for a captured decode loop, per call;
:func:`abstract_run` makes the step a training run would capture for a model too large to
build, from its config alone):

- ``params``, ``weights_GB``, ``opt_state_GB``: from the state's shapes (f32 master weights);
- ``flops_per_step``: XLA's cost analysis of the step lowered for the CPU with the MoE
  experts in plain jnp (:func:`moejax.kernels.moe_ffn.api.experts_in_xla`, the ``grouped``
  path: the expert matmuls plus at most a tile of padding per expert). Work left inside
  custom calls or host callbacks is not in it; ``uncounted_calls`` says how many such calls
  remain, so a nonzero count makes the FLOPs a lower bound. XLA counts a loop's body once,
  so with gradient accumulation (the micro-batches' ``lax.scan``) the count is multiplied by
  ``grad_accum`` (the optimizer update outside the loop, some 10 FLOPs per parameter, is then
  counted ``grad_accum`` times: negligible beside 6 per parameter per token);
- ``peak_GB``: XLA's buffer assignment of that step compiled for the CPU at the same shapes
  (arguments + outputs + temporaries - donated), the per-device memory the step needs;
  ``activations_GB`` is its temporaries;
- ``<platform>_kernels``: the platform's kernel custom calls in the exported module (``cuda``:
  Triton or Mosaic GPU; ``tpu``: Mosaic), or the export's error;
- ``fits_H100_80GB``: ``peak_GB`` within the device's memory;
- ``gpu_hours``: ``flops_per_step x steps / (UTILISATION x H100_BF16_FLOPS)``.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.export as je
import jax.numpy as jnp
from flax import nnx

from moejax.capture import CapturedDecode, CapturedStep, abstract
from moejax.kernels.moe_ffn.api import experts_in_xla
from moejax.kernels.targets import lowering_target
from moejax.kernels.tiling import PEAK_FLOPS
from moejax.pytree import count_bytes, count_params
from moejax.train.budget import compiled_memory
from moejax.train.hparams import TrainConfig
from moejax.train.mesh import make_mesh
from moejax.train.step import init_state, lm_loss_fn
from moejax.train.step_cache import loop_step, loss_name

__all__ = ["prove_step", "prove_decode", "abstract_run", "H100_BF16_FLOPS", "H100_BYTES",
           "UTILISATION", "KERNEL_CALLS"]

H100_BF16_FLOPS = PEAK_FLOPS["H100"]  # dense bf16 tensor-core peak of an H100 SXM
H100_BYTES = 80e9
UTILISATION = 0.4  # the model-FLOPs utilisation the GPU-hour estimate assumes
TRITON = "__gpu$xla.gpu.triton"
KERNEL_CALLS = {"cuda": (TRITON, "mosaic_gpu", "mosaic_gpu_v2"), "tpu": ("tpu_custom_call",)}
_CALL = re.compile(r"custom_call @([\w$.]+)|custom_call_target=\"([\w$.]+)\"")


def _calls(text: str) -> dict[str, int]:
    found = [a or b for a, b in _CALL.findall(text)]
    return {c: found.count(c) for c in set(found)}


def _export(fn, args, static, platform: str, mesh=None) -> str:
    """The number of the platform's kernel calls in ``fn(*args, **static)`` exported, or the
    error."""
    checks = [je.DisabledSafetyCheck.custom_call(TRITON)]
    try:
        with contextlib.ExitStack() as stack:
            if mesh is not None:
                stack.enter_context(jax.set_mesh(mesh))
            stack.enter_context(lowering_target(platform, mesh))
            text = je.export(fn, platforms=(platform,), disabled_checks=checks)(
                *args, **static).mlir_module()
    except Exception as e:  # the row reports why the platform cannot take this step
        return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    calls = _calls(text)
    if any("callback" in k for k in calls):
        return "error: a host callback in the module"
    return str(sum(n for k, n in calls.items() if k in KERNEL_CALLS[platform]))


def prove_step(c: CapturedStep, platforms=("cuda", "tpu")) -> dict:
    """One row of the ahead-of-time table for a captured training step (module docstring)."""
    params = c.state.params
    with experts_in_xla():  # the experts' matmuls in XLA's analyses, not in a host callback
        lowered = c.step.lower(c.state, c.batch)
    cost = lowered.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0)) * c.cfg.grad_accum  # the scan's body counted once
    uncounted = sum(n for k, n in _calls(lowered.as_text()).items() if k != "Sharding")
    peak, temp = _peak(lowered.compile())
    row = {"run": c.label or "train",
           "params": count_params(params),
           "batch": "x".join(str(d) for d in jax.tree.leaves(c.batch)[0].shape),
           "steps": c.cfg.steps,
           "flops_per_step": flops,
           "uncounted_calls": uncounted,
           "weights_GB": count_bytes(params) / 1e9,
           "opt_state_GB": count_bytes(c.state.opt_state) / 1e9,
           "activations_GB": temp / 1e9,
           "peak_GB": peak / 1e9}
    for platform in platforms:
        row[f"{platform}_kernels"] = _export(_jitted(c), (c.state, c.batch), {}, platform,
                                             c.mesh)
    row["fits_H100_80GB"] = peak <= H100_BYTES
    row["gpu_hours"] = flops * c.cfg.steps / (UTILISATION * H100_BF16_FLOPS) / 3600
    return row


def _jitted(c: CapturedStep):
    """The captured step's jitted function (under a mesh: the one for this state)."""
    return c.step.jitted(c.state) if hasattr(c.step, "jitted") else c.step


def _peak(compiled) -> tuple[float, float]:
    """``(peak bytes, temporaries)`` from XLA's buffer assignment (:func:`compiled_memory`)."""
    m = compiled_memory(compiled)
    return m["peak_bytes"], m["temp_bytes"]


def prove_decode(c: CapturedDecode, platforms=("cuda", "tpu")) -> dict:
    """One row for a captured decode loop: the models' parameters (every ``nnx.State``
    argument), the prompt block's shape and the new tokens, XLA's FLOPs of one call (a
    ``while_loop``'s body counted once, so per round, not per call), its per-device peak
    (weights, KV caches, temporaries), whether one H100 holds it, and the exports with their
    kernels."""
    states = [a for a in c.args if isinstance(a, nnx.State)]
    tokens = next(a for a in c.args if isinstance(a, jax.ShapeDtypeStruct)
                  and jnp.issubdtype(a.dtype, jnp.integer))
    with experts_in_xla():  # the experts' matmuls in XLA's analyses, not in a host callback
        lowered = c.fn.lower(*c.args, **c.static)
    cost = lowered.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    peak, temp = _peak(lowered.compile())
    row = {"run": c.label, "params": sum(count_params(s) for s in states),
           "batch": "x".join(str(d) for d in tokens.shape),
           "new_tokens": c.static.get("max_new", 1),
           "flops_per_call": float(cost.get("flops", 0.0)),
           "weights_GB": sum(count_bytes(s) for s in states) / 1e9,
           "activations_GB": temp / 1e9, "peak_GB": peak / 1e9}
    for platform in platforms:
        row[f"{platform}_kernels"] = _export(c.fn, c.args, c.static, platform)
    row["fits_H100_80GB"] = peak <= H100_BYTES
    return row


def abstract_run(model_fn, cfg: TrainConfig, batch, *, loss_fn=lm_loss_fn,
                 label: str = "") -> CapturedStep:
    """The :class:`CapturedStep` ``train(model_fn(), source, cfg, loss_fn=loss_fn)`` records
    (:mod:`moejax.capture`), for a model too large to build here: ``model_fn`` runs under
    ``nnx.eval_shape`` (no weights are made; it makes its own ``nnx.Rngs``), the optimizer
    state is ``jax.eval_shape`` of the loop's own, and the step is the loop's
    (:func:`moejax.train.step_cache.loop_step`) on the mesh ``cfg`` names. ``batch``: one batch of
    the run's source (arrays or shapes)."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(model_fn), nnx.Param, ...)
    mesh = make_mesh(cfg.mesh_data, cfg.mesh_expert, tensor=cfg.mesh_tensor)
    tx, step = loop_step(graphdef, loss_fn, None, cfg, mesh)
    state = jax.eval_shape(lambda p, r: init_state(p, r, tx, cfg.seed), params, rest)
    return CapturedStep(label, step, mesh, state, abstract(batch), cfg,
                        program=loss_name(loss_fn))
