"""Speculative decoding for :class:`moejax.nn.decoder.DecoderLM`: a small draft model proposes
``n`` tokens as a chain, the target verifies them in ONE forward pass over ``n + 1`` tokens,
and rejected positions are rolled back from both KV caches.

One round, per row (batched rows advance independently)::
    draft:   feed [s, t], then d_1, ..., d_{n-1} (n passes)  -> d_1..d_n ~ q_0..q_{n-1}
    target:  decode [t, d_1, ..., d_n] in one pass          -> p_0..p_n
    accept:  greedy  d_i kept while d_i = argmax p_{i-1};  x = argmax p_a
             sampled d_i kept with prob min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); at the first
                     rejection x ~ norm(max(0, p_a - q_a)), after n acceptances x ~ p_n
    commit:  d_1..d_a and x (a + 1 tokens); caches rolled back to the committed prefix
             (:func:`rollback`: lengths set, stale slots are masked and later overwritten;
             the loop carries one lengths array per model, :func:`~moejax.nn.decoder.
             split_lengths`, so the rollback sets that array)

``t`` is the last committed token, in neither cache; ``s`` is the committed token before it,
which the draft's cache leaves out, so each round's first draft pass takes the two tokens
``[s, t]``. After ``n`` acceptances the draft has never seen ``d_n``, which is then the next
``s``; otherwise ``s``'s key and value are written again where they already were. So a draft
of ``n`` tokens costs ``n`` draft passes, not ``n + 1`` (a pass of a small model costs about
the same for two tokens as for one). A one-token prompt gets its first new token from one
target step. Greedy output equals greedy autoregressive decoding token for token; sampled
output has exactly the target's distribution (the standard rejection rule; Leviathan et al.
2023, Chen et al. 2023). Sampling uses ``softmax(logits / temperature)`` for both models.

The whole loop is one jitted ``lax.while_loop`` (no Python per token), with a round's draft
passes unrolled in its body: one loop trip per round, which a GPU ends by reading one flag back
to the host. Chunk-sparse verification is a property of the target: give it BlockFFN slots
with ``path="auto"`` (the jnp chunk-union loop on the CPU, the Pallas kernels on GPU and TPU)
and ``union_chunk = n + 1`` (:func:`chunk_sparse_target`), so the verification pass computes
only the union of the experts the ``n + 1`` tokens activate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.capture import record_decode
from moejax.config import check_count
from moejax.nn.auto_axes import run_for_mesh
from moejax.nn.blockffn import BlockFFN
from moejax.nn.decoder import join_lengths, split_lengths
from moejax.nn.generate import check_decode_inputs, host_or_device
from moejax.nn.lean_decode import lean_decoder
from moejax.nn.surgery import with_slot_config
from moejax.xla_flags import call_compiled

__all__ = ["SpecOutput", "speculative_generate", "speculative_decoder", "cache_len", "rollback",
           "chunk_sparse_target", "accept_greedy", "accept_sampled"]


class SpecOutput(NamedTuple):
    tokens_BS: jax.Array  # int32 [B, T + max_new_tokens]: prompt + generated
    accepted_B: jax.Array  # int32: draft tokens accepted per row
    rounds_B: jax.Array  # int32: verification passes per row
    accept_hist_N: jax.Array  # int32 [n + 1]: how often a = 0..n draft tokens were accepted

    @property
    def mean_accepted_length(self) -> jax.Array:
        """Tokens committed per target pass (accepted drafts + the target's own token)."""
        return jnp.sum(self.accepted_B + self.rounds_B) / jnp.maximum(jnp.sum(self.rounds_B), 1)


def rollback(cache: tuple, lengths_B: jax.Array) -> tuple:
    """The decoder cache truncated to ``lengths_B`` tokens per row: slots past a row's length
    are never attended to (the decode mask admits slots ``<=`` the current one) and are
    overwritten by the next write."""
    return tuple(c._replace(lengths_B=lengths_B.astype(jnp.int32)) for c in cache)


def chunk_sparse_target(model: nnx.Module, draft_len: int) -> nnx.Module:
    """A copy of a BlockFFN ``model`` whose FFNs verify ``draft_len + 1`` tokens through the
    chunk-union path of each platform (one tile per row, exact: the union cap stays
    ``n_experts``)."""
    return with_slot_config(model, BlockFFN, path="auto", union_chunk=draft_len + 1,
                            max_union=None)


def accept_greedy(drafts_BN, target_logits_BNV):
    """``(a_B, x_B)``: leading drafts equal to the target's argmax and the target's token."""
    tgt_BN = jnp.argmax(target_logits_BNV, axis=-1).astype(jnp.int32)
    n = drafts_BN.shape[1]
    a_B = jnp.sum(jnp.cumprod(drafts_BN == tgt_BN[:, :n], axis=1), axis=1).astype(jnp.int32)
    return a_B, jnp.take_along_axis(tgt_BN, a_B[:, None], axis=1)[:, 0]


def accept_sampled(key, drafts_BN, draft_logits_BNV, target_logits_BNV, temperature: float):
    """``(a_B, x_B)`` by the rejection rule (module docstring); ``target_logits`` has ``n + 1``
    positions, ``draft_logits`` ``n``."""
    k_u, k_x = jax.random.split(key)
    n = drafts_BN.shape[1]
    p = jax.nn.softmax(target_logits_BNV.astype(jnp.float32) / temperature, axis=-1)
    q = jax.nn.softmax(draft_logits_BNV.astype(jnp.float32) / temperature, axis=-1)
    p_d = jnp.take_along_axis(p[:, :n], drafts_BN[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts_BN[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, p_d.shape)
    ok = u * q_d < p_d  # u < p/q without dividing by q
    a_B = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, a_B[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # after n accepts: p_n
    q_a = jnp.take_along_axis(q_pad, a_B[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_a - q_a, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_a)
    x_B = jax.random.categorical(k_x, jnp.log(resid), axis=-1).astype(jnp.int32)
    return a_B, x_B


def _pick(logits_BV, key, temperature):
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BV.astype(jnp.float32) / temperature,
                                  axis=-1).astype(jnp.int32)


def cache_len(prompt_len: int, max_new_tokens: int, draft_len: int) -> int:
    """The KV-cache slots a speculative decoding takes: the prompt, the new tokens and two
    rounds' drafts and corrections past them (a round writes before it rolls back)."""
    return prompt_len + max_new_tokens + 2 * (draft_len + 1)


@partial(jax.jit, static_argnums=(0, 2), static_argnames=("max_new", "n", "temperature"))
def _speculate(tg, ts, dg, ds, prompt_BT, key, **static):
    """The decoding program (under a mesh of explicit axes, with them automatic)."""
    return run_for_mesh(lambda prompt_BT, ts, ds, key: _speculate_loop(
        tg, ts, dg, ds, prompt_BT, key, **static), prompt_BT, ts, ds, key)


def _speculate_loop(tg, ts, dg, ds, prompt_BT, key, *, max_new, n, temperature):
    # the fused weights of each made once, before the loop
    target, draft = lean_decoder(nnx.merge(tg, ts)), lean_decoder(nnx.merge(dg, ds))
    B, T = prompt_BT.shape
    size = cache_len(T, max_new, n)
    tcache, dcache = target.init_cache(B, size), draft.init_cache(B, size)
    n_out = max_new + n + 1
    k_first, key = jax.random.split(key)
    out = jnp.zeros((B, n_out), jnp.int32)
    if T > 1:  # target: all but the last token; draft: all but the last two
        _, tcache = target.decode(prompt_BT[:, :-1], tcache)
        if T > 2:
            _, dcache = draft.decode(prompt_BT[:, :-2], dcache)
        prev, last, out_len = prompt_BT[:, -2], prompt_BT[:, -1], jnp.zeros((B,), jnp.int32)
    else:  # one target step gives the first new token, which the loop then extends
        logits, tcache = target.decode(prompt_BT, tcache)
        prev, last = prompt_BT[:, 0], _pick(logits[:, 0], k_first, temperature)
        out, out_len = out.at[:, 0].set(last), jnp.ones((B,), jnp.int32)

    def active(st):
        return st["out_len"] < max_new

    def body(st):
        k = jax.random.fold_in(key, st["round"])
        k_draft, k_acc = jax.random.split(k)
        act_B = active(st)
        base_B = st["tcache"][1]

        def draft_step(carry, i):
            tok_B, kv = carry
            logits, cache = draft.decode(tok_B[:, None], join_lengths(*kv))
            nxt = _pick(logits[:, 0], jax.random.fold_in(k_draft, i), temperature)
            return (nxt, split_lengths(cache)), (nxt, logits[:, 0])

        pair_B2 = jnp.stack([st["prev"], st["last"]], axis=1)
        logits, dcache = draft.decode(pair_B2, join_lengths(*st["dcache"]))
        d1_B = _pick(logits[:, 1], jax.random.fold_in(k_draft, 0), temperature)
        # unrolled: a loop here would be a second while loop per round, whose trip the GPU
        # runtime ends by reading a flag back to the host each draft step
        (_, dkv), (d_NB, q_NBV) = jax.lax.scan(draft_step, (d1_B, split_lengths(dcache)),
                                               jnp.arange(1, n), unroll=True)
        drafts_BN = jnp.concatenate([d1_B[:, None], d_NB.T], axis=1)
        q_BNV = jnp.concatenate([logits[:, 1:], jnp.swapaxes(q_NBV, 0, 1)], axis=1)
        block = jnp.concatenate([st["last"][:, None], drafts_BN], axis=1)
        p_BNV, tcache = target.decode(block, join_lengths(*st["tcache"]))
        if temperature == 0.0:
            a_B, x_B = accept_greedy(drafts_BN, p_BNV)
        else:
            a_B, x_B = accept_sampled(k_acc, drafts_BN, q_BNV, p_BNV, temperature)
        i_N = jnp.arange(n + 1)
        vals_BN = jnp.where(i_N[None] < a_B[:, None], jnp.pad(drafts_BN, ((0, 0), (0, 1))),
                            x_B[:, None])
        keep_BN = (i_N[None] <= a_B[:, None]) & act_B[:, None]
        pos_BN = jnp.where(keep_BN, st["out_len"][:, None] + i_N[None], n_out)
        out = st["out"].at[jnp.arange(B)[:, None], pos_BN].set(vals_BN, mode="drop")
        new_len_B = jnp.where(act_B, base_B + 1 + a_B, base_B)
        # the committed token before x: t after no acceptance, else d_a
        prev_B = jnp.take_along_axis(block, a_B[:, None], axis=1)[:, 0]
        hist = st["hist"].at[a_B].add(act_B.astype(jnp.int32))
        return {"round": st["round"] + 1, "out": out,
                "out_len": st["out_len"] + jnp.where(act_B, a_B + 1, 0),
                "prev": jnp.where(act_B, prev_B, st["prev"]),
                "last": jnp.where(act_B, x_B, st["last"]),
                # rolled back: every layer's filled lengths, one array per model
                "tcache": (split_lengths(tcache)[0], new_len_B),
                "dcache": (dkv[0], new_len_B - 1),
                "accepted": st["accepted"] + jnp.where(act_B, a_B, 0),
                "rounds": st["rounds"] + act_B.astype(jnp.int32), "hist": hist}

    st = {"round": jnp.int32(0), "out": out, "out_len": out_len, "prev": prev, "last": last,
          "tcache": split_lengths(tcache), "dcache": split_lengths(dcache),
          "accepted": jnp.zeros((B,), jnp.int32),
          "rounds": jnp.zeros((B,), jnp.int32), "hist": jnp.zeros((n + 1,), jnp.int32)}
    st = jax.lax.while_loop(lambda s: jnp.any(active(s)), body, st)
    tokens = jnp.concatenate([prompt_BT, st["out"][:, :max_new]], axis=1)
    return SpecOutput(tokens, st["accepted"], st["rounds"], st["hist"])


def speculative_decoder(target: nnx.Module, draft: nnx.Module, max_new_tokens: int, *,
                        draft_len: int = 4, temperature: float = 0.0,
                        compiler_options: dict | None = None) -> Callable[..., SpecOutput]:
    """``decode(prompt_BT, key=None) -> SpecOutput``: :func:`speculative_generate` with these
    models and settings, the models split once (as a server holds them): a call pays the
    jitted loop and nothing per module. The split states hold the models' variables, so a
    call decodes their values at that time (``param[...] = x`` and ``nnx.update`` are seen); a
    variable or submodule replaced by a new object is not (make a new decoder).
    ``temperature == 0``: greedy (no key needed);
    otherwise each call takes an explicit ``key``. All prompt rows share one length; target
    and draft must share the vocabulary. ``decode.lower(prompt_BT, key=None)``: the loop
    lowered for those arguments, not run (a later call reuses its compilation).
    ``compiler_options``: XLA compile options of the loop, as :func:`moejax.nn.sample.
    sampler` takes them."""
    temperature = float(temperature)
    draft_len = check_count("draft_len", draft_len, 1)
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature}: use 0 (greedy) or a finite number > 0 "
                         "with an explicit key=jax.random.key(...)")
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        raise ValueError(f"target vocab {target.cfg.vocab_size} != draft vocab "
                         f"{draft.cfg.vocab_size}: speculation needs one tokenizer")
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(draft)
    cfgs = (("target", target.cfg), ("draft", draft.cfg))
    static = dict(max_new=int(max_new_tokens), n=int(draft_len), temperature=temperature)
    greedy_key = jax.random.key(0)  # greedy decoding draws nothing; the loop takes a key
    compiled: dict = {}  # with compiler_options: the loop compiled per prompt shape

    def checked(prompt_BT, key: jax.Array | None) -> tuple:
        prompt_BT = host_or_device(prompt_BT)
        check_decode_inputs(prompt_BT, target.cfg.vocab_size, temperature)
        prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
        T = prompt_BT.shape[1]
        if temperature > 0 and key is None:
            raise ValueError(f"temperature={temperature}: sampling needs an explicit "
                             "key=jax.random.key(...)")
        size = cache_len(T, max_new_tokens, draft_len)
        for name, cfg in cfgs:
            if size > cfg.max_seq_len:
                raise ValueError(f"{name}: prompt {T} + {max_new_tokens} new tokens + 2 x "
                                 f"(draft_len + 1) = {size} exceeds max_seq_len="
                                 f"{cfg.max_seq_len}")
        return tg, ts, dg, ds, prompt_BT, greedy_key if key is None else key

    def decode(prompt_BT, key: jax.Array | None = None) -> SpecOutput:
        args = checked(prompt_BT, key)
        record_decode(f"speculative n={draft_len}", _speculate, args, static)
        return call_compiled(_speculate, args, static, (1, 3, 4, 5), compiler_options or {},
                             compiled)

    # the jitted loop lowered for these arguments (e.g. to check its memory before a call)
    decode.lower = lambda prompt_BT, key=None: _speculate.lower(*checked(prompt_BT, key),
                                                                **static)
    return decode


def speculative_generate(target: nnx.Module, draft: nnx.Module, prompt_BT, max_new_tokens: int,
                         *, draft_len: int = 4, key: jax.Array | None = None,
                         temperature: float = 0.0) -> SpecOutput:
    """Generate ``max_new_tokens`` per row (module docstring). ``temperature == 0``: greedy
    (no key needed); otherwise sampling with an explicit ``key``. All prompt rows share one
    length; target and draft must share the vocabulary. Decoding many prompts with the same
    models: :func:`speculative_decoder` splits them once."""
    return speculative_decoder(target, draft, max_new_tokens, draft_len=draft_len,
                               temperature=temperature)(prompt_BT, key)
