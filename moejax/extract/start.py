"""The trained classifier an extraction starts from, and what is recorded of it: the settings
MoEE's study and the extracted-experts benchmark share. Studies inherit these fields, so their
command-line keys stay flat (``model=minilm``, ``extract.n_tokens=2000``, ``record_rows=200``).

The presets: ``quick`` trains the small substrates here (ViT on MNIST-5k, MiniLM on WordNet
parts of speech at quick sizes); ``full`` takes the full substrates (all-MiniLM-L6-v2's real
weights fine-tuned at full size), records 100k tokens (the paper samples 100k) from at most
8000 training rows (MNIST-5k's 4021 images hold 201k; 8000 WordNet glosses about 144k real
tokens, 5000 too few) and evaluates every test row.
"""

from __future__ import annotations

from typing import Any, Literal

from moejax.config import Config, config
from moejax.extract.pipeline import ExtractConfig
from moejax.nn.encoder import minilm_l6_config
from moejax.substrates import substrate_config
from moejax.substrates.classifier_data import ClassifierData
from moejax.substrates.classify import MiniLMTaskConfig, ViTSubstrateConfig

__all__ = ["ExtractionSource", "source_preset"]


@config
class ExtractionSource(Config):
    """``model``: which substrate (``vit``: vit_mnist5k; ``minilm``: minilm_wordnet_pos, the
    real all-MiniLM-L6-v2 fine-tuned on WordNet); ``extract``: the MoEE recipe;
    ``record_rows`` / ``eval_rows``: training rows the token sample is drawn from / test rows
    evaluated (0 = all), each at most: a smaller split gives all its rows, and the run's note
    says how many."""

    model: Literal["vit", "minilm"] = "vit"
    vit: ViTSubstrateConfig = substrate_config("vit_mnist5k", "quick")
    minilm: MiniLMTaskConfig = substrate_config("minilm_wordnet_pos", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    extract: ExtractConfig = ExtractConfig(n_tokens=4000)
    record_rows: int = 1000
    eval_rows: int = 1000

    def unread_fields(self) -> dict[str, str]:
        return self._read_only_with("model", {"vit": ("vit",), "minilm": ("minilm",)})

    def tokens_per_row(self) -> int:
        """The FFN tokens of one recorded row, at most: a ViT image's CLS and patch tokens
        (exactly), a MiniLM gloss's ``seq_len`` (its real tokens, which are recorded, are
        fewer: the sample size is checked again against them when recording)."""
        return 1 + self.vit.vit().n_patches if self.model == "vit" else self.minilm.seq_len

    def ffn_width(self) -> int:
        """The substrate's FFN width: ``vit.d_hidden``, or all-MiniLM-L6-v2's."""
        return (self.vit.d_hidden if self.model == "vit"
                else minilm_l6_config().ffn_slots[0].d_hidden)

    def require_sample(self, n_tokens: int, key: str) -> None:
        """Refuse a token sample (``key``: its config key) larger than the ``record_rows``
        rows hold, before anything is built or trained."""
        most = self.record_rows * self.tokens_per_row()
        self._require(n_tokens <= most, f"{key}={n_tokens} exceeds the {most} tokens that "
                                        f"record_rows={self.record_rows} rows of {self.model} "
                                        f"hold ({self.tokens_per_row()} each at most); raise "
                                        f"record_rows or lower {key}")

    def validate(self) -> None:
        self._require(self.record_rows >= 1, f"record_rows={self.record_rows} must be >= 1")
        self.require_sample(self.extract.n_tokens, "extract.n_tokens")

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
                extract=ExtractConfig(n_tokens=100_000), record_rows=8000, eval_rows=0)
