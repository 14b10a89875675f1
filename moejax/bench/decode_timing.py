"""What the speculative-decoding benchmark measures, as library functions (the study file
``experiments/blockffn/speculative.py`` is its recipe).

* :func:`grow_blockffn_lm`: a >= 100M-parameter BlockFFN decoder that predicts exactly what a
  trained small one predicts: the trained blocks, then ``extra_layers`` BlockFFN blocks whose
  attention and expert output projections are zero (they add nothing to the residual stream
  but cost their full compute and memory traffic), with routers tiled from the trained last
  router (expert ``e`` follows trained expert ``e mod E``, so the union of the active experts in
  a chunk follows the trained model's locality). The extra routers see the final residual
  stream, not the trained router's input; with ``target_tls`` and calibration tokens their
  columns are shifted along the mean direction ``m`` of that stream, ``W - beta m 1^T``, with
  ``beta`` bisected so the extra layers' TLS on the calibration tokens matches.
* :func:`decode_timing`: tokens/s of batch-1 greedy decoding, autoregressive (the jitted
  sampling loop) or speculative, over several prompts after one untimed warm-up, the models
  split once before (a timed call is the jitted decoding, as a server runs it); with
  ``profile``, the device kernels per token and the fraction of the time the device is busy.
* :func:`matching_prefix`: how much of a decoding is the reference's, where 16-bit decoding
  lets a near-tie round the other way.
* :func:`spec_chunk_sparsity`: TLS and CLS of the target's routers over the generated text in
  chunks of ``draft_len + 1`` (the verified blocks).
* :func:`expert_routes`: what a model's BlockFFN layers compute a decode chunk with on the
  device at hand (a decode kernel, or a fallback where the kernel does not take the layer's
  shapes), so a timing says which code it timed.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.bench.profile import trace_kernels
from moejax.evaluate import SparsityEvaluator
from moejax.kernels.chunk_union.pallas import decode_route
from moejax.nn.block import run_blocks
from moejax.nn.blockffn import BlockFFN, BlockFFNConfig
from moejax.nn.decoder import DecoderLM
from moejax.nn.sample import sampler
from moejax.nn.speculative import speculative_decoder
from moejax.nn.surgery import build_from_pure, with_slot_config
from moejax.ops.activations import is_gated
from moejax.train.budget import lowered_fitting
from moejax.xla_flags import COMMAND_BUFFERS, known_options

__all__ = ["grow_blockffn_lm", "decode_timing", "spec_chunk_sparsity", "matching_prefix",
           "blockffn_path", "expert_routes"]


def blockffn_path(model: DecoderLM, path: str, union_chunk: int = 1) -> DecoderLM:
    """``model`` with every BlockFFN computing through ``path`` (``"dense"``, or an exact
    chunk-union path, ``"chunk_union"`` or ``"auto"``, with tiles of ``union_chunk`` tokens)."""
    return with_slot_config(model, BlockFFN, path=path, union_chunk=union_chunk, max_union=None)


def expert_routes(model: DecoderLM, n: int, dtype) -> str:
    """What ``model``'s BlockFFN layers compute an exact chunk of ``n`` tokens in ``dtype``
    with on the device at hand (:func:`moejax.kernels.chunk_union.pallas.decode_route`), e.g.
    ``"decode kernel (Mosaic GPU)"``, or ``"decode kernel (Mosaic GPU) in 2 layers; dense
    product, non-members weighted 0 in 12 layers"`` where the layers' shapes differ."""
    counts: dict[str, int] = {}
    for _, m in nnx.iter_modules(model):
        if isinstance(m, BlockFFN):
            w_up = m.experts.weights()[0]
            gate = (jax.ShapeDtypeStruct(w_up.shape, dtype) if is_gated(m.cfg.activation)
                    else None)
            route = decode_route(jax.ShapeDtypeStruct((n, m.d_model), dtype),
                                 jax.ShapeDtypeStruct(w_up.shape, dtype), gate)
            counts[route] = counts.get(route, 0) + 1
    if not counts:
        raise ValueError("expert_routes: the model has no BlockFFN layer")
    if len(counts) == 1:
        return next(iter(counts))
    return "; ".join(f"{route} in {k} layers" for route, k in counts.items())


def _router_inputs(small: DecoderLM, tokens_BT) -> np.ndarray:
    """``[N, D]`` RMS-normalised final residual stream of ``small`` (the extra routers' input)."""

    h, _ = run_blocks(small.blocks, small._embed(jnp.asarray(tokens_BT)), train=False)
    h = np.asarray(h, np.float64).reshape(-1, h.shape[-1])
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + small.cfg.norm_eps)


def _calibrated_router(router, x_ND, target_tls: float):
    m = x_ND.mean(0)
    m = m / max(np.linalg.norm(m), 1e-12)
    lo, hi = -50.0, 50.0
    for _ in range(60):  # inactive fraction grows with beta
        beta = (lo + hi) / 2
        tls = float(np.mean(x_ND @ (router - beta * m[:, None]) <= 0))
        lo, hi = (beta, hi) if tls < target_tls else (lo, beta)
    return router - (lo + hi) / 2 * m[:, None]


def grow_blockffn_lm(small: DecoderLM, *, extra_layers: int, n_experts: int, d_expert: int,
                     key: jax.Array, target_tls: float | None = None,
                     calib_tokens=None) -> DecoderLM:
    """See the module docstring. ``small`` must have BlockFFN slots; ``n_experts`` a multiple
    of its last layer's expert count; ``target_tls`` needs ``calib_tokens`` ``[B, T]``."""
    cfg = small.cfg
    last = cfg.ffn_slots[-1]
    if not isinstance(last, BlockFFNConfig) or n_experts % last.n_experts:
        raise ValueError("grow_blockffn_lm: the small model's last slot must be a BlockFFN "
                         f"whose n_experts divides n_experts={n_experts}")
    extra = last.replace(n_experts=n_experts, d_expert=d_expert)
    big_cfg = dataclasses.replace(cfg, n_layers=cfg.n_layers + extra_layers,
                                  ffn_slots=tuple(cfg.ffn_slots) + (extra,) * extra_layers)
    big = nnx.eval_shape(lambda: DecoderLM(big_cfg, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(nnx.state(big))
    small_pure = nnx.to_pure_dict(nnx.state(small))
    router = np.asarray(small_pure["blocks"][cfg.n_layers - 1]["ffn"]["router"]["w"])
    reps = n_experts // last.n_experts
    router = np.tile(router, (1, reps))
    if target_tls is not None:
        if calib_tokens is None:
            raise ValueError("grow_blockffn_lm(target_tls=...) needs calib_tokens")
        router = _calibrated_router(router, _router_inputs(small, calib_tokens), target_tls)

    def fill(path, leaf):
        names = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if names[0] == "blocks" and names[1] < cfg.n_layers:
            return jnp.asarray(_get(small_pure, names))
        if names[0] != "blocks":
            return jnp.asarray(_get(small_pure, names))
        name = names[-1]
        if name in ("w_o", "w_down"):  # zero residual contribution
            return jnp.zeros(leaf.shape, leaf.dtype)
        if names[-2] == "router":
            return jnp.asarray(router, leaf.dtype)
        if name == "scale":
            return jnp.ones(leaf.shape, leaf.dtype)
        k = jax.random.fold_in(key, zlib.crc32("/".join(map(str, names)).encode()) % (2**31))
        fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 1
        return (jax.random.normal(k, leaf.shape) / np.sqrt(fan_in)).astype(leaf.dtype)

    pure = jax.tree_util.tree_map_with_path(fill, pure)
    return build_from_pure(lambda: DecoderLM(big_cfg, rngs=nnx.Rngs(0)), pure)


def _get(tree, names):
    for n in names:
        tree = tree[n]
    return tree


def decode_timing(target, prompts, max_new_tokens: int, *, draft=None,
                  draft_len: int = 4, profile: bool = False, command_buffers: bool = False,
                  fix: str = "a smaller model or a shorter decoding (fewer prompt or new tokens)"
                  ) -> dict:
    """Greedy batch-1 decoding of each prompt row (autoregressive when ``draft`` is None):
    ``tokens_per_s`` over all timed prompts, each prompt's own wall time ``prompt_seconds``
    (what a comparison of two decodings pairs by prompt), the generated ``tokens``
    ``[P, T + new]`` and,
    for speculative runs, ``mean_accepted_length``. ``profile``: the first prompt decoded
    once more under the profiler (:func:`moejax.bench.profile.trace_kernels`) adds
    ``kernels_per_token`` (device kernels, copies and memsets a generated token costs) and
    ``device_busy`` (their summed device time over the prompt's measured wall time: well
    below 1, the decode waits on the host launching its many small kernels, not on the
    device), ``kernels`` (device seconds per generated token by kernel name, largest
    first) and ``kernel_counts`` (launches per generated token by kernel name); each None
    where the trace sees no device (a CPU); and ``program``, the compiled loop's optimised
    HLO text, which names every fusion the trace counts and the instructions fused into it
    (what a kernel per token is made of). The decoding loop is compiled and its memory
    checked against the device's before its first call
    (:class:`~moejax.train.budget.MemoryBudgetError`, naming ``fix``: what shrinks it).
    ``command_buffers``: the loop compiled with :data:`moejax.xla_flags.COMMAND_BUFFERS`
    where the running XLA knows them; ``command_buffers`` in the result says ``"on"``,
    ``"off"`` or which options this XLA refused (the loop then ran without them)."""
    prompts = jnp.asarray(prompts, jnp.int32)
    P, T = prompts.shape
    # the models split once, as a server holds them: a timed call is the jitted decoding
    options, refused = known_options(COMMAND_BUFFERS) if command_buffers else ({}, ())
    if draft is None:
        draw, lens, key = sampler(target, max_new_tokens, temperature=0.0,
                                  compiler_options=options), np.full((1,), T, np.int32), \
            jax.random.key(0)
    else:
        decode = speculative_decoder(target, draft, max_new_tokens, draft_len=draft_len,
                                     compiler_options=options)

    def one(row):
        if draft is None:
            return draw(row, lens, key=key).tokens_BS, None
        out = decode(row)
        return out.tokens_BS, out

    # compiled and checked against the device's memory before its first call (which reuses it)
    what = f"the {'speculative' if draft is not None else 'autoregressive'} decoding loop"
    compiled = lowered_fitting(draw.lower(prompts[:1], lens, key=key) if draft is None
                               else decode.lower(prompts[:1]), what=what, fix=fix)
    jax.block_until_ready(one(prompts[:1])[0])
    toks, outs, each, t0 = [], [], [], time.perf_counter()
    for i in range(P):
        t1 = time.perf_counter()
        tk, out = one(prompts[i:i + 1])
        jax.block_until_ready(tk)
        each.append(time.perf_counter() - t1)
        toks.append(np.asarray(tk)[0, :T + max_new_tokens])
        outs.append(out)
    seconds = time.perf_counter() - t0
    res = {"tokens_per_s": P * max_new_tokens / seconds, "seconds": seconds,
           "prompt_seconds": each, "tokens": np.stack(toks),
           "command_buffers": (f"off: unknown to this XLA ({', '.join(refused)})" if refused
                               else "on" if options else "off")}
    if draft is not None:
        acc = sum(int(jnp.sum(o.accepted_B)) for o in outs)
        rounds = sum(int(jnp.sum(o.rounds_B)) for o in outs)
        res["mean_accepted_length"] = (acc + rounds) / max(rounds, 1)
    if profile:
        trace = trace_kernels(lambda: one(prompts[:1])[0])
        res["kernels_per_token"] = None if trace is None else trace.launches / max_new_tokens
        res["device_busy"] = None if trace is None else trace.busy_s / (seconds / P)
        res["kernels"] = None if trace is None else {
            name: t / max_new_tokens for name, t in trace.by_name.items()}
        res["kernel_counts"] = None if trace is None or trace.counts is None else {
            name: c / max_new_tokens for name, c in trace.counts.items()}
        res["program"] = compiled.as_text()
    return res


def matching_prefix(tokens_PS, ref_PS, prompt_len: int) -> float:
    """The share of new tokens before the first that differs from ``ref``, over prompts."""
    new, ref = np.asarray(tokens_PS)[:, prompt_len:], np.asarray(ref_PS)[:, prompt_len:]
    same = np.cumprod(new == ref, axis=1)  # 1 until the first difference
    return float(same.mean())


def spec_chunk_sparsity(model, tokens, chunk_len: int) -> dict:
    """``{"tls", "cls"}``: mean over the BlockFFN layers of ``model`` on ``tokens`` ``[P, S]``
    (inputs ``tokens[:, :-1]``), CLS over chunks of ``chunk_len`` tokens."""
    toks = jnp.asarray(tokens, jnp.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "mask": jnp.ones(toks[:, 1:].shape, jnp.float32)}
    ev = SparsityEvaluator([batch], chunk_lens=(1, chunk_len))(model)
    return {"tls": ev["tls"], "cls": ev[f"cls_{chunk_len}"]}
