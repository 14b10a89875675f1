"""Make the tiny Hugging Face MoE checkpoints the suite imports, with transformers' own
``save_pretrained``, and transformers' logits on fixed prompts beside them (not run by CI;
needs torch and transformers, e.g. a separate virtualenv):

    python scripts/make_hf_moe_fixtures.py tests/fixtures/hf_moe            # make all
    python scripts/make_hf_moe_fixtures.py tests/fixtures/hf_moe olmoe      # make one
    python scripts/make_hf_moe_fixtures.py tests/fixtures/hf_moe --check DIR  # logits of an
                                                                          # exported DIR

Each family gets ``<out>/<family>/``: ``config.json``, ``model.safetensors`` (float32),
``prompts.npy`` (int32 [B, T]) and ``logits.npy`` (float32 [B, T, V], transformers' eager
attention). ``--check`` loads a directory moejax exported and writes its ``logits.npy``
(``<DIR>/transformers_logits.npy``) from the same prompts, to be compared with moejax's.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        tie_word_embeddings=False, attn_implementation="eager"),
    # one gated shared expert, q/k/v biases, top-k weights not renormalised
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
        rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
        tie_word_embeddings=False, attn_implementation="eager"),
    # per-head q/k RMSNorms, a head_dim that is not hidden / heads, renormalised top-k
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        use_sliding_window=False, tie_word_embeddings=False, attn_implementation="eager"),
    # q/k RMSNorms over the whole projections, softmax over all experts then top-k
    "olmoe": lambda: transformers.OlmoeConfig(
        vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, clip_qkv=None, tie_word_embeddings=False,
        attn_implementation="eager"),
}


def prompts(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (2, 11)).astype(np.int32)


def logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def char_tokenizer(vocab_size: int, path: Path) -> None:
    """A character-level ``tokenizer.json`` of ``vocab_size`` tokens: ``<unk>``, ``<s>``,
    ``</s>`` and the first printable ASCII characters (a real checkpoint ships its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)][:vocab_size - 3]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path))


def make(out: Path, only: list[str]) -> None:
    for family, make_config in FAMILIES.items():
        if only and family not in only:
            continue
        torch.manual_seed(0)
        cfg = make_config()
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # routers and norms away from their trivial initial values
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.add_(0.1 * torch.randn_like(p))
                elif name.endswith("gate.weight"):
                    p.mul_(20.0)
        where = out / family
        model.save_pretrained(where, safe_serialization=True)
        char_tokenizer(cfg.vocab_size, where / "tokenizer.json")
        ids = prompts(cfg.vocab_size)
        np.save(where / "prompts.npy", ids)
        np.save(where / "logits.npy", logits(model, ids))
        (where / "made_with.json").write_text(json.dumps(
            {"transformers": transformers.__version__, "torch": torch.__version__}) + "\n")
        print(f"{where}: {sum(p.numel() for p in model.parameters())} parameters")


def check(fixtures: Path, exported: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager").eval()
    family = json.loads((exported / "config.json").read_text())["model_type"]
    ids = np.load(fixtures / family / "prompts.npy")
    np.save(exported / "transformers_logits.npy", logits(model, ids))
    print(f"{exported}: transformers loaded it; logits written")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--check":
        check(Path(sys.argv[1]), Path(sys.argv[3]))
    else:
        make(Path(sys.argv[1]), sys.argv[2:])
