"""DeRS step 1 (Decompose) and the Fig. 1 analysis, on plain parameter dicts.

A trained vanilla upcycled MoE layer holds ``experts/w_* [N, d_in, d_out]`` (and, with the
universal FFN, ``universal/w_* [d_in, d_out]``). Every expert started from the same dense
weight, so (paper Eq. 2)::

    W_i = W_base + Delta_i,   i = 1..N   (N + 1 with ``extended``: the universal FFN last)

``W_base`` is the weight the experts were initialised from, the dense FFN, as in the paper
(:func:`bases_from_dense` rebuilds it from the dense model and the upcycling rule, including
the ``w_down`` output scale). :func:`decompose` has no default base: pass those bases, or
``"mean"`` (the mean of the N (+1) weights: an option for when the dense model is lost).

Layers are addressed by block index; the parameter dicts use the
``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` layout (``blocks/{i}/ffn/...``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["Decomposed", "moe_layers", "bases_from_dense", "decompose", "recompose",
           "expert_cosines", "WEIGHTS"]

WEIGHTS = ("w_gate", "w_up", "w_down")


class Decomposed(NamedTuple):
    """``base[i][w]`` ``[d_in, d_out]``; ``deltas[i][w]`` ``[n, d_in, d_out]`` (n = N, or
    N + 1 with the universal FFN last when ``extended``); ``rest``: every other parameter
    (the decomposed expert / universal weights removed); ``extended``."""

    base: dict
    deltas: dict
    rest: dict
    extended: bool


def _blocks(params: dict) -> dict:
    return params["blocks"]


def moe_layers(params: dict) -> list:
    """Block keys whose ``ffn`` holds stacked ``experts/w_up`` (vanilla MoE layers)."""
    return [i for i, b in _blocks(params).items()
            if "experts" in b.get("ffn", {}) and "w_up" in b["ffn"]["experts"]]


def _stack(ffn: dict, extended: bool) -> dict:
    out = {}
    for w in WEIGHTS:
        if w not in ffn["experts"]:
            continue
        e = np.asarray(jax.device_get(ffn["experts"][w]))
        if extended:
            if "universal" not in ffn:
                raise ValueError("decompose(extended=True): layer has no universal FFN; "
                                 "use extended=False")
            e = np.concatenate([e, np.asarray(jax.device_get(ffn["universal"][w]))[None]], 0)
        out[w] = e
    return out


def bases_from_dense(dense_params: dict, layers, scale_down: float = 1.0) -> dict:
    """``{i: {w: W_dense}}`` for the given layers, ``w_down`` times ``scale_down`` (use
    :func:`moejax.upcycle.output_scale` of the rule the MoE was upcycled with)."""
    out = {}
    for i in layers:
        ffn = _blocks(dense_params)[i]["ffn"]
        out[i] = {w: np.asarray(jax.device_get(ffn[w])) * (scale_down if w == "w_down" else 1.0)
                  for w in WEIGHTS if w in ffn}
    return out


def decompose(moe_params: dict, base: dict | str, *, extended: bool = False) -> Decomposed:
    """``Delta_i = W_i - W_base`` for every vanilla MoE layer of ``moe_params`` (pure).
    ``base``: ``bases_from_dense(...)`` (the paper: the dense FFN) or ``"mean"``."""
    layers = moe_layers(moe_params)
    if not layers:
        raise ValueError("decompose: no vanilla MoE layer (blocks/{i}/ffn/experts/w_up) found")
    rest = jax.tree.map(lambda x: x, moe_params)
    bases, deltas = {}, {}
    for i in layers:
        ffn = _blocks(rest)[i]["ffn"]
        stack = _stack(ffn, extended)
        if isinstance(base, str):
            if base != "mean":
                raise ValueError(f"decompose: base={base!r}; pass a dict or 'mean'")
            b = {w: s.mean(0) for w, s in stack.items()}
        else:
            if i not in base:
                raise ValueError(f"decompose: no base weights for layer {i} (have "
                                 f"{sorted(base)}); see bases_from_dense")
            b = {w: np.asarray(base[i][w]) for w in stack}
        bases[i] = b
        deltas[i] = {w: (s - b[w][None]).astype(s.dtype) for w, s in stack.items()}
        del ffn["experts"]
        if extended:
            del ffn["universal"]
    return Decomposed(bases, deltas, rest, extended)


def recompose(dec: Decomposed, deltas: dict | None = None) -> dict:
    """Inverse of :func:`decompose`: ``W_i = W_base + Delta_i`` written back into the
    parameter dict (``deltas`` overrides ``dec.deltas``, e.g. decompressed ones)."""
    deltas = dec.deltas if deltas is None else deltas
    out = jax.tree.map(lambda x: x, dec.rest)
    for i, b in dec.base.items():
        ffn = _blocks(out)[i]["ffn"]
        full = {w: (b[w][None] + np.asarray(deltas[i][w])).astype(b[w].dtype) for w in b}
        n_exp = next(iter(full.values())).shape[0] - (1 if dec.extended else 0)
        ffn["experts"] = {w: f[:n_exp] for w, f in full.items()}
        if dec.extended:
            ffn["universal"] = {w: f[n_exp] for w, f in full.items()}
    return out


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def expert_cosines(moe_params: dict, base: dict, *, extended: bool = False) -> dict[Any, dict]:
    """Per MoE layer: ``to_base [n]`` = cos(W_i, W_base) and ``pairwise [n, n]`` =
    cos(W_i, W_j), each W the concatenation of the flattened ``w_*`` matrices (float64)."""
    out = {}
    for i in moe_layers(moe_params):
        stack = _stack(_blocks(moe_params)[i]["ffn"], extended)
        flat = np.concatenate([s.reshape(s.shape[0], -1) for s in stack.values()], 1)
        flat = flat.astype(np.float64)
        b = np.concatenate([np.asarray(base[i][w]).reshape(-1) for w in stack]).astype(
            np.float64)
        n = flat.shape[0]
        out[i] = {"to_base": np.array([_cos(flat[j], b) for j in range(n)]),
                  "pairwise": np.array([[_cos(flat[j], flat[k]) for k in range(n)]
                                        for j in range(n)])}
    return out
