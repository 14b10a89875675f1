"""Batched on-policy sampling from a :class:`~moejax.nn.decoder.DecoderLM`, jitted end to end.

``sample(model, prompts_BT, prompt_lens_B, max_new_tokens, key=..., temperature=1.0,
top_p=1.0, eos_id=...)`` returns a :class:`Sampled` batch: ``tokens_BS`` (``S = T +
max_new_tokens``) holds each row's prompt (its first ``prompt_lens_B[b]`` entries of
``prompts_BT``, which may be right-padded with anything) followed directly by its response,
then ``pad_id``; ``response_mask_BS`` marks the generated tokens (up to and including EOS).

Prompts of different lengths use per-row cache positions, not padding tokens: one prefill over
the padded ``[B, T]`` block, after which each row's cache length is set to its own prompt
length, so row ``b``'s first new token is written at position ``prompt_lens_B[b]`` (over the
padding) and attends to its real prompt only (the decode mask admits cache slots ``<=`` the
current one; stale padding slots beyond are overwritten before they become visible).

The padding after a prompt, and a finished row's ``pad_id`` tokens, are masked out of the FFN
slots (``DecoderLM.decode``'s ``mask_BT``): under a top-k MoE with ``dispatch="capacity"``
they take no slot of an expert's capacity, so what one row's padding holds changes no other
row's tokens.

Token selection: ``temperature == 0`` is greedy; otherwise nucleus (top-p) sampling from
``softmax(logits / temperature)``: the smallest set of most probable tokens whose mass reaches
``top_p`` (``top_p = 1``: the full distribution). The decode loop is a ``lax.while_loop`` that
stops when every row has emitted ``eos_id`` or after ``max_new_tokens`` steps; the step key is
``fold_in(key, step)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.capture import record_decode
from moejax.config import check_count, is_integer
from moejax.nn.auto_axes import run_for_mesh
from moejax.nn.decoder import join_lengths, split_lengths
from moejax.nn.generate import check_decode_inputs, host_or_device
from moejax.nn.lean_decode import lean_decoder
from moejax.xla_flags import call_compiled

__all__ = ["Sampled", "sample", "sampler", "sample_traced", "top_p_filter", "select_next"]


class Sampled(NamedTuple):
    tokens_BS: jax.Array  # int32 prompt + response + padding
    response_mask_BS: jax.Array  # bool: generated tokens (EOS included)
    lengths_B: jax.Array  # int32 prompt + response length per row


def top_p_filter(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """``logits`` with every token outside the nucleus set to ``-inf``: a token is kept when
    the probability mass of the strictly more probable tokens is below ``top_p`` (so the most
    probable token is always kept; ties broken by index)."""
    if top_p >= 1.0:
        return logits_BV
    probs = jax.nn.softmax(logits_BV, axis=-1)
    order_BV = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(probs, order_BV, axis=-1)
    before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    keep_sorted_BV = before_BV < top_p
    keep_BV = jnp.zeros_like(keep_sorted_BV).at[
        jnp.arange(logits_BV.shape[0])[:, None], order_BV].set(keep_sorted_BV)
    return jnp.where(keep_BV, logits_BV, -jnp.inf)


def select_next(logits_BV: jax.Array, key: jax.Array, *, temperature: float,
                top_p: float) -> jax.Array:
    """Greedy (``temperature == 0``) or temperature + nucleus sampling -> ``[B]`` int32."""
    logits = logits_BV.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = top_p_filter(logits / temperature, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_traced(model, prompts_BT, prompt_lens_B, key, *, max_new: int,
                  temperature: float = 1.0, top_p: float = 1.0, eos_id: int | None = None,
                  pad_id: int = 0) -> Sampled:
    """:func:`sample` without argument checks, for use inside a traced function (a training
    step's loss); the caller guarantees what :func:`sample` checks."""
    B, T = prompts_BT.shape
    S = T + max_new
    model = lean_decoder(model)  # its fused weights made once, before the loop
    cache = model.init_cache(B, S)
    in_prompt_BS = jnp.arange(S, dtype=jnp.int32)[None] < prompt_lens_B[:, None]
    # the padding after each prompt is no token: it takes no MoE capacity (DecoderLM.decode)
    logits_BTV, cache = model.decode(prompts_BT, cache, mask_BT=in_prompt_BS[:, :T])
    kv, _ = split_lengths(cache)  # the loop carries one lengths array for every layer
    last_BV = jnp.take_along_axis(logits_BTV, (prompt_lens_B - 1)[:, None, None], axis=1)[:, 0]
    # prompt tokens in place, everything after the prompt = pad
    prompt_S = jnp.pad(prompts_BT, ((0, 0), (0, max_new)))
    tokens_BS = jnp.where(in_prompt_BS, prompt_S, pad_id)
    resp_BS = jnp.zeros((B, S), bool)
    rows_B = jnp.arange(B)

    def cond(carry):
        i, _, _, _, _, done_B = carry
        return (i < max_new) & ~jnp.all(done_B)

    def body(carry):
        i, logits_BV, (kv, lens_B), tokens_BS, resp_BS, done_B = carry
        tok_B = select_next(logits_BV, jax.random.fold_in(key, i), temperature=temperature,
                            top_p=top_p)
        tok_B = jnp.where(done_B, pad_id, tok_B)
        pos_B = prompt_lens_B + i
        tokens_BS = tokens_BS.at[rows_B, pos_B].set(tok_B)
        resp_BS = resp_BS.at[rows_B, pos_B].set(~done_B)
        if eos_id is not None:
            done_B = done_B | (tok_B == eos_id)
        logits_B1V, cache = model.decode(tok_B[:, None], join_lengths(kv, lens_B),
                                         mask_BT=~done_B[:, None])  # a finished row's pad
        return i + 1, logits_B1V[:, 0], split_lengths(cache), tokens_BS, resp_BS, done_B

    init = (jnp.int32(0), last_BV, (kv, prompt_lens_B), tokens_BS, resp_BS,
            jnp.zeros((B,), bool))
    if eos_id is None:  # the count is known: a fixed-trip loop, no data-dependent stop
        _, _, _, tokens_BS, resp_BS, _ = jax.lax.fori_loop(0, max_new, lambda _, c: body(c),
                                                            init)
    else:
        _, _, _, tokens_BS, resp_BS, _ = jax.lax.while_loop(cond, body, init)
    lengths_B = prompt_lens_B + resp_BS.sum(-1).astype(jnp.int32)
    return Sampled(tokens_BS, resp_BS, lengths_B)


@partial(jax.jit, static_argnames=("graphdef", "max_new", "temperature", "top_p", "eos_id",
                                   "pad_id"))
def _sample(graphdef, state, prompts_BT, prompt_lens_B, key, **kw):
    """The sampling program (under a mesh of explicit axes, with them automatic)."""
    return run_for_mesh(lambda prompts_BT, state, prompt_lens_B, key: sample_traced(
        nnx.merge(graphdef, state), prompts_BT, prompt_lens_B, key, **kw),
        prompts_BT, state, prompt_lens_B, key)


def sampler(model, max_new_tokens: int, *, temperature: float = 1.0, top_p: float = 1.0,
            eos_id: int | None = None, pad_id: int = 0,
            compiler_options: dict | None = None) -> Callable[..., Sampled]:
    """``draw(prompts_BT, prompt_lens_B, *, key) -> Sampled``: :func:`sample` with this model
    and these settings, the model split once (as a server holds it): a call pays the jitted
    loop and nothing per module. The split state holds the model's variables, so a call
    samples their values at that time (``param[...] = x`` and ``nnx.update`` are seen); a
    variable or submodule replaced by a new object is not (make a new sampler). Prompts and
    their lengths given as numpy are checked on the host, with no device round trip.
    ``draw.lower(prompts_BT, prompt_lens_B, key=...)``: the loop lowered for those arguments,
    not run (its compiled memory can be checked first; a later call reuses the compilation).
    ``compiler_options``: XLA compile options of the loop (e.g.
    :data:`moejax.xla_flags.COMMAND_BUFFERS`; pass those :func:`moejax.xla_flags.
    known_options` keeps), compiled with them once per prompt shape."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 "
                         "(0 = greedy)")
    vocab_size = model.cfg.vocab_size
    if not is_integer(pad_id):
        raise ValueError(f"pad_id={pad_id!r} must be an integer token id")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id={pad_id} lies outside the vocabulary [0, {vocab_size}): "
                         "the sampled rows must stay token ids the model can read back")
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    max_seq_len = model.cfg.max_seq_len
    graphdef, state = nnx.split(model)
    compiled: dict = {}  # with compiler_options: the loop compiled per prompt shape
    static = dict(max_new=int(max_new_tokens), temperature=float(temperature),
                  top_p=float(top_p), eos_id=eos_id, pad_id=int(pad_id))

    def checked(prompts_BT, prompt_lens_B, key: jax.Array) -> tuple:
        prompts_BT = host_or_device(prompts_BT)
        if prompts_BT.ndim != 2:
            raise ValueError(f"prompts_BT of shape {prompts_BT.shape}: give [B, T] token ids")
        B, T = prompts_BT.shape
        lens_host = np.asarray(prompt_lens_B)
        if lens_host.shape != (B,) or not np.issubdtype(lens_host.dtype, np.integer):
            raise ValueError(f"prompt_lens_B of shape {lens_host.shape} and dtype "
                             f"{lens_host.dtype}; expected ({B},) integer lengths")
        if T + max_new_tokens > max_seq_len:
            raise ValueError(f"prompt block ({T}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={max_seq_len}; shorten the prompts or the "
                             "responses")
        lo, hi = int(lens_host.min()), int(lens_host.max())
        if lo < 1 or hi > T:
            raise ValueError(f"prompt lengths must lie in [1, {T}], got [{lo}, {hi}]")
        check_decode_inputs(prompts_BT, vocab_size, temperature, eos_id=eos_id,
                            lens_B=lens_host)
        prompts_BT = jnp.asarray(prompts_BT, jnp.int32)
        return graphdef, state, prompts_BT, jnp.asarray(lens_host, jnp.int32), key

    def draw(prompts_BT, prompt_lens_B, *, key: jax.Array) -> Sampled:
        args = checked(prompts_BT, prompt_lens_B, key)
        record_decode("sample", _sample, args, static)
        return call_compiled(_sample, args, static, (1, 2, 3, 4), compiler_options or {},
                             compiled)

    # the jitted loop lowered for these arguments (e.g. to check its memory before a call)
    draw.lower = lambda prompts_BT, prompt_lens_B, *, key: _sample.lower(
        *checked(prompts_BT, prompt_lens_B, key), **static)
    return draw


def sample(model, prompts_BT, prompt_lens_B, max_new_tokens: int, *, key: jax.Array,
           temperature: float = 1.0, top_p: float = 1.0, eos_id: int | None = None,
           pad_id: int = 0) -> Sampled:
    """Sample up to ``max_new_tokens`` after each row's prompt (see the module docstring).
    ``prompt_lens_B`` (each in ``[1, T]``) says how many leading tokens of each row of
    ``prompts_BT`` are the prompt. One compilation per (model structure, shapes, settings).
    Sampling many batches with one model: :func:`sampler` splits it once."""
    return sampler(model, max_new_tokens, temperature=temperature, top_p=top_p, eos_id=eos_id,
                   pad_id=pad_id)(prompts_BT, prompt_lens_B, key=key)
