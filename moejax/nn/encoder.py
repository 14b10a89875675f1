"""Bidirectional encoders sharing :class:`TransformerBlock`: BERT and ViT.

:class:`BertEncoder` parameter paths (``[in, out]`` matrices):

* ``tok_embed`` ``[V, D]``, ``pos_embed`` ``[max_position, D]`` (learned absolute),
  ``type_embed`` ``[type_vocab_size, D]``, ``embed_norm/{scale,bias}`` ``[D]``
* ``blocks/{i}`` post-LN blocks: ``attn/w_q|w_k|w_v`` ``[D, D]`` + ``b_q|b_k|b_v`` ``[D]``,
  ``attn/w_o`` ``[D, D]`` + ``b_o``; ``attn_norm/{scale,bias}`` (BERT
  ``attention.output.LayerNorm``); ``ffn/w_up`` ``[D, F]``, ``b_up``, ``ffn/w_down`` ``[F, D]``,
  ``b_down`` (BERT intermediate / output dense); ``ffn_norm/{scale,bias}`` (BERT
  ``output.LayerNorm``)
* ``w_pool`` ``[D, D]``, ``b_pool`` ``[D]`` only when ``pooling == "pooler"``

:class:`SequenceClassifier`: ``encoder/...`` plus ``w_cls`` ``[D, C]``, ``b_cls`` ``[C]``.

:class:`ViT` parameter paths: ``w_patch`` ``[p*p*C_in, D]`` (rows ordered (row, col, channel)
within a patch, see :func:`patchify`; an HF conv kernel ``[D, C_in, p, p]`` imports as
``kernel.transpose(2, 3, 1, 0).reshape(-1, D)``), ``b_patch`` ``[D]``, ``cls_token`` ``[D]``,
``pos_embed`` ``[1 + n_patches, D]``, ``blocks/{i}`` (pre-LN, same names as above),
``final_norm/{scale,bias}``, ``w_head`` ``[D, n_classes]``, ``b_head`` ``[n_classes]``.

Both return ``aux = {"aux_loss": summed slot aux losses, "layers": per-layer slot aux}``, and
under a mesh of explicit axes run with them automatic (:mod:`moejax.nn.auto_axes`).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import Config, config
from moejax.nn import axes as ax
from moejax.nn.auto_axes import call_with_auto_axes, explicit_mesh
from moejax.nn.block import TransformerBlock, run_blocks
from moejax.nn.decoder import DTYPES, check_tokens
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.norms import LayerNorm
from moejax.nn.slots import FFNSlotConfig

__all__ = ["EncoderConfig", "BertEncoder", "SequenceClassifier", "bert_encoder_config",
           "minilm_l6_config", "ViTConfig", "ViT", "vit_config", "patchify", "masked_mean"]


@config(kw_only=True)
class EncoderNumerics(Config):
    """What every encoder config shares (BERT's, ViT's): initialisation, dtypes, attention
    (:mod:`moejax.nn.attention`), and the checks of its shape fields."""

    init_std: float = 0.02
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "flash", "jax", "einsum"] = "auto"  # see moejax.nn.attention

    def validate(self) -> None:
        _check_common(self)


def _check_common(cfg) -> None:
    for name in ("d_model", "n_layers", "n_heads"):
        cfg._require(getattr(cfg, name) > 0, f"{name}={getattr(cfg, name)} must be > 0")
    cfg._require(cfg.d_model % cfg.n_heads == 0,
                 f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
    cfg._require(len(cfg.ffn_slots) == cfg.n_layers,
                 f"ffn_slots has {len(cfg.ffn_slots)} entries but n_layers={cfg.n_layers}; "
                 "give one slot config per layer (see moejax.nn.slots.layer_pattern)")
    cfg._require(all(isinstance(s, FFNSlotConfig) for s in cfg.ffn_slots),
                 "every ffn_slots entry must be an FFNSlotConfig (e.g. DenseFFNConfig)")


def _normal(rngs, shape, dtype, std, *names):
    return ax.param(jax.random.normal(rngs.params(), shape, dtype) * std, *names)


def _blocks(cfg, norm_position, rngs, dtype, pdt):
    return nnx.List([
        TransformerBlock(cfg.d_model, n_heads=cfg.n_heads, ffn_slot=slot,
                         norm_position=norm_position, norm_kind="layernorm",
                         norm_eps=cfg.norm_eps, attn_bias=True, causal=False, rope_style=None,
                         attention=cfg.attention, rngs=rngs, dtype=dtype, param_dtype=pdt)
        for slot in cfg.ffn_slots
    ])


def masked_mean(h_BTD: jax.Array, mask_BT: jax.Array | None) -> jax.Array:
    """Mean over time of the real (``mask_BT`` True) tokens -> ``[B, D]``."""
    if mask_BT is None:
        return jnp.mean(h_BTD, axis=1)
    m = mask_BT.astype(h_BTD.dtype)[..., None]
    return jnp.sum(h_BTD * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


# ---------------------------------------------------------------------------------------- BERT


@config
class EncoderConfig(EncoderNumerics):
    """BERT-style encoder (post-LN, learned positions, token types, attention biases)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_slots: tuple
    max_position: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    pooling: Literal["cls", "mean", "pooler"] = "cls"

    def validate(self) -> None:
        super().validate()
        self._require(self.vocab_size > 0 and self.max_position > 0 and self.type_vocab_size > 0,
                      "vocab_size, max_position and type_vocab_size must be > 0")


def bert_encoder_config(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
                        d_hidden: int, activation: str = "gelu", **kwargs) -> EncoderConfig:
    """An :class:`EncoderConfig` with the same biased dense FFN in every layer."""
    slot = DenseFFNConfig(d_hidden=d_hidden, activation=activation, use_bias=True)
    return EncoderConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                         n_heads=n_heads, ffn_slots=(slot,) * n_layers, **kwargs)


def minilm_l6_config(**kwargs) -> EncoderConfig:
    """all-MiniLM-L6-v2 architecture (sentence embedding = mean pooling)."""
    base = dict(vocab_size=30522, d_model=384, n_layers=6, n_heads=12, d_hidden=1536,
                activation="gelu", max_position=512, type_vocab_size=2, norm_eps=1e-12,
                pooling="mean")
    base.update(kwargs)
    return bert_encoder_config(**base)


class BertEncoder(nnx.Module):
    """``hidden_BTD, pooled_BD, aux = enc(tokens_BT, token_types_BT=..., mask_BT=...)``."""

    def __init__(self, cfg: EncoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.dtype = dtype
        D, s = cfg.d_model, cfg.init_std
        self.tok_embed = _normal(rngs, (cfg.vocab_size, D), pdt, s, ax.VOCAB, ax.EMBED)
        self.pos_embed = _normal(rngs, (cfg.max_position, D), pdt, s, ax.POSITIONS, ax.EMBED)
        self.type_embed = _normal(rngs, (cfg.type_vocab_size, D), pdt, s, ax.VOCAB, ax.EMBED)
        self.embed_norm = LayerNorm(D, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        self.blocks = _blocks(cfg, "post", rngs, dtype, pdt)
        if cfg.pooling == "pooler":
            self.w_pool = _normal(rngs, (D, D), pdt, s, ax.EMBED, ax.EMBED)
            self.b_pool = ax.param(jnp.zeros((D,), pdt), ax.EMBED)

    def __call__(self, tokens_BT: jax.Array, *, token_types_BT: jax.Array | None = None,
                 mask_BT: jax.Array | None = None, train: bool = False,
                 key: jax.Array | None = None):
        check_tokens(tokens_BT, "a BertEncoder", token_types_BT=token_types_BT, mask_BT=mask_BT)
        if explicit_mesh():
            return call_with_auto_axes(self, BertEncoder.__call__, tokens_BT,
                                       token_types_BT=token_types_BT, mask_BT=mask_BT,
                                       train=train, key=key)
        B, T = tokens_BT.shape
        if T > self.cfg.max_position:
            raise ValueError(f"sequence length {T} > max_position={self.cfg.max_position}; "
                             "truncate the input or raise max_position")
        if token_types_BT is None:
            token_types_BT = jnp.zeros_like(tokens_BT)
        h = (jnp.take(self.tok_embed[...], tokens_BT, axis=0)
             + self.pos_embed[...][:T][None]
             + jnp.take(self.type_embed[...], token_types_BT, axis=0))
        h = self.embed_norm(h.astype(self.dtype))
        h, aux = run_blocks(self.blocks, h, train=train, key=key, mask_BT=mask_BT)
        if self.cfg.pooling == "mean":
            pooled = masked_mean(h, mask_BT)
        elif self.cfg.pooling == "cls":
            pooled = h[:, 0]
        else:
            pooled = jnp.tanh(h[:, 0] @ self.w_pool[...].astype(h.dtype)
                              + self.b_pool[...].astype(h.dtype))
        return h, pooled, aux


class SequenceClassifier(nnx.Module):
    """BERT encoder + linear head on the pooled vector: ``logits_BL, aux = clf(tokens_BT...)``."""

    def __init__(self, cfg: EncoderConfig, n_classes: int, *, rngs: nnx.Rngs):
        if n_classes < 1:
            raise ValueError(f"n_classes={n_classes} must be >= 1")
        self.encoder = BertEncoder(cfg, rngs=rngs)
        pdt = DTYPES[cfg.param_dtype]
        self.w_cls = _normal(rngs, (cfg.d_model, n_classes), pdt, cfg.init_std, ax.EMBED,
                             ax.CLASSES)
        self.b_cls = ax.param(jnp.zeros((n_classes,), pdt), ax.CLASSES)

    @property
    def vocab_size(self) -> int:
        return self.encoder.cfg.vocab_size

    @property
    def n_classes(self) -> int:
        return int(self.b_cls.shape[0])

    def __call__(self, tokens_BT, *, token_types_BT=None, mask_BT=None, train=False, key=None):
        _, pooled_BD, aux = self.encoder(tokens_BT, token_types_BT=token_types_BT,
                                         mask_BT=mask_BT, train=train, key=key)
        logits = pooled_BD.astype(jnp.float32) @ self.w_cls[...].astype(jnp.float32)
        return logits + self.b_cls[...].astype(jnp.float32), aux


# ----------------------------------------------------------------------------------------- ViT


@config
class ViTConfig(EncoderNumerics):
    """Vision transformer: patches -> dense, CLS token, learned positions, pre-LN blocks."""

    image_size: int
    patch_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_classes: int
    ffn_slots: tuple
    n_channels: int = 3
    norm_eps: float = 1e-6
    pooling: Literal["cls", "mean"] = "cls"

    def validate(self) -> None:
        super().validate()
        self._require(self.patch_size > 0 and self.image_size >= self.patch_size
                      and self.image_size % self.patch_size == 0,
                      f"image_size={self.image_size} must be a positive multiple of "
                      f"patch_size={self.patch_size}")
        self._require(self.n_classes > 0 and self.n_channels > 0,
                      "n_classes and n_channels must be > 0")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def vit_config(*, image_size: int, patch_size: int, d_model: int, n_layers: int, n_heads: int,
               d_hidden: int, n_classes: int, activation: str = "gelu", **kwargs) -> ViTConfig:
    """A :class:`ViTConfig` with the same biased dense FFN in every layer."""
    slot = DenseFFNConfig(d_hidden=d_hidden, activation=activation, use_bias=True)
    return ViTConfig(image_size=image_size, patch_size=patch_size, d_model=d_model,
                     n_layers=n_layers, n_heads=n_heads, n_classes=n_classes,
                     ffn_slots=(slot,) * n_layers, **kwargs)


def patchify(images_BYXZ: jax.Array, patch_size: int) -> jax.Array:
    """``[B, Y, X, Z]`` -> ``[B, (Y/p)*(X/p), p*p*Z]``; patches row-major, each flattened in
    (row, col, channel) order."""
    B, Y, X, Z = images_BYXZ.shape
    p = patch_size
    if Y % p or X % p:
        raise ValueError(f"image {Y}x{X} is not divisible into {p}x{p} patches")
    x = images_BYXZ.reshape(B, Y // p, p, X // p, p, Z).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (Y // p) * (X // p), p * p * Z)


class ViT(nnx.Module):
    """``logits_BL, aux = vit(images_BYXZ, train=..., key=...)``."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.dtype = dtype
        D, s, P = cfg.d_model, cfg.init_std, cfg.patch_size * cfg.patch_size * cfg.n_channels
        self.w_patch = _normal(rngs, (P, D), pdt, P ** -0.5, ax.PATCH, ax.EMBED)
        self.b_patch = ax.param(jnp.zeros((D,), pdt), ax.EMBED)
        self.cls_token = _normal(rngs, (D,), pdt, s, ax.EMBED)
        self.pos_embed = _normal(rngs, (1 + cfg.n_patches, D), pdt, s, ax.POSITIONS, ax.EMBED)
        self.blocks = _blocks(cfg, "pre", rngs, dtype, pdt)
        self.final_norm = LayerNorm(D, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        self.w_head = _normal(rngs, (D, cfg.n_classes), pdt, s, ax.EMBED, ax.CLASSES)
        self.b_head = ax.param(jnp.zeros((cfg.n_classes,), pdt), ax.CLASSES)

    def features(self, images_BYXZ: jax.Array, *, train: bool = False, key=None):
        """Final-normed token features ``[B, 1 + n_patches, D]`` (CLS first) and aux."""
        if explicit_mesh():
            return call_with_auto_axes(self, ViT.features, images_BYXZ, train=train, key=key)
        cfg = self.cfg
        if images_BYXZ.shape[1:] != (cfg.image_size, cfg.image_size, cfg.n_channels):
            raise ValueError(f"images shape {images_BYXZ.shape[1:]} != (image_size, image_size, "
                             f"n_channels)=({cfg.image_size}, {cfg.image_size}, "
                             f"{cfg.n_channels})")
        dt = self.dtype
        patches_BPI = patchify(images_BYXZ.astype(dt), cfg.patch_size)
        x = patches_BPI @ self.w_patch[...].astype(dt) + self.b_patch[...].astype(dt)
        cls = jnp.broadcast_to(self.cls_token[...].astype(dt), (x.shape[0], 1, x.shape[2]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...].astype(dt)[None]
        x, aux = run_blocks(self.blocks, x, train=train, key=key)
        return self.final_norm(x), aux

    def __call__(self, images_BYXZ: jax.Array, *, train: bool = False, key=None):
        if explicit_mesh():
            return call_with_auto_axes(self, ViT.__call__, images_BYXZ, train=train, key=key)
        h, aux = self.features(images_BYXZ, train=train, key=key)
        pooled = h[:, 0] if self.cfg.pooling == "cls" else jnp.mean(h[:, 1:], axis=1)
        logits = pooled.astype(jnp.float32) @ self.w_head[...].astype(jnp.float32)
        return logits + self.b_head[...].astype(jnp.float32), aux
