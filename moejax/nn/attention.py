"""Multi-head / grouped-query self-attention with optional RoPE and a functional KV cache.

Parameter paths of :class:`Attention` (plain ``[in, out]`` matrices; heads flattened
head-major, i.e. column ``h * J + k`` is head ``h``, dim ``k``):

* ``w_q`` ``[D, H*J]``, ``w_k`` ``[D, G*J]``, ``w_v`` ``[D, G*J]``, ``w_o`` ``[H*J, D]``
* with ``use_bias``: ``b_q`` ``[H*J]``, ``b_k`` ``[G*J]``, ``b_v`` ``[G*J]``, ``b_o`` ``[D]``;
  with ``qkv_bias``: ``b_q``, ``b_k``, ``b_v`` only (Qwen2)
* with ``qk_norm``: RMSNorms ``q_norm`` and ``k_norm`` on the projected queries and keys,
  before RoPE: ``"head"`` over each head's ``J`` dims, one ``[J]`` scale shared by the heads
  (Qwen3); ``"full"`` over the whole projection, scales ``[H*J]`` and ``[G*J]`` (OLMoE)

``H`` = ``n_heads``, ``G`` = ``n_kv_heads`` (divides ``H``), ``J`` = ``head_dim``. Query head
``h`` reads kv head ``h // (H // G)`` (the HF ``repeat_kv`` convention). An HF
``nn.Linear`` weight ``[out, in]`` is imported as its transpose.

Implementations of the attention itself (``impl``): ``"flash"`` runs the platform's flash
kernel, tokamax's, chosen when the program is lowered (:mod:`moejax.kernels.flash_attention`: Pallas
Triton on ``cuda``, Pallas Mosaic on TPU), and XLA's attention elsewhere (the CPU) or where the
kernel declines a call; ``"jax"`` calls ``jax.nn.dot_product_attention`` with the explicit
boolean mask and its default implementation, which is XLA's on every platform; ``"einsum"`` is
the obvious float32-softmax einsum, kept as the oracle (tests: equal values and gradients,
GQA, padding, fully masked rows, the KV-cache path). ``"auto"`` (the default) is ``"flash"``,
whose XLA side is ``"einsum"`` on the CPU, where it compiles faster than ``"jax"`` (the test
suite's model tests: 159 s vs 178 s, cold cache, serial), and ``"jax"`` elsewhere.

KV cache: :class:`KVCache` is a pytree ``(k_BSGJ, v_BSGJ, lengths_B)`` passed in and returned
by :meth:`Attention.decode`; slot ``s`` of row ``b`` holds the token written ``s``-th, and
``lengths_B`` counts the filled slots. New tokens are written at ``lengths_B`` and attend
causally to every filled slot. It is never stored on the module.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels.flash_attention import flash_attention
from moejax.kernels.tiling import target_device
from moejax.nn import axes as ax
from moejax.nn.norms import RMSNorm
from moejax.nn.rope import apply_rope

__all__ = ["KVCache", "init_kv_cache", "dot_product_attention", "Attention", "ATTENTION_IMPLS",
           "QK_NORMS", "resolve_attention_impl"]

ATTENTION_IMPLS = ("auto", "flash", "jax", "einsum")
QK_NORMS = ("none", "head", "full")


def resolve_attention_impl(impl: str) -> str:
    """``"auto"`` -> ``"flash"`` (the kernel is picked when the program is lowered); others
    unchanged."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl={impl!r}; use one of {ATTENTION_IMPLS}")
    return "flash" if impl == "auto" else impl


def _xla_impl() -> str:
    """XLA's attention for the platform being built for: the einsum on the CPU, ``"jax"``
    elsewhere."""
    return "einsum" if target_device()[0] == "cpu" else "jax"

_NEG = -1e30  # finite "minus infinity": a fully masked row gives a uniform softmax, not NaN


class KVCache(NamedTuple):
    """One layer's KV cache: keys/values ``[B, S_max, G, J]`` and filled lengths ``[B]``."""

    k_BSGJ: jax.Array
    v_BSGJ: jax.Array
    lengths_B: jax.Array


def init_kv_cache(batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                  dtype=jnp.float32) -> KVCache:
    """An empty cache (zeros, lengths 0)."""
    shape = (batch, max_len, n_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch,), jnp.int32))


def dot_product_attention(q_BTHJ: jax.Array, k_BSGJ: jax.Array, v_BSGJ: jax.Array,
                          mask_BTS: jax.Array | None = None, *, impl: str = "auto",
                          kv_lengths_B: jax.Array | None = None) -> jax.Array:
    """Softmax attention with grouped kv heads (float32 logits and softmax).

    ``mask_BTS`` (bool, True = may attend) broadcasts against ``[B, T, S]``; a fully masked
    query row attends uniformly (finite, not NaN). Returns ``[B, T, H, J]`` in ``q``'s dtype.
    ``impl``: ``"flash"`` (the platform's kernel, XLA's on the CPU), ``"jax"``
    (``jax.nn.dot_product_attention``), ``"einsum"`` (the oracle) or ``"auto"``
    (:func:`resolve_attention_impl`). ``kv_lengths_B`` (a KV cache's filled slots per row,
    beyond which ``mask_BTS`` enables nothing) lets the flash kernel skip the rest.
    """
    impl = resolve_attention_impl(impl)
    B, T, H, J = q_BTHJ.shape
    G = k_BSGJ.shape[2]
    if H % G:
        raise ValueError(f"n_heads={H} is not a multiple of n_kv_heads={G}")
    if impl == "flash":
        xla = _xla_impl()
        if mask_BTS is None:
            mask_BTS = jnp.ones((B, T, k_BSGJ.shape[1]), bool)
        return flash_attention(q_BTHJ, k_BSGJ, v_BSGJ, mask_BTS, kv_lengths_B=kv_lengths_B,
                               fallback=lambda q, k, v, m: dot_product_attention(
                                   q, k, v, m, impl=xla))
    if impl == "jax":
        mask = None
        if mask_BTS is not None:
            mask = jnp.broadcast_to(mask_BTS, (B, T, k_BSGJ.shape[1]))[:, None]
        v = v_BSGJ.astype(q_BTHJ.dtype)
        return jax.nn.dot_product_attention(q_BTHJ, k_BSGJ.astype(q_BTHJ.dtype), v, mask=mask)
    q_BTGRJ = q_BTHJ.reshape(B, T, G, H // G, J)
    logits_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRJ, k_BSGJ,
                              preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(J))
    if mask_BTS is not None:
        logits_BGRTS = jnp.where(mask_BTS[:, None, None, :, :], logits_BGRTS, _NEG)
    probs_BGRTS = jax.nn.softmax(logits_BGRTS, axis=-1).astype(v_BSGJ.dtype)
    out_BTGRJ = jnp.einsum("bgrts,bsgk->btgrk", probs_BGRTS, v_BSGJ)
    return out_BTGRJ.reshape(B, T, H, J).astype(q_BTHJ.dtype)


def _write_cache(cache_BSGJ: jax.Array, new_BTGJ: jax.Array, start_B: jax.Array) -> jax.Array:
    """Write ``new_BTGJ`` into each row at its own offset ``start_B`` (must fit). One row
    (batch-1 decoding) is one ``dynamic_update_slice`` of the whole cache, which XLA does in
    place on a donated cache; several rows at their own offsets are a vmapped one (a
    scatter)."""
    new_BTGJ = new_BTGJ.astype(cache_BSGJ.dtype)
    if cache_BSGJ.shape[0] == 1:
        zero = jnp.zeros((), start_B.dtype)
        return jax.lax.dynamic_update_slice(cache_BSGJ, new_BTGJ, (zero, start_B[0], zero, zero))

    def one(c_SGJ, n_TGJ, s):
        return jax.lax.dynamic_update_slice(c_SGJ, n_TGJ, (s, 0, 0))
    return jax.vmap(one)(cache_BSGJ, new_BTGJ, start_B)


class Attention(nnx.Module):
    """Self-attention: MHA (``n_kv_heads == n_heads``) or GQA, optional biases, q/k norms
    and RoPE."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int | None = None, *, use_bias: bool = False, causal: bool = True,
                 rope_style: str | None = None, rope_base: float = 10000.0,
                 qkv_bias: bool = False, qk_norm: str = "none", norm_eps: float = 1e-6,
                 impl: str = "auto", rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32):
        self.impl = resolve_attention_impl(impl)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r}; use one of {QK_NORMS}")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model={d_model} not divisible by n_heads={n_heads}; "
                                 "set head_dim explicitly")
            head_dim = d_model // n_heads
        if rope_style is not None and rope_style not in ("interleaved", "half"):
            raise ValueError(f"rope_style={rope_style!r}; use 'interleaved', 'half' or None")
        if rope_style is not None and head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE (or rope_style=None)")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.causal, self.rope_style, self.rope_base = causal, rope_style, float(rope_base)
        self.use_bias, self.dtype, self.qk_norm = use_bias, dtype, qk_norm
        H, G, J, D = n_heads, n_kv_heads, head_dim, d_model

        def dense(shape, *names):
            return ax.param(jax.random.normal(rngs.params(), shape, param_dtype)
                            * (shape[0] ** -0.5), *names)

        self.w_q = dense((D, H * J), ax.EMBED, ax.HEADS)
        self.w_k, self.w_v = (dense((D, G * J), ax.EMBED, ax.KV_HEADS) for _ in "kv")
        self.w_o = dense((H * J, D), ax.HEADS, ax.EMBED)
        self.biased = ("q", "k", "v", "o") if use_bias else ("q", "k", "v") if qkv_bias else ()
        for name, width, axis in zip(("q", "k", "v", "o"), (H * J, G * J, G * J, D),
                                     (ax.HEADS, ax.KV_HEADS, ax.KV_HEADS, ax.EMBED)):
            if name in self.biased:
                setattr(self, "b_" + name, ax.param(jnp.zeros((width,), param_dtype), axis))
        if qk_norm != "none":
            per_head = qk_norm == "head"
            norm_kw = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.q_norm = RMSNorm(J if per_head else H * J, **norm_kw)
            self.k_norm = RMSNorm(J if per_head else G * J, **norm_kw)

    def _proj(self, x_BTD, name):
        dt = self.dtype or x_BTD.dtype
        y = self._matmul(x_BTD.astype(dt), getattr(self, "w_" + name)[...].astype(dt))
        if name in self.biased:
            y = y + getattr(self, "b_" + name)[...].astype(dt)
        return y

    def _matmul(self, x, w):
        """A projection's product ``x @ w`` (a subclass may keep its weights laid out
        otherwise)."""
        return x @ w

    def _project(self, x_BTD):
        """The q, k and v projections ``[B, T, H*J]``, ``[B, T, G*J]`` (twice)."""
        return self._proj(x_BTD, "q"), self._proj(x_BTD, "k"), self._proj(x_BTD, "v")

    def _qkv(self, x_BTD, positions_BT):
        return self._heads(*self._project(x_BTD), positions_BT)

    def _heads(self, q, k, v, positions_BT):
        """The projections split into heads, q/k-normed and rotated."""
        B, T = q.shape[:2]
        if self.qk_norm == "full":  # over the whole projection (OLMoE)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.n_heads, self.head_dim)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # over each head's dims (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_style is not None:
            q = apply_rope(q, positions_BT, base=self.rope_base, style=self.rope_style)
            k = apply_rope(k, positions_BT, base=self.rope_base, style=self.rope_style)
        return q, k, v

    def _out(self, o_BTHJ):
        B, T = o_BTHJ.shape[:2]
        return self._proj(o_BTHJ.reshape(B, T, -1), "o")

    def __call__(self, x_BTD: jax.Array, *, positions_BT: jax.Array | None = None,
                 mask_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
        """Full-sequence attention. ``mask_BT`` marks real (non-padding) keys;
        ``segment_ids_BT`` (int, document id of each token of a packed row) restricts every
        query to keys of its own segment (block-diagonal, combined with the causal and padding
        masks). Positions default to ``arange(T)``; for packed rows pass the per-document
        positions so RoPE restarts at each document."""
        B, T, _ = x_BTD.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q, k, v = self._qkv(x_BTD, positions_BT)
        mask_BTS = jnp.ones((B, T, T), bool)
        if self.causal:
            mask_BTS = mask_BTS & jnp.tril(jnp.ones((T, T), bool))[None]
        if mask_BT is not None:
            mask_BTS = mask_BTS & mask_BT.astype(bool)[:, None, :]
        if segment_ids_BT is not None:
            mask_BTS = mask_BTS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
        return self._out(dot_product_attention(q, k, v, mask_BTS, impl=self.impl))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        return init_kv_cache(batch, max_len, self.n_kv_heads, self.head_dim,
                             dtype or self.dtype or jnp.float32)

    def decode(self, x_BTD: jax.Array, cache: KVCache,
               positions_BT: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Attend ``T`` new tokens to the cache (+ each other, causally); return the new cache.

        Positions default to ``lengths_B + arange(T)``. The caller guarantees
        ``lengths_B + T <= S_max`` (writes past the end are clamped by XLA).
        """
        return self.decode_projected(self._project(x_BTD), cache, positions_BT)

    def decode_projected(self, qkv: tuple, cache: KVCache,
                         positions_BT: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """:meth:`decode` from the q, k and v projections ``[B, T, H*J]``, ``[B, T, G*J]``
        (twice), however they were made."""
        T = qkv[0].shape[1]
        start_B = cache.lengths_B
        slot_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        if positions_BT is None:
            positions_BT = slot_BT
        q, k, v = self._heads(*qkv, positions_BT)
        return self.attend_cache(q, _write_cache(cache.k_BSGJ, k, start_B),
                                 _write_cache(cache.v_BSGJ, v, start_B), start_B)

    def attend_cache(self, q_BTHJ, k_BSGJ, v_BSGJ, start_B) -> tuple[jax.Array, KVCache]:
        """The output of ``T`` new queries over caches that hold their keys and values from
        each row's ``start_B`` on (each query sees its own slot and the ones before it), and
        the cache with ``T`` more filled slots."""
        T, S = q_BTHJ.shape[1], k_BSGJ.shape[1]
        slot_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        mask_BTS = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= slot_BT[:, :, None]
        out = self._out(dot_product_attention(q_BTHJ, k_BSGJ, v_BSGJ, mask_BTS, impl=self.impl,
                                              kv_lengths_B=start_B + T))
        return out, KVCache(k_BSGJ, v_BSGJ, start_B + T)
