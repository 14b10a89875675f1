"""Decoder-only causal language model (Llama layout) with per-layer FFN slots.

Parameter paths of :class:`DecoderLM` (``[in, out]`` matrices):

* ``embed`` ``[V, D]`` token embedding (also the output head when ``tie_embeddings``)
* ``blocks/{i}/attn_norm/scale`` ``[D]``, ``blocks/{i}/attn/w_q`` ``[D, H*K]``,
  ``w_k``/``w_v`` ``[D, G*K]``, ``w_o`` ``[H*K, D]`` (no biases),
  ``blocks/{i}/ffn_norm/scale`` ``[D]``, ``blocks/{i}/ffn/...`` (the slot's params, e.g.
  ``w_gate``/``w_up`` ``[D, F]``, ``w_down`` ``[F, D]`` for :class:`DenseFFN`)
* ``final_norm/scale`` ``[D]``
* ``w_head`` ``[D, V]`` only when ``tie_embeddings=False``

Blocks are pre-RMSNorm with RoPE (``rope_style``: ``"half"`` for HF checkpoints,
``"interleaved"`` for GGUF/Meta). Logits are returned in float32.

Incremental decoding: ``cache = model.init_cache(B, S_max)``, then
``logits, cache = model.decode(tokens_BT, cache)`` for the prompt (prefill) and for each new
token; the cache (a tuple of per-layer :class:`KVCache`) is an explicit pytree.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import Config, config, is_integer
from moejax.nn import axes as ax
from moejax.nn.attention import KVCache
from moejax.nn.auto_axes import call_with_auto_axes, explicit_mesh
from moejax.nn.block import TransformerBlock, run_blocks
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.norms import RMSNorm
from moejax.nn.slots import FFNSlotConfig
from moejax.nn.surgery import build_from_pure
from moejax.pytree import named_leaves

__all__ = ["DecoderConfig", "DecoderLM", "DecoderCache", "dense_decoder_config",
           "smollm2_135m_config", "keep_layers", "with_dtype", "check_tokens", "DTYPES",
           "split_lengths", "join_lengths"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DecoderCache = tuple  # tuple[KVCache, ...], one per layer


@config
class DecoderConfig(Config):
    """Decoder LM hyper-parameters; ``ffn_slots`` holds one slot config per layer."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_slots: tuple
    n_kv_heads: int | None = None  # None -> n_heads (plain MHA)
    head_dim: int | None = None  # None -> d_model // n_heads
    max_seq_len: int = 2048
    rope_base: float = 10000.0
    rope_style: Literal["interleaved", "half"] = "half"
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02  # embedding (and untied head) init std
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # "flash": tokamax's flash kernel on GPU / TPU, picked when lowered, XLA's on the CPU;
    # "jax": jax.nn.dot_product_attention, its default implementation (XLA's);
    # "einsum": the float32 einsum oracle; "auto": flash
    attention: Literal["auto", "flash", "jax", "einsum"] = "auto"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2 / Qwen2-MoE)
    # RMSNorms on the projected q and k before RoPE: over each head (Qwen3) or the whole
    # projection (OLMoE); moejax.nn.attention.Attention
    qk_norm: Literal["none", "head", "full"] = "none"

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            self._require(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be > 0")
        self._require(len(self.ffn_slots) == self.n_layers,
                      f"ffn_slots has {len(self.ffn_slots)} entries but n_layers="
                      f"{self.n_layers}; give one slot config per layer (see "
                      "moejax.nn.slots.layer_pattern / dense_decoder_config)")
        self._require(all(isinstance(s, FFNSlotConfig) for s in self.ffn_slots),
                      "every ffn_slots entry must be an FFNSlotConfig (e.g. DenseFFNConfig)")
        kv = self.kv_heads
        self._require(kv > 0 and self.n_heads % kv == 0,
                      f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim is None:
            self._require(self.d_model % self.n_heads == 0,
                          f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                          "set head_dim explicitly")
        self._require(self.dim_per_head >= 2 and self.dim_per_head % 2 == 0,
                      f"head_dim={self.dim_per_head} must be even and >= 2 for RoPE")
        self._require(math.isfinite(self.rope_base) and self.rope_base > 1,
                      f"rope_base={self.rope_base} must be a finite number > 1 (RoPE's "
                      "frequencies base^(-2i/head_dim) fall with i; 0 or less gives inf or "
                      "NaN angles)")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim


def dense_decoder_config(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
                         d_hidden: int, activation: str = "swiglu",
                         **kwargs) -> DecoderConfig:
    """A :class:`DecoderConfig` with the same dense FFN (no biases) in every layer."""
    slot = DenseFFNConfig(d_hidden=d_hidden, activation=activation)
    return DecoderConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                         n_heads=n_heads, ffn_slots=(slot,) * n_layers, **kwargs)


# a 2-layer, d 64 variant of SmolLM2-135M's layout (the same parameter kinds), for tests
# and quick presets
SMOLLM2_TINY = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32,
                    d_hidden=128)


def smollm2_135m_config(*, tiny: bool = False, **kwargs) -> DecoderConfig:
    """SmolLM2-135M architecture (HF layout: ``rope_style="half"``); ``tiny``: its
    :data:`SMOLLM2_TINY` variant."""
    base = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                head_dim=64, d_hidden=1536, activation="swiglu", max_seq_len=8192,
                rope_base=100000.0, rope_style="half", norm_eps=1e-5, tie_embeddings=True)
    base.update(SMOLLM2_TINY if tiny else {}, **kwargs)
    return dense_decoder_config(**base)


def param_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """``{path: shape}`` of the parameters of a :class:`DecoderLM` of ``cfg``, in
    ``jax.tree_util`` leaf order, made abstractly (no weights)."""
    state = nnx.state(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return {path: tuple(x.shape) for path, x in named_leaves(state)}


class DecoderLM(nnx.Module):
    """Causal LM: ``logits_BTV, aux = model(tokens_BT, train=..., key=...)``."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.dtype = dtype
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = ax.param(jax.random.normal(rngs.params(), (V, D), pdt) * cfg.init_std,
                              ax.VOCAB, ax.EMBED)
        self.blocks = nnx.List([
            TransformerBlock(D, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                             head_dim=cfg.dim_per_head, ffn_slot=slot, norm_position="pre",
                             norm_kind="rmsnorm", norm_eps=cfg.norm_eps, attn_bias=False,
                             causal=True, rope_style=cfg.rope_style, rope_base=cfg.rope_base,
                             qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
                             attention=cfg.attention, rngs=rngs, dtype=dtype, param_dtype=pdt)
            for slot in cfg.ffn_slots
        ])
        self.final_norm = RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        if not cfg.tie_embeddings:
            self.w_head = ax.param(jax.random.normal(rngs.params(), (D, V), pdt)
                                   * cfg.init_std, ax.EMBED, ax.VOCAB)

    def _embed(self, tokens_BT):
        return jnp.take(self.embed[...], tokens_BT, axis=0).astype(self.dtype)

    def _head(self, h_BTD):
        h = self.final_norm(h_BTD)
        if self.cfg.tie_embeddings:
            w_DV = self.embed[...].astype(self.dtype).T
        else:
            w_DV = self.w_head[...].astype(self.dtype)
        return jnp.einsum("btd,dv->btv", h, w_DV, preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT: jax.Array, *, train: bool = False,
                 key: jax.Array | None = None, positions_BT: jax.Array | None = None,
                 mask_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
                 remat: bool = False):
        """Full forward. Returns ``(logits_BTV float32, {"aux_loss", "layers"})``;
        ``key`` (if given) is split into one key per layer for the FFN slots; ``remat``
        recomputes each block's activations in a backward (:func:`moejax.nn.block.
        run_blocks`).

        Packed rows: ``segment_ids_BT`` keeps attention inside each document and reaches the
        FFN slots; pass the packed ``positions_BT`` too so RoPE restarts per document (then
        each document's logits equal those of the document run alone). Under a mesh of
        explicit axes it runs with them automatic (:mod:`moejax.nn.auto_axes`)."""
        check_tokens(tokens_BT, positions_BT=positions_BT, mask_BT=mask_BT,
                     segment_ids_BT=segment_ids_BT)
        if explicit_mesh():
            return call_with_auto_axes(self, DecoderLM.__call__, tokens_BT, train=train,
                                       key=key, positions_BT=positions_BT, mask_BT=mask_BT,
                                       segment_ids_BT=segment_ids_BT, remat=remat)
        h, aux = run_blocks(self.blocks, self._embed(tokens_BT), train=train, key=key,
                            positions_BT=positions_BT, mask_BT=mask_BT,
                            segment_ids_BT=segment_ids_BT, remat=remat)
        return self._head(h), aux

    def init_cache(self, batch: int, max_len: int) -> DecoderCache:
        """Empty per-layer KV caches for ``batch`` rows of up to ``max_len`` tokens."""
        return tuple(b.attn.init_cache(batch, max_len, self.dtype) for b in self.blocks)

    def decode(self, tokens_BT: jax.Array, cache: DecoderCache,
               positions_BT: jax.Array | None = None, mask_BT: jax.Array | None = None):
        """Prefill or incremental step: run ``tokens_BT`` after the cached tokens.

        Positions default to ``cache lengths + arange(T)``. ``mask_BT`` marks the real tokens
        (a padded prompt's padding, a finished row's filler: False) for the FFN slots, as in
        the full forward: a top-k MoE's padding then takes no slot of an expert's capacity
        (``dispatch="capacity"``), so a row's output does not depend on what another row's
        padding holds. Returns ``(logits_BTV, new_cache)``; inference mode (``train=False``,
        no key). Tokens that would not fit the cache are refused before tracing where the
        lengths are known (a concrete cache), and always where ``T`` alone exceeds it: a
        write past the end would be clamped onto the last slots. Under a mesh of explicit
        axes it runs with them automatic (:mod:`moejax.nn.auto_axes`).
        """
        check_tokens(tokens_BT, positions_BT=positions_BT, mask_BT=mask_BT)
        if cache and cache[0].k_BSGJ.shape[0] != tokens_BT.shape[0]:
            raise ValueError(f"decode: {tokens_BT.shape[0]} rows of tokens for a cache of "
                             f"{cache[0].k_BSGJ.shape[0]} rows; make the cache with "
                             f"init_cache({tokens_BT.shape[0]}, max_len)")
        check_cache_room(tokens_BT.shape[1], cache[0] if cache else None)
        if explicit_mesh():
            return call_with_auto_axes(self, type(self).decode, tokens_BT, cache,
                                       positions_BT=positions_BT, mask_BT=mask_BT)
        h = self._embed(tokens_BT)
        new_cache = []
        for block, c in zip(self.blocks, cache):
            h, _, c = block.decode(h, c, positions_BT=positions_BT, mask_BT=mask_BT)
            new_cache.append(c)
        return self._head(h), tuple(new_cache)


def check_tokens(tokens_BT, who: str = "a DecoderLM", *, positions_BT=None,
                 **per_token) -> None:
    """Refuse tokens that are not a ``[batch, time]`` array of integer ids (a float array
    or a single row would fail deeper, in the embedding's gather or the attention), and
    per-token arrays (``mask_BT``, ``segment_ids_BT``, ...) of another shape;
    ``positions_BT`` may also be one row ``[1, time]`` shared by every row."""
    shape, dtype = jnp.shape(tokens_BT), jnp.result_type(tokens_BT)
    if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"tokens of shape {shape} and dtype {dtype}; {who} takes integer "
                         "token ids [batch, time] (one sequence: tokens[None])")
    given = {k: v for k, v in per_token.items() if v is not None}
    if positions_BT is not None and jnp.shape(positions_BT) != (1, shape[1]):
        given["positions_BT"] = positions_BT
    for name, arr in given.items():
        if jnp.shape(arr) != shape:
            raise ValueError(f"{name} of shape {jnp.shape(arr)} for tokens of shape {shape}; "
                             "give one entry per token")


def check_cache_room(n_new: int, cache) -> None:
    """Refuse ``n_new`` tokens that do not fit ``cache`` (a layer's :class:`KVCache`): the
    cache's size against ``n_new``, and, for a concrete cache, against its fullest row."""
    if cache is None:
        return
    size = cache.k_BSGJ.shape[1]
    filled = 0
    if not isinstance(cache.lengths_B, jax.core.Tracer) and cache.lengths_B.size:
        filled = int(jnp.max(cache.lengths_B))
    if filled + n_new > size:
        raise ValueError(f"{n_new} new tokens after {filled} cached ones need {filled + n_new} "
                         f"cache slots, but the cache holds {size}; make it with "
                         "init_cache(batch, max_len) for a larger max_len")


def split_lengths(cache: DecoderCache) -> tuple[tuple, jax.Array]:
    """``(kv, lengths_B)``: each layer's ``(k, v)`` and the filled lengths all layers share (a
    decode step advances every layer alike). What a decoding loop carries: one lengths array
    through its rounds, so every layer's ``lengths + T`` is one value, computed once, rather
    than an add per layer (on a GPU, a kernel each)."""
    return tuple((c.k_BSGJ, c.v_BSGJ) for c in cache), cache[0].lengths_B


def join_lengths(kv: tuple, lengths_B: jax.Array) -> DecoderCache:
    """The cache of :func:`split_lengths`' ``(kv, lengths_B)``: every layer at
    ``lengths_B``."""
    return tuple(KVCache(k, v, lengths_B) for k, v in kv)


def keep_layers(model: DecoderLM, layers) -> DecoderLM:
    """Layer surgery: a new :class:`DecoderLM` made of ``model``'s blocks ``layers`` (in the
    given order) with its embedding, final norm and head; every variable (parameters and
    buffers, such as DeRS-SM's indices) copied, ``model`` unchanged. E.g.
    ``keep_layers(lm, range(2))``: a shallower student that shares the teacher's tokenizer
    and vocabulary."""
    layers = list(layers)
    n = model.cfg.n_layers
    if not layers or any(not is_integer(i) or not 0 <= i < n for i in layers):
        raise ValueError(f"layers={layers} must be a non-empty list of integer indices in "
                         f"[0, {n})")
    layers = [int(i) for i in layers]
    cfg = model.cfg.replace(n_layers=len(layers),
                            ffn_slots=tuple(model.cfg.ffn_slots[i] for i in layers))
    pure = nnx.to_pure_dict(nnx.state(model))  # every variable: DeRS's buffers too
    pure["blocks"] = {j: pure["blocks"][i] for j, i in enumerate(layers)}
    return _rebuilt(cfg, pure)


def with_dtype(model: DecoderLM, dtype: Literal["float32", "bfloat16"]) -> DecoderLM:
    """A copy of ``model`` that stores its parameters and computes in ``dtype`` (e.g. a model
    trained in float32, served in bfloat16: half the weight bytes a decoded token reads, and
    the 16-bit kernels); ``model`` unchanged, every variable copied (buffers too; floating
    ones cast)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {tuple(DTYPES)}")
    cfg = model.cfg.replace(dtype=dtype, param_dtype=dtype)
    pure = nnx.to_pure_dict(nnx.state(model))  # every variable: DeRS's buffers too
    pure = jax.tree.map(lambda x: x.astype(DTYPES[dtype])
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, pure)
    return _rebuilt(cfg, pure)


def _rebuilt(cfg: DecoderConfig, pure: dict) -> DecoderLM:
    """A :class:`DecoderLM` of ``cfg`` with the parameters of the pure dict (copied)."""
    return build_from_pure(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), pure)
