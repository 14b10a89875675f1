"""The trained classifier an extraction starts from, and what is recorded of it: the settings
MoEE's study and the extracted-experts benchmark share. Studies inherit these fields, so their
command-line keys stay flat (``model=minilm``, ``extract.n_tokens=2000``, ``record_rows=200``).

The presets: ``quick`` trains the small substrates here (ViT on MNIST-5k, MiniLM on WordNet
parts of speech at quick sizes); ``full`` takes the full substrates (all-MiniLM-L6-v2's real
weights fine-tuned at full size), records 100k tokens from 5000 training rows (the paper
samples 100k) and evaluates every test row.
"""

from __future__ import annotations

from typing import Any, Literal

from moejax.config import Config, config
from moejax.extract.pipeline import ExtractConfig
from moejax.substrates import substrate_config
from moejax.substrates.classifier_data import ClassifierData
from moejax.substrates.classify import MiniLMTaskConfig, ViTSubstrateConfig

__all__ = ["ExtractionSource", "source_preset"]


@config
class ExtractionSource(Config):
    """``model``: which substrate (``vit``: vit_mnist5k; ``minilm``: minilm_wordnet_pos, the
    real all-MiniLM-L6-v2 fine-tuned on WordNet); ``extract``: the MoEE recipe;
    ``record_rows`` / ``eval_rows``: training rows the token sample is drawn from / test rows
    evaluated (0 = all)."""

    model: Literal["vit", "minilm"] = "vit"
    vit: ViTSubstrateConfig = substrate_config("vit_mnist5k", "quick")
    minilm: MiniLMTaskConfig = substrate_config("minilm_wordnet_pos", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    extract: ExtractConfig = ExtractConfig(n_tokens=4000)
    record_rows: int = 1000
    eval_rows: int = 1000

    def unread_fields(self) -> dict[str, str]:
        return self._read_only_with("model", {"vit": ("vit",), "minilm": ("minilm",)})

    def classifier_data(self, train_rows: int | None = None) -> ClassifierData:
        """The substrate (built or read from the cache) with its data; ``train_rows``: the
        training rows to hold (default ``record_rows``)."""
        return ClassifierData(self.model, self.vit, self.minilm,
                              cache_dir=self.substrate_cache or None,
                              train_rows=train_rows or self.record_rows,
                              eval_rows=self.eval_rows)


def source_preset(preset: str) -> dict[str, Any]:
    """The :class:`ExtractionSource` fields of ``preset`` (module docstring)."""
    if preset == "quick":
        return {}
    return dict(vit=substrate_config("vit_mnist5k", "full"),
                minilm=substrate_config("minilm_wordnet_pos", "full"),
                extract=ExtractConfig(n_tokens=100_000), record_rows=5000, eval_rows=0)
