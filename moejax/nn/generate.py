"""Autoregressive generation for :class:`moejax.nn.decoder.DecoderLM` with a KV cache.

One jitted prefill over the prompt, then one jitted decode step per new token (same shapes
every step, so it is traced once per (model structure, batch, cache length)); each step takes
the cache donated, so its new tokens are written into the same buffers, not a copy. Greedy when
``temperature == 0``; otherwise samples from ``softmax(logits / temperature)`` (optionally
restricted to the ``top_k`` largest logits) with ``fold_in(key, step)`` as the step's key.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.capture import record_decode
from moejax.config import check_count, is_integer
from moejax.nn.auto_axes import like_batch
from moejax.nn.lean_decode import lean_decoder

__all__ = ["generate", "select_token", "check_decode_inputs", "host_or_device"]


def check_decode_inputs(prompt_BT, vocab_size: int, temperature: float, *,
                        eos_id: int | None = None, lens_B=None) -> None:
    """Refuse, naming the argument, what a decoding would turn into garbage: an empty
    prompt, token ids outside ``[0, vocab_size)`` (a concrete prompt: each row's first
    ``lens_B[b]`` ids where the rows are padded blocks), ids that are not integers (a cast
    would truncate them to other tokens), an ``eos_id`` that is not an integer id in the
    vocabulary (it could never be emitted), a temperature that is not a finite number >= 0."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 "
                         "(0 = greedy)")
    if eos_id is not None and not is_integer(eos_id):
        raise ValueError(f"eos_id={eos_id!r} must be an integer token id (the tokenizer's "
                         "eos id)")
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id={eos_id} lies outside the vocabulary [0, {vocab_size}): "
                         "the model could never emit it; give the tokenizer's eos id")
    if prompt_BT.ndim != 2:
        raise ValueError(f"prompt_BT of shape {prompt_BT.shape}: give [B, T] token ids, a "
                         "row per prompt (prompt[None] for one)")
    if prompt_BT.shape[1] < 1:
        raise ValueError(f"prompt_BT of shape {prompt_BT.shape}: give T >= 1 token ids per "
                         "row (an empty prompt has nothing to continue)")
    if not jnp.issubdtype(prompt_BT.dtype, jnp.integer):
        raise ValueError(f"prompt_BT of dtype {prompt_BT.dtype}: give integer token ids (a "
                         "cast would truncate each value to another token)")
    if not isinstance(prompt_BT, jax.core.Tracer) and prompt_BT.size:
        ids = np.asarray(prompt_BT)
        if lens_B is not None:  # the prompt of each row, not the padding after it
            ids = ids[np.arange(ids.shape[1])[None, :] < np.asarray(lens_B)[:, None]]
        lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt_BT holds token ids in [{lo}, {hi}], outside the "
                             f"vocabulary [0, {vocab_size}); encode it with the model's "
                             "tokenizer")


def host_or_device(x):
    """``x`` as an array where it is: a jax array as it is, anything else (a list, numpy) on
    the host, so its checks need no device round trip and see its own dtype."""
    return x if isinstance(x, jax.Array) else np.asarray(x)


def select_token(logits_BV: jax.Array, key: jax.Array | None, *, temperature: float,
                 top_k: int | None) -> jax.Array:
    """Greedy argmax (``temperature == 0``) or temperature / top-k sampling -> ``[B]`` int32."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV.astype(jnp.float32) / temperature
    if top_k is not None:
        kth_B1 = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_B1, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _prefill(graphdef, state, prompt_BT, cache):
    model = nnx.merge(graphdef, state)
    logits_BTV, cache = model.decode(prompt_BT, cache)
    return logits_BTV[:, -1], cache


@partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _decode_one(graphdef, state, token_B, cache, live_B):
    model = nnx.merge(graphdef, state)
    # a finished row's eos filler is no token: it takes no MoE capacity (DecoderLM.decode)
    logits_B1V, cache = model.decode(token_B[:, None], cache, mask_BT=live_B[:, None])
    return logits_B1V[:, 0], cache


@partial(jax.jit, static_argnames=("temperature", "top_k"))
def _select(logits_BV, key, step, *, temperature, top_k):
    step_key = None if key is None else jax.random.fold_in(key, step)
    return select_token(logits_BV, step_key, temperature=temperature, top_k=top_k)


def generate(model, prompt_BT: jax.Array, max_new_tokens: int, *, key: jax.Array | None = None,
             temperature: float = 0.0, top_k: int | None = None,
             eos_id: int | None = None) -> jax.Array:
    """Return ``[B, T + max_new_tokens]`` int32: the prompt followed by generated tokens.

    After a row emits ``eos_id`` its remaining positions are filled with ``eos_id``; the loop
    stops early once every row has finished. All prompt rows share one length ``T``.
    """
    temperature = float(temperature)
    check_decode_inputs(host_or_device(prompt_BT), model.cfg.vocab_size, temperature,
                        eos_id=eos_id)
    prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 0)  # 0: the prompt back
    B, T = prompt_BT.shape
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs an explicit key=jax.random.key(...)")
    if top_k is not None and not (is_integer(top_k) and 0 < top_k <= model.cfg.vocab_size):
        raise ValueError(f"top_k={top_k!r} must be an integer in [1, vocab_size="
                         f"{model.cfg.vocab_size}] (or None: the whole vocabulary)")
    total = T + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"max_seq_len={model.cfg.max_seq_len}; shorten or raise max_seq_len")
    if max_new_tokens <= 0:
        return prompt_BT
    model = lean_decoder(model)  # its fused weights made once, for every token's step
    graphdef, state = nnx.split(model)
    cache = like_batch(model.init_cache(B, total), prompt_BT)  # as the steps return it
    record_decode("generate (one token)", _decode_one,
                  (graphdef, state, jnp.zeros((B,), jnp.int32), cache, jnp.ones((B,), bool)),
                  {})
    logits_BV, cache = _prefill(graphdef, state, prompt_BT, cache)
    out = []
    done_B = jnp.zeros((B,), bool)
    for i in range(max_new_tokens):
        tok_B = _select(logits_BV, key, jnp.int32(i), temperature=temperature, top_k=top_k)
        if eos_id is not None:
            tok_B = jnp.where(done_B, eos_id, tok_B)
            done_B = done_B | (tok_B == eos_id)
        out.append(tok_B)
        if i == max_new_tokens - 1 or (eos_id is not None and bool(done_B.all())):
            break
        logits_BV, cache = _decode_one(graphdef, state, tok_B, cache, ~done_B)
    new_BN = jnp.stack(out, axis=1)
    if new_BN.shape[1] < max_new_tokens:
        pad = jnp.full((B, max_new_tokens - new_BN.shape[1]), eos_id, jnp.int32)
        new_BN = jnp.concatenate([new_BN, pad], axis=1)
    return jnp.concatenate([prompt_BT, new_BN], axis=1)
