"""Hugging Face MoE checkpoints out: a moejax MoE decoder written as the family whose layers it
has (:data:`moejax.io.hf_moe.FAMILIES`), in the layout :mod:`moejax.io.hf_moe` reads.

    save_hf_moe(model, "out/dir")               # config.json + model.safetensors
    save_hf_moe(model, "out/dir", tokenizer=tok)  # + tokenizer.json, generation_config.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moejax.files import atomic_write_text, writable_dir
from moejax.io._common import flat_params
from moejax.io.hf_moe import FAMILIES, HFMoEFamily, layer_tensors
from moejax.io.safetensors_io import export_params
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.moe import MoEConfig

__all__ = ["save_hf_moe"]

# a tokenizer's files that save_hf_moe never writes and that a reader (transformers'
# AutoTokenizer) takes beside the tokenizer.json it does write
_TOKENIZER_SETTINGS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                       "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt")


def _family_of(cfg: DecoderConfig) -> str:
    """The Hugging Face family whose layers ``cfg`` has (ValueError naming why none)."""
    slots = cfg.ffn_slots
    moe = slots[0]
    why = None
    if not all(type(s) is MoEConfig for s in slots):
        why = ("every block's FFN must be a plain MoE (MoEConfig): BlockFFN, DeRS and other "
               "slots have no Hugging Face family; synthesise DeRS experts to dense first")
    elif any(s != moe for s in slots):
        why = "every block's MoE must have the same config"
    elif moe.activation != "swiglu" or moe.router != "softmax":
        why = "the families' experts are SwiGLU with a softmax top-k router"
    elif moe.universal_ffn:
        why = "no family has a universal FFN"
    elif cfg.rope_style != "half":
        why = "the families' RoPE is the rotate-half layout (rope_style='half')"
    if why:
        raise ValueError(f"save_hf_moe: this model has no Hugging Face layout: {why}")
    shared = (moe.n_shared_experts, moe.shared_gate)
    for kind, fam in FAMILIES.items():
        bias_ok = cfg.qkv_bias == fam.qkv_bias or (fam.qkv_bias and fam.shared)  # Qwen2-MoE
        if fam.qk_norm == cfg.qk_norm and bias_ok and shared == (
                (1, True) if fam.shared else (0, False)):
            if fam.renormalize_key is None and not moe.renormalize:
                raise ValueError("save_hf_moe: Mixtral renormalises the top-k weights; this "
                                 "model does not (renormalize=False)")
            return kind
    raise ValueError(
        f"save_hf_moe: no family has these layers: qk_norm={cfg.qk_norm!r}, qkv_bias="
        f"{cfg.qkv_bias}, {moe.n_shared_experts} shared experts (gated: {moe.shared_gate}); "
        "Mixtral: none of them; Qwen2-MoE: one gated shared expert (q/k/v biases or not); "
        "Qwen3-MoE: qk_norm='head'; OLMoE: qk_norm='full'")


def _hf_config(kind: str, cfg: DecoderConfig) -> dict:
    fam, moe = FAMILIES[kind], cfg.ffn_slots[0]
    out = {
        "architectures": [fam.architecture], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        fam.d_expert_key: moe.d_expert, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_base, "rms_norm_eps": cfg.norm_eps,
        fam.n_experts_key: moe.n_experts, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.balance_coef, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.param_dtype,
        "attention_dropout": 0.0, **dict(fam.required),
    }
    if fam.renormalize_key is not None:
        out[fam.renormalize_key] = moe.renormalize
    if fam.shared:
        out["shared_expert_intermediate_size"] = moe.d_shared or moe.d_expert
    if kind == "qwen2_moe":  # its MLP width for dense layers (none here) must be set
        out.update(intermediate_size=moe.d_expert, qkv_bias=cfg.qkv_bias)
    return out


def save_hf_moe(model: DecoderLM, directory, *, tokenizer=None) -> Path:
    """Write ``model`` as a Hugging Face directory (``config.json`` and ``model.safetensors``)
    of the family whose layers it has (Mixtral for a plain MoE decoder; Qwen2-MoE, Qwen3-MoE
    or OLMoE for one imported from them); :func:`load_hf_moe` reads it back bit for bit.
    ``tokenizer`` (a :class:`moejax.io.hf_tokenizer.HFTokenizer`, e.g. the imported one):
    its ``tokenizer.json`` beside them and its bos / eos / pad ids in the config and in
    ``generation_config.json``.

    A directory holding another checkpoint's files that would stay beside these and be read
    as this model's is refused before anything is written: a shard index, a tokenizer's
    settings (``tokenizer_config.json`` ...), and, saved without a tokenizer, a
    ``tokenizer.json`` or ``generation_config.json``."""
    cfg = model.cfg
    kind = _family_of(cfg)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"save_hf_moe: the tokenizer has {tokenizer.vocab_size} tokens, more "
                         f"than the model's vocab_size={cfg.vocab_size}")
    fam = FAMILIES[kind]
    inverse = {ours: (hf, t) for hf, (ours, t) in layer_tensors(fam, cfg.qkv_bias).items()}
    directory = Path(directory)
    if (directory / "model.safetensors.index.json").exists():
        raise ValueError(
            f"save_hf_moe: {directory} holds a sharded checkpoint "
            "(model.safetensors.index.json and its shards); its files would stay beside this "
            "model's, and a reader that takes the index would load them instead. Fix: save "
            "into a new directory")
    _refuse_other_tokenizer(directory, tokenizer)
    writable_dir(directory, "save_hf_moe", "save into a writable directory")
    out: dict[str, np.ndarray] = {}
    for name, value in flat_params(model).items():
        value = np.asarray(value)
        for hf_name, expert, transpose in _names_for(name, cfg, fam, inverse):
            v = value[expert] if expert is not None else value
            out[hf_name] = np.ascontiguousarray(v.T if transpose else v)
    export_params(out, directory / "model.safetensors", metadata={"format": "pt"})
    config = _hf_config(kind, cfg)
    if tokenizer is not None:
        atomic_write_text(directory / "tokenizer.json", tokenizer.tokenizer.to_str())
        ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_id") for k in ("bos", "eos", "pad")}
        config.update(ids)
        atomic_write_text(directory / "generation_config.json", json.dumps(ids, indent=2) + "\n")
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")
    return directory


def _refuse_other_tokenizer(directory: Path, tokenizer) -> None:
    """ValueError naming the files of another tokenizer in ``directory`` that this save
    would leave beside the model: its settings, and without ``tokenizer`` its
    ``tokenizer.json`` and ``generation_config.json`` (the ids generation starts and stops
    on), which a reader would take as this model's."""
    names = list(_TOKENIZER_SETTINGS)
    if tokenizer is None:
        names += ["tokenizer.json", "generation_config.json"]
    stale = [n for n in names if (directory / n).exists()]
    if not stale:
        return
    fix = "save into a new directory"
    if tokenizer is None and "tokenizer.json" in stale:
        fix += (", or pass the model's tokenizer (tokenizer=, e.g. tokenizer_from_hf_dir of "
                "the directory it was imported from)")
    raise ValueError(
        f"save_hf_moe: {directory} holds {', '.join(stale)} of another tokenizer; they would "
        "stay beside this model, and a reader (tokenizer_from_hf_dir, transformers' "
        f"AutoTokenizer) would take them as its own. Fix: {fix}")


def _names_for(name: str, cfg: DecoderConfig, fam: HFMoEFamily, inverse: dict
               ) -> list[tuple[str, int | None, bool]]:
    """The family's tensors of one moejax parameter (the inverse of :func:`_moejax_name`;
    ``inverse``: moejax name in a block -> (HF name, transposed))."""
    n_experts = cfg.ffn_slots[0].n_experts
    candidates = {"embed": "model.embed_tokens.weight", "w_head": "lm_head.weight",
                  "final_norm/scale": "model.norm.weight"}
    if name in candidates:
        return [(candidates[name], None, name == "w_head")]
    _, layer, rest = name.split("/", 2)
    pre = f"model.layers.{layer}."
    if rest.startswith("ffn/experts/"):
        hf = fam.experts[rest.rsplit("/", 1)[1]]
        return [(f"{pre}{fam.moe}.experts.{j}.{hf}.weight", j, True) for j in range(n_experts)]
    hf, transpose = inverse[rest]
    return [(pre + hf, None, transpose)]
