"""Hugging Face MoE checkpoints in and out: Mixtral ``config.json`` + (sharded)
``*.safetensors`` <-> :class:`moejax.nn.decoder.DecoderLM` with an MoE FFN in every block.

    model = load_hf_moe("path/to/mixtral")      # a DecoderLM equal to transformers' forward
    save_hf_moe(model, "out/dir")               # config.json + model.safetensors, Mixtral layout

Layout (safetensors ``[out, in]``; moejax ``[in, out]``; experts stacked on a leading axis):

==========================================================  =================================
Mixtral tensor                                              moejax parameter
==========================================================  =================================
``model.embed_tokens.weight`` [V, D]                        ``embed``
``lm_head.weight`` [V, D]                                   ``w_head`` [D, V] (untied)
``model.layers.i.input_layernorm.weight``                   ``blocks/i/attn_norm/scale``
``model.layers.i.self_attn.{q,k,v,o}_proj.weight``          ``blocks/i/attn/w_{q,k,v,o}``
``model.layers.i.post_attention_layernorm.weight``          ``blocks/i/ffn_norm/scale``
``model.layers.i.block_sparse_moe.gate.weight`` [E, D]      ``blocks/i/ffn/router/w_g`` [D, E]
``model.layers.i.block_sparse_moe.experts.j.w1`` [F, D]     ``blocks/i/ffn/experts/w_gate[j]``
``model.layers.i.block_sparse_moe.experts.j.w3`` [F, D]     ``blocks/i/ffn/experts/w_up[j]``
``model.layers.i.block_sparse_moe.experts.j.w2`` [D, F]     ``blocks/i/ffn/experts/w_down[j]``
``model.norm.weight``                                       ``final_norm/scale``
==========================================================  =================================

Mixtral routes with a softmax over every expert's logit, keeps the top k and renormalises
them (the same as a softmax over the k kept logits): the softmax router with
``renormalize=True``. RoPE is the "rotate half" layout (``rope_style="half"``), so q and k
need no permutation. Every setting is read from ``config.json``; a ``model_type`` other than
``mixtral``, or an option the layers lack (a sliding window, router jitter, attention
biases), is refused in one line naming the key. The shards are read one at a time; each
tensor goes to its place as its shard is read, and a layer's stacked experts are assembled
from their shards before they leave the host. bf16 files stay bf16 (the model's
``param_dtype``).

Qwen2-MoE / Qwen3-MoE (a sigmoid-gated shared expert, q/k/v biases or per-head q/k norms)
and OLMoE (q/k norms) need layers moejax's decoder does not have yet; they are refused,
naming what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from flax import nnx

from moejax.files import atomic_write_text
from moejax.io._common import WeightFileError, build_with_params, flat_params
from moejax.io.safetensors_io import export_params, read_safetensors
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern

__all__ = ["hf_moe_config", "load_hf_moe", "save_hf_moe", "UNSUPPORTED_FAMILIES"]

UNSUPPORTED_FAMILIES = {
    "qwen2_moe": "a sigmoid-gated shared expert and q/k/v biases",
    "qwen3_moe": "per-head q/k RMSNorms",
    "olmoe": "q/k RMSNorms",
}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
# A block's tensors other than its experts: Mixtral name -> (moejax name, transposed)
_LAYER_TENSORS = {"input_layernorm.weight": ("attn_norm/scale", False),
                  "post_attention_layernorm.weight": ("ffn_norm/scale", False),
                  "self_attn.q_proj.weight": ("attn/w_q", True),
                  "self_attn.k_proj.weight": ("attn/w_k", True),
                  "self_attn.v_proj.weight": ("attn/w_v", True),
                  "self_attn.o_proj.weight": ("attn/w_o", True),
                  "block_sparse_moe.gate.weight": ("ffn/router/w_g", True)}
_FIX = "convert it to a Mixtral checkpoint, or load it with transformers"


def _refuse(path, key: str, value, why: str) -> WeightFileError:
    return WeightFileError(path, f"config.json: {key}={value!r}: {why}", _FIX)


def hf_moe_config(config_json, *, dispatch: str = "auto", **overrides) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Mixtral ``config.json`` (every MoE setting read from
    it; anything the layers cannot reproduce refused, naming the key); ``dispatch``: the MoE
    layers' dispatch path (:mod:`moejax.kernels.moe_dispatch`)."""
    path = Path(config_json)
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightFileError(path, f"unreadable config.json ({type(e).__name__}: {e})",
                              _FIX) from None
    kind = c.get("model_type")
    if kind in UNSUPPORTED_FAMILIES:
        raise _refuse(path, "model_type", kind, f"needs {UNSUPPORTED_FAMILIES[kind]}, which "
                      "moejax's decoder layers do not have")
    if kind != "mixtral":
        raise _refuse(path, "model_type", kind, "only 'mixtral' is read")
    for key, ok in (("sliding_window", None), ("router_jitter_noise", 0.0),
                    ("attention_bias", False), ("mlp_bias", False)):
        if c.get(key, ok) not in (ok, 0):
            raise _refuse(path, key, c[key], "moejax's layers have no such option")
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse(path, "hidden_act", c["hidden_act"], "the experts are SwiGLU (silu)")
    if c.get("rope_scaling"):
        raise _refuse(path, "rope_scaling", c["rope_scaling"], "plain RoPE only")
    dtype = _DTYPES.get(str(c.get("torch_dtype") or c.get("dtype") or "float32"), "float32")
    n_layers, d = int(c["num_hidden_layers"]), int(c["hidden_size"])
    moe = MoEConfig(n_experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                    d_expert=int(c["intermediate_size"]), activation="swiglu",
                    router="softmax", renormalize=True, balance_loss="switch",
                    balance_coef=float(c.get("router_aux_loss_coef", 0.02)),
                    dispatch=dispatch, **({"capacity_factor": float(c["num_local_experts"])}
                                          if "capacity" in dispatch else {}))
    n_heads = int(c["num_attention_heads"])
    base = dict(vocab_size=int(c["vocab_size"]), d_model=d, n_layers=n_layers,
                n_heads=n_heads, n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
                head_dim=int(c.get("head_dim") or d // n_heads),
                max_seq_len=int(c.get("max_position_embeddings", 2048)),
                rope_base=float(c.get("rope_theta", 10000.0)), rope_style="half",
                norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                dtype=dtype, param_dtype=dtype,
                ffn_slots=layer_pattern(n_layers, moe, moe, every=1))
    base.update(overrides)
    return DecoderConfig(**base)


def _shards(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightFileError(index, f"unreadable shard index ({type(e).__name__}: {e})",
                                  _FIX) from None
        return [directory / name for name in dict.fromkeys(weight_map.values())]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise WeightFileError(directory, "holds neither model.safetensors nor "
                              "model.safetensors.index.json", _FIX)
    return [single]


def _moejax_name(name: str) -> tuple[str, int | None, bool] | None:
    """``(moejax parameter, expert index or None, transpose)`` of a Mixtral tensor name."""
    if name == "model.embed_tokens.weight":
        return "embed", None, False
    if name == "lm_head.weight":
        return "w_head", None, True
    if name == "model.norm.weight":
        return "final_norm/scale", None, False
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    o, rest = f"blocks/{parts[2]}/", ".".join(parts[3:])
    if rest in _LAYER_TENSORS:
        target, transpose = _LAYER_TENSORS[rest]
        return o + target, None, transpose
    if (len(parts) == 8 and parts[3:5] == ["block_sparse_moe", "experts"]
            and parts[5].isdigit() and parts[7] == "weight"):
        which = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}.get(parts[6])
        if which is not None:
            return o + f"ffn/experts/{which}", int(parts[5]), True
    return None


def _tensors(directory: Path) -> Iterator[tuple[Path, str, np.ndarray]]:
    for shard in _shards(directory):
        tensors, _ = read_safetensors(shard, fix=_FIX)
        for name, value in tensors.items():
            yield shard, name, value
        del tensors


def load_hf_moe(directory, *, dispatch: str = "auto", **config_overrides) -> DecoderLM:
    """A :class:`DecoderLM` from a Hugging Face Mixtral directory (module docstring), its MoE
    layers on the ``dispatch`` path (a capacity path gets capacity for every token: Mixtral
    drops none); ``config_overrides`` go to the :class:`DecoderConfig` (e.g.
    ``max_seq_len``)."""
    directory = Path(directory)
    cfg = hf_moe_config(directory / "config.json", dispatch=dispatch, **config_overrides)
    want = flat_params(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))
    params: dict[str, np.ndarray] = {}
    stacks: dict[str, np.ndarray] = {}
    filled: dict[str, set[int]] = {}
    for shard, name, value in _tensors(directory):
        found = _moejax_name(name)
        if found is None or found[0] not in want:
            raise WeightFileError(shard, f"unexpected tensor {name!r} for the config's "
                                  f"{cfg.n_layers} layers and {cfg.ffn_slots[0].n_experts} "
                                  "experts", "the file's config and tensors disagree")
        target, expert, transpose = found
        value = value.T if transpose else value
        if expert is None:
            params[target] = value
            continue
        if expert >= want[target].shape[0]:
            raise WeightFileError(shard, f"tensor {name!r} names expert {expert} of "
                                  f"{want[target].shape[0]}", "the config and tensors disagree")
        if target not in stacks:
            stacks[target] = np.zeros(want[target].shape, value.dtype)
            filled[target] = set()
        stacks[target][expert] = value
        filled[target].add(expert)
    for target, stack in stacks.items():
        if len(filled[target]) != stack.shape[0]:
            missing = sorted(set(range(stack.shape[0])) - filled[target])
            raise WeightFileError(directory, f"{target}: experts {missing} are missing",
                                  "the checkpoint is incomplete")
        params[target] = stack
    return build_with_params(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), params, directory)


def _mixtral_config(cfg: DecoderConfig) -> dict:
    moe = cfg.ffn_slots[0]
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": moe.d_expert, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_base, "rms_norm_eps": cfg.norm_eps,
        "num_local_experts": moe.n_experts, "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.balance_coef, "sliding_window": None,
        "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.param_dtype, "attention_dropout": 0.0, "router_jitter_noise": 0.0,
    }


def _exportable(cfg: DecoderConfig) -> None:
    slots = cfg.ffn_slots
    moe = slots[0]
    why = None
    if not all(type(s) is MoEConfig for s in slots):
        why = ("every block's FFN must be a plain MoE (MoEConfig): BlockFFN, DeRS and other "
               "slots have no Hugging Face family; synthesise DeRS experts to dense first")
    elif any(s != moe for s in slots):
        why = "every block's MoE must have the same config"
    elif moe.activation != "swiglu" or moe.router != "softmax" or not moe.renormalize:
        why = "Mixtral's experts are SwiGLU with a renormalised softmax top-k router"
    elif moe.n_shared_experts or moe.universal_ffn:
        why = "Mixtral has no shared or universal experts"
    elif cfg.rope_style != "half":
        why = "Mixtral's RoPE is the rotate-half layout (rope_style='half')"
    if why:
        raise ValueError(f"save_hf_moe: this model has no Mixtral layout: {why}")


def save_hf_moe(model: DecoderLM, directory) -> Path:
    """Write ``model`` as a Hugging Face Mixtral directory (``config.json`` and
    ``model.safetensors``); :func:`load_hf_moe` reads it back bit for bit."""
    cfg = model.cfg
    _exportable(cfg)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, np.ndarray] = {}
    for name, value in flat_params(model).items():
        value = np.asarray(value)
        for hf_name, expert, transpose in _names_for(name, cfg):
            v = value[expert] if expert is not None else value
            out[hf_name] = np.ascontiguousarray(v.T if transpose else v)
    export_params(out, directory / "model.safetensors", metadata={"format": "pt"})
    atomic_write_text(directory / "config.json", json.dumps(_mixtral_config(cfg), indent=2)
                      + "\n")
    return directory


def _names_for(name: str, cfg: DecoderConfig) -> list[tuple[str, int | None, bool]]:
    """The Mixtral tensors of one moejax parameter (the inverse of :func:`_moejax_name`)."""
    n_experts = cfg.ffn_slots[0].n_experts
    candidates = {"embed": "model.embed_tokens.weight", "w_head": "lm_head.weight",
                  "final_norm/scale": "model.norm.weight"}
    if name in candidates:
        return [(candidates[name], None, name == "w_head")]
    _, layer, rest = name.split("/", 2)
    pre = f"model.layers.{layer}."
    if rest.startswith("ffn/experts/"):
        hf = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}[rest.rsplit("/", 1)[1]]
        return [(f"{pre}block_sparse_moe.experts.{j}.{hf}.weight", j, True)
                for j in range(n_experts)]
    hf, (_, transpose) = next((k, v) for k, v in _LAYER_TENSORS.items() if v[0] == rest)
    return [(pre + hf, None, transpose)]

