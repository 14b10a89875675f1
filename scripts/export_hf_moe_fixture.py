"""Make ``tests/fixtures/hf_moe/exported``: a moejax MoE DecoderLM (random init, seed 0) saved
in the Mixtral layout (run with moejax's virtualenv; not run by CI); then transformers reads it
and writes its logits beside it (``make_hf_moe_fixtures.py tests/fixtures/hf_moe --check
tests/fixtures/hf_moe/exported``, in a virtualenv with transformers).

    .venv/bin/python scripts/export_hf_moe_fixture.py tests/fixtures/hf_moe/exported
"""
import sys

from flax import nnx

from moejax.io.hf_moe_save import save_hf_moe
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.moe import MoEConfig
from moejax.nn.slots import layer_pattern

MOE = MoEConfig(n_experts=4, top_k=2, d_expert=24, activation="swiglu")
CFG = DecoderConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    max_seq_len=64, rope_style="half", tie_embeddings=False,
                    ffn_slots=layer_pattern(2, MOE, MOE, every=1))

if __name__ == "__main__":
    save_hf_moe(DecoderLM(CFG, rngs=nnx.Rngs(0)), sys.argv[1])
