"""Real Hugging Face MoE checkpoints by name: the fields of their published ``config.json``
that :func:`moejax.io.hf_moe.hf_moe_config` reads, so a full preset can be proven at their
shapes (:mod:`moejax.train.aot`) on a machine that has neither their weights nor room for
them. The weights themselves are passed as ``hf:<dir>`` on the machine that has them.

    cfg = hf_moe_config(CHECKPOINTS["OLMoE-1B-7B-0924"])   # the DecoderConfig, no weights
"""

from __future__ import annotations

import types

__all__ = ["CHECKPOINTS"]

_OLMOE_1B_7B = {  # allenai/OLMoE-1B-7B-0924: 64 experts, top 8, 6.9B parameters (1.3B active)
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": False, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-5, "vocab_size": 50304,
    "tie_word_embeddings": False, "attention_bias": False, "clip_qkv": None,
    "router_aux_loss_coef": 0.01, "torch_dtype": "float32",
}
_QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B: 60 experts, top 4, a gated shared expert
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "use_sliding_window": False, "max_position_embeddings": 8192,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "vocab_size": 151936,
    "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
}

# read-only: a study's proof must not change what another one reads
CHECKPOINTS = types.MappingProxyType({
    "OLMoE-1B-7B-0924": types.MappingProxyType(_OLMOE_1B_7B),
    "Qwen1.5-MoE-A2.7B": types.MappingProxyType(_QWEN15_MOE_A27B),
})
