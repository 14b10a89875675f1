"""Hugging Face MoE checkpoints in: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE ``config.json`` +
(sharded) ``*.safetensors`` -> :class:`moejax.nn.decoder.DecoderLM` with an MoE FFN in every
block (:mod:`moejax.io.hf_moe_save` writes them back out).

    model = load_hf_moe("path/to/checkpoint")   # a DecoderLM equal to transformers' forward

Layout (safetensors ``[out, in]``; moejax ``[in, out]``; experts stacked on a leading axis;
``<moe>`` is ``block_sparse_moe`` in Mixtral, ``mlp`` in the others; Mixtral's expert
matrices are ``w1`` / ``w3`` / ``w2``, the others' ``gate_proj`` / ``up_proj`` /
``down_proj``):

===============================================================  ==============================
Hugging Face tensor                                              moejax parameter
===============================================================  ==============================
``model.embed_tokens.weight`` [V, D]                             ``embed``
``lm_head.weight`` [V, D]                                        ``w_head`` [D, V] (untied)
``model.layers.i.input_layernorm.weight``                        ``blocks/i/attn_norm/scale``
``model.layers.i.self_attn.{q,k,v,o}_proj.weight``               ``blocks/i/attn/w_{q,k,v,o}``
``model.layers.i.self_attn.{q,k,v}_proj.bias`` (Qwen2-MoE)       ``blocks/i/attn/b_{q,k,v}``
``model.layers.i.self_attn.{q,k}_norm.weight`` (Qwen3, OLMoE)    ``blocks/i/attn/{q,k}_norm/scale``
``model.layers.i.post_attention_layernorm.weight``               ``blocks/i/ffn_norm/scale``
``model.layers.i.<moe>.gate.weight`` [E, D]                      ``blocks/i/ffn/router/w_g``
``model.layers.i.<moe>.experts.j.<gate>.weight`` [F, D]          ``blocks/i/ffn/experts/w_gate[j]``
``model.layers.i.<moe>.experts.j.<up>.weight`` [F, D]            ``blocks/i/ffn/experts/w_up[j]``
``model.layers.i.<moe>.experts.j.<down>.weight`` [D, F]          ``blocks/i/ffn/experts/w_down[j]``
``model.layers.i.mlp.shared_expert.*_proj.weight`` (Qwen2-MoE)   ``blocks/i/ffn/shared/w_*``
``model.layers.i.mlp.shared_expert_gate.weight`` [1, D]          ``blocks/i/ffn/w_shared_gate``
``model.norm.weight``                                            ``final_norm/scale``
===============================================================  ==============================

What each family's import reads from ``config.json``:

* **Mixtral**: a softmax over every expert's logit, the top k kept and renormalised (the
  softmax router with ``renormalize=True``).
* **Qwen2-MoE**: the same router, renormalised only where ``norm_topk_prob`` says so; q, k
  and v projections with biases; one shared expert of ``shared_expert_intermediate_size``
  whose output a per-token sigmoid gate scales (``MoEConfig.shared_gate``).
* **Qwen3-MoE**: the router as Qwen2-MoE's; an RMSNorm on each head's queries and keys
  before RoPE (``qk_norm="head"``); no shared expert.
* **OLMoE**: a softmax over all experts, then the top k, renormalised only where
  ``norm_topk_prob`` says so (by default not); RMSNorms over the whole q and k projections
  (``qk_norm="full"``).

RoPE is the "rotate half" layout in all four (``rope_style="half"``), so q and k need no
permutation. Its base is read where transformers 5 writes it (``rope_parameters``) or where 4
did (``rope_theta``). A key the file leaves out takes the default of the family's
transformers config class (e.g. Mixtral's RoPE base 1e6, the Qwens' RMSNorm epsilon 1e-6,
Mixtral's 8 key/value heads). An unknown ``model_type``, or an option the layers lack (a
sliding window, router jitter, rope scaling or partial rotary, dense layers between the
sparse ones, clipped q/k/v, attention biases where the family has none), is refused in one
line naming the key. The shards are read
one at a time; each tensor goes to its place as its shard is read, and a layer's stacked
experts are assembled from their shards before they leave the host. bf16 files stay bf16 (the
model's ``param_dtype``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.io._common import WeightFileError, build_with_params, check_values, flat_params
from moejax.io.safetensors_io import read_safetensors
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern

__all__ = ["hf_moe_config", "hf_checkpoint_dir", "hf_spec_config", "load_hf_moe",
           "layer_tensors", "FAMILIES", "HFMoEFamily"]

_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class HFMoEFamily:
    """What one Hugging Face MoE family's checkpoint holds and how its config names it."""

    architecture: str
    moe: str  # the MoE block's module name in a layer
    experts: dict  # moejax expert matrix -> the family's name
    d_expert_key: str
    n_experts_key: str
    renormalize_key: str | None  # None: always renormalised (Mixtral)
    qk_norm: str = "none"
    qkv_bias: bool = False  # q/k/v biases as the config's "qkv_bias" says (default: present)
    shared: bool = False
    # config keys whose value must be this (a layer moejax lacks otherwise)
    required: tuple = ()
    # what transformers' config class takes for a key config.json leaves out
    defaults: dict = dataclasses.field(default_factory=dict)

    def get(self, c: dict, key: str):
        """``c[key]``, or the family's default where ``config.json`` leaves it out (or null)."""
        value = c.get(key)
        return self.defaults[key] if value is None else value


def _defaults(rope_theta, rms_norm_eps, max_positions, aux_coef, kv_heads) -> dict:
    return {"rope_theta": rope_theta, "rms_norm_eps": rms_norm_eps,
            "max_position_embeddings": max_positions, "router_aux_loss_coef": aux_coef,
            "num_key_value_heads": kv_heads}  # None: as many as the query heads


FAMILIES = {
    "mixtral": HFMoEFamily(
        "MixtralForCausalLM", "block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"},
        "intermediate_size", "num_local_experts", None,
        required=(("sliding_window", None), ("router_jitter_noise", 0.0),
                  ("attention_bias", False), ("mlp_bias", False)),
        defaults=_defaults(1e6, 1e-5, 4096 * 32, 0.001, 8)),
    "qwen2_moe": HFMoEFamily(
        "Qwen2MoeForCausalLM", "mlp", _PROJ, "moe_intermediate_size", "num_experts",
        "norm_topk_prob", qkv_bias=True, shared=True,
        required=(("use_sliding_window", False), ("decoder_sparse_step", 1),
                  ("mlp_only_layers", [])),
        defaults=_defaults(10000.0, 1e-6, 32768, 0.001, 16)),
    "qwen3_moe": HFMoEFamily(
        "Qwen3MoeForCausalLM", "mlp", _PROJ, "moe_intermediate_size", "num_experts",
        "norm_topk_prob", qk_norm="head",
        required=(("use_sliding_window", False), ("decoder_sparse_step", 1),
                  ("mlp_only_layers", []), ("attention_bias", False)),
        defaults=_defaults(10000.0, 1e-6, 32768, 0.001, 4)),
    "olmoe": HFMoEFamily(
        "OlmoeForCausalLM", "mlp", _PROJ, "intermediate_size", "num_experts", "norm_topk_prob",
        qk_norm="full", required=(("clip_qkv", None), ("attention_bias", False)),
        defaults=_defaults(10000.0, 1e-5, 4096, 0.01, None)),
}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
_FIX = "convert it to a supported family, or load it with transformers"
_GIVE_DIR = ("give the directory of a Hugging Face checkpoint, which holds its config.json and "
             "*.safetensors shards")


def _refuse(path, key: str, value, why: str) -> WeightFileError:
    return WeightFileError(path, f"config.json: {key}={value!r}: {why}", _FIX)


def _family(path: Path, c: dict) -> tuple[str, HFMoEFamily]:
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise _refuse(path, "model_type", kind, f"moejax reads {', '.join(FAMILIES)}")
    fam = FAMILIES[kind]
    for key, ok in fam.required:
        if key in c and c[key] != ok and not (ok is None and c[key] in (0, None)):
            raise _refuse(path, key, c[key], f"moejax's layers need {ok!r} here")
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse(path, "hidden_act", c["hidden_act"], "the experts are SwiGLU (silu)")
    return kind, fam


def _rope_base(path: Path, c: dict, fam: HFMoEFamily) -> float:
    """RoPE's base, where transformers 5 keeps it (``rope_parameters``, or ``rope_scaling``,
    its older name), else at the top level (transformers 4), else the family's default;
    anything but one plain RoPE for every layer is refused."""
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    params = c.get(key) or {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise _refuse(path, key, params, "one plain RoPE for every layer only")
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise _refuse(path, key, params, "plain RoPE only")
    for where, factor in ((key, params.get("partial_rotary_factor")),
                          ("partial_rotary_factor", c.get("partial_rotary_factor"))):
        if factor not in (None, 1, 1.0):
            raise _refuse(path, where, params if where == key else factor,
                          "RoPE over the whole head only")
    theta = params.get("rope_theta")
    return float(fam.get(c, "rope_theta") if theta is None else theta)


def hf_checkpoint_dir(spec: str, key: str) -> Path:
    """The directory an ``hf:<dir>`` config value names (``key=spec``), with its
    ``config.json`` and ``tokenizer.json``; ``ValueError`` naming ``key`` otherwise."""
    d = Path(spec.removeprefix("hf:"))
    if not (spec.startswith("hf:") and (d / "config.json").is_file()
            and (d / "tokenizer.json").is_file()):
        raise ValueError(f"{key}={spec!r}: give hf:<dir> of a Hugging Face MoE checkpoint "
                         "with config.json and tokenizer.json, or leave it ''")
    return d


def hf_spec_config(spec: str, key: str) -> DecoderConfig:
    """The :class:`DecoderConfig` of the checkpoint an ``hf:<dir>`` config value names
    (:func:`hf_checkpoint_dir`, :func:`hf_moe_config`)."""
    return hf_moe_config(hf_checkpoint_dir(spec, key) / "config.json")


def hf_moe_config(config_json, *, dispatch: str = "auto", **overrides) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE ``config.json``
    (a path, or its fields as a mapping, e.g. :data:`moejax.io.hf_moe_checkpoints.
    CHECKPOINTS`; every setting read from it; anything the layers cannot reproduce refused,
    naming the key); ``dispatch``: the MoE layers' dispatch path
    (:mod:`moejax.kernels.moe_ffn.api`)."""
    if isinstance(config_json, Mapping):
        path, c = Path("<config.json>"), dict(config_json)
    else:
        path = Path(config_json)
        try:
            c = json.loads(path.read_text())
        except FileNotFoundError:
            raise WeightFileError(path, "no such file", _GIVE_DIR) from None
        except NotADirectoryError:
            raise WeightFileError(path.parent, "a file, not a checkpoint directory",
                                  _GIVE_DIR) from None
        except (OSError, ValueError) as e:
            raise WeightFileError(path, f"unreadable config.json ({type(e).__name__}: {e})",
                                  "copy the checkpoint's config.json again") from None
    kind, fam = _family(path, c)
    rope_base = _rope_base(path, c, fam)
    try:
        return _decoder_config(c, fam, dispatch, rope_base, overrides)
    except KeyError as e:
        raise WeightFileError(path, f"config.json has no {e.args[0]!r}, which a {kind} "
                              "config needs", _FIX) from None


def _decoder_config(c: dict, fam: HFMoEFamily, dispatch: str, rope_base: float,
                    overrides: dict) -> DecoderConfig:
    dtype = _DTYPES.get(str(c.get("torch_dtype") or c.get("dtype") or "float32"), "float32")
    n_layers, d = int(c["num_hidden_layers"]), int(c["hidden_size"])
    n_experts = int(c[fam.n_experts_key])
    shared = {}
    if fam.shared:
        shared = dict(n_shared_experts=1, d_shared=int(c["shared_expert_intermediate_size"]),
                      shared_gate=True)
    moe = MoEConfig(n_experts=n_experts, top_k=int(c["num_experts_per_tok"]),
                    d_expert=int(c[fam.d_expert_key]), activation="swiglu",
                    router="softmax", balance_loss="switch",
                    renormalize=(True if fam.renormalize_key is None
                                 else bool(c.get(fam.renormalize_key, False))),
                    balance_coef=float(fam.get(c, "router_aux_loss_coef")),
                    dispatch=dispatch, **shared,
                    **({"capacity_factor": float(n_experts)} if "capacity" in dispatch else {}))
    n_heads = int(c["num_attention_heads"])
    base = dict(vocab_size=int(c["vocab_size"]), d_model=d, n_layers=n_layers,
                n_heads=n_heads, n_kv_heads=int(fam.get(c, "num_key_value_heads") or n_heads),
                head_dim=int(c.get("head_dim") or d // n_heads),
                max_seq_len=int(fam.get(c, "max_position_embeddings")),
                rope_base=rope_base, rope_style="half",
                norm_eps=float(fam.get(c, "rms_norm_eps")),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                dtype=dtype, param_dtype=dtype, qk_norm=fam.qk_norm,
                qkv_bias=fam.qkv_bias and bool(c.get("qkv_bias", True)),
                ffn_slots=layer_pattern(n_layers, moe, moe, every=1))
    base.update(overrides)
    return DecoderConfig(**base)


def layer_tensors(fam: HFMoEFamily, qkv_bias: bool) -> dict[str, tuple[str, bool]]:
    """A block's tensors other than its routed experts: HF name -> (moejax name,
    transposed)."""
    out = {"input_layernorm.weight": ("attn_norm/scale", False),
           "post_attention_layernorm.weight": ("ffn_norm/scale", False),
           f"{fam.moe}.gate.weight": ("ffn/router/w_g", True)}
    for x in "qkvo":
        out[f"self_attn.{x}_proj.weight"] = (f"attn/w_{x}", True)
    if qkv_bias:
        out.update({f"self_attn.{x}_proj.bias": (f"attn/b_{x}", False) for x in "qkv"})
    if fam.qk_norm != "none":
        out.update({f"self_attn.{x}_norm.weight": (f"attn/{x}_norm/scale", False)
                    for x in "qk"})
    if fam.shared:
        out.update({f"mlp.shared_expert.{hf}.weight": (f"ffn/shared/{ours}", True)
                    for ours, hf in _PROJ.items()})
        out["mlp.shared_expert_gate.weight"] = ("ffn/w_shared_gate", True)
    return out


def _shards(directory: Path) -> list[Path]:
    """The weight files of ``directory`` in transformers' order: ``model.safetensors`` where
    there is one, else the shards its ``model.safetensors.index.json`` names."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightFileError(index, f"unreadable shard index ({type(e).__name__}: {e})",
                                  _FIX) from None
        shards = []
        for name in dict.fromkeys(weight_map.values()):
            shard = directory / str(name)
            if shard.resolve().parent != directory.resolve():
                raise WeightFileError(index, f"names shard {name!r}, outside its directory",
                                      "the index must name files beside it")
            if not shard.is_file():
                raise WeightFileError(index, f"names shard {name!r}, which is missing",
                                      "the checkpoint is incomplete: download every shard")
            shards.append(shard)
        return shards
    raise WeightFileError(directory, "holds neither model.safetensors nor "
                          "model.safetensors.index.json", _FIX)


def _moejax_name(name: str, fam: HFMoEFamily, per_layer: dict
                 ) -> tuple[str, int | None, bool] | None:
    """``(moejax parameter, expert index or None, transpose)`` of one of ``fam``'s tensor
    names (``per_layer``: :func:`layer_tensors` of ``fam``)."""
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
    if rest in per_layer:
        target, transpose = per_layer[rest]
        return o + target, None, transpose
    if (len(parts) == 8 and parts[3:5] == [fam.moe, "experts"]
            and parts[5].isdigit() and parts[7] == "weight"):
        which = {hf: ours for ours, hf in fam.experts.items()}.get(parts[6])
        if which is not None:
            return o + f"ffn/experts/{which}", int(parts[5]), True
    return None


def _tensors(directory: Path) -> Iterator[tuple[Path, str, np.ndarray]]:
    for shard in _shards(directory):
        tensors, _ = read_safetensors(shard, fix=_FIX)
        for name, value in tensors.items():
            yield shard, name, value
        del tensors


def load_hf_moe(directory, *, dispatch: str = "auto", shardings=None,
                **config_overrides) -> DecoderLM:
    """A :class:`DecoderLM` from a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
    directory (module docstring), its MoE layers on the ``dispatch`` path (a capacity path gets
    capacity for every token: the families drop none); ``config_overrides`` go to the
    :class:`DecoderConfig` (e.g. ``max_seq_len``).

    ``shardings``: where each parameter lives, ``shardings(name, shape) ->
    jax.sharding.Sharding`` (``name`` as in :func:`moejax.io.flat_params`, e.g.
    ``blocks/0/ffn/experts/w_up``), or None for the default device. Every tensor is checked,
    cast to the model's dtype and put in its place as its shard is read, and a layer's
    experts are stacked on the device, so the host holds one shard's tensors at a time."""
    directory = Path(directory)
    cfg = hf_moe_config(directory / "config.json", dispatch=dispatch, **config_overrides)
    fam = FAMILIES[json.loads((directory / "config.json").read_text())["model_type"]]
    per_layer = layer_tensors(fam, cfg.qkv_bias)
    want = flat_params(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))

    def place(target, value):
        value = jnp.asarray(value, want[target].dtype)  # on the default device
        where = None if shardings is None else shardings(target, value.shape)
        return value if where is None else jax.device_put(value, where)

    params: dict[str, jax.Array] = {}
    experts: dict[str, dict[int, jax.Array]] = {}
    seen: dict[str, str] = {}  # tensor name -> the shard that held it
    for shard, name, value in _tensors(directory):
        if name in seen:
            raise WeightFileError(shard, f"tensor {name!r} appears twice (also in "
                                  f"{seen[name]})", "the checkpoint's shards overlap")
        seen[name] = shard.name
        found = _moejax_name(name, fam, per_layer)
        if found is None or found[0] not in want:
            raise WeightFileError(shard, f"unexpected tensor {name!r} for the config's "
                                  f"{cfg.n_layers} layers and {cfg.ffn_slots[0].n_experts} "
                                  "experts", "the file's config and tensors disagree")
        target, expert, transpose = found
        shape = want[target].shape if expert is None else want[target].shape[1:]
        file_shape = tuple(shape[::-1] if transpose else shape)  # the file's orientation
        if value.shape != file_shape or value.dtype.kind in "iub":
            raise WeightFileError(shard, f"tensor {name!r} is {value.dtype} "
                                  f"{tuple(value.shape)}; the config's is {file_shape} "
                                  "floats", "the config and tensors disagree")
        value = value.T if transpose else value
        check_values({name: value}, {name: jax.ShapeDtypeStruct(shape, want[target].dtype)},
                     shard)  # here, while the host has it
        if expert is None:
            params[target] = place(target, value)
            continue
        if expert >= want[target].shape[0]:
            raise WeightFileError(shard, f"tensor {name!r} names expert {expert} of "
                                  f"{want[target].shape[0]}", "the config and tensors disagree")
        experts.setdefault(target, {})[expert] = jnp.asarray(value, want[target].dtype)
        if len(experts[target]) == want[target].shape[0]:  # the layer's stack is complete
            have = experts.pop(target)
            params[target] = place(target, jnp.stack([have[j] for j in range(len(have))]))
    for target, have in experts.items():
        missing = sorted(set(range(want[target].shape[0])) - set(have))
        raise WeightFileError(directory, f"{target}: experts {missing} are missing",
                              "the checkpoint is incomplete")
    return build_with_params(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), params, directory,
                             values_checked=True)
