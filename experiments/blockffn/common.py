"""What the blockffn studies share: the scale the paper measured its claims on, and the fields
of the studies that train sparse LMs (:class:`SparseLMStudyConfig`)."""

from __future__ import annotations

from moejax.config import Config, config
from moejax.sparse_lm import SparseLMConfig, data_sources
from moejax.train.hparams import TrainConfig

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BlockFFN and baseline LMs of 0.1B, 0.5B, 0.8B and 1.2B parameters at close "
               "total and active parameters and training tokens (BlockFFN Sec. 4.1); decoding "
               "on an NVIDIA Jetson Orin NX (Table 6)")


@config
class SparseLMStudyConfig(Config):
    """The sparse LM a study trains (:mod:`moejax.sparse_lm`), its training, the window
    length and the validation batches; a study's config adds its own fields. Presets:
    ``cls(**moejax.sparse_lm.sparse_lm_preset(preset), ...)``."""

    model: SparseLMConfig = SparseLMConfig()
    train: TrainConfig = TrainConfig()
    seq_len: int = 64
    eval_batches: int = 4

    def validate(self):
        self._require(self.seq_len <= self.model.max_seq_len,
                      f"seq_len={self.seq_len} exceeds model.max_seq_len")

    def sources(self, seed: int | None = None):
        """``(train source, validation batches)`` of the byte corpus, at ``seed`` (default
        ``train.seed``)."""
        seed = self.train.seed if seed is None else seed
        return data_sources(self.train.batch_size, self.seq_len, seed, self.eval_batches)


__all__ = ["PAPER_SCALE", "SparseLMStudyConfig"]
