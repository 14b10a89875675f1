"""What the blockffn studies share: the scale the paper measured its claims on, the fields of
the studies that train sparse LMs (:class:`SparseLMStudyConfig`), and the close-TLS check of
a comparison between two sparse models (:func:`tls_checked`)."""

from __future__ import annotations

from moejax.config import Config, config
from moejax.harness.claims import Claim, unjudged
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


def sparser_explains_ppl(holds: bool, gap: float) -> bool:
    """Whether a TLS gap (the other model's TLS minus the claimed winner's) could explain a
    PPL verdict: a sparser other model explains a win, a denser one a loss."""
    return (gap > 0) == holds


def denser_explains_cls(holds: bool, gap: float) -> bool:
    """Whether a TLS gap (the other model's TLS minus the claimed winner's) could explain a
    chunk-level-sparsity verdict: a denser other model explains a win, a sparser one a loss."""
    return (gap < 0) == holds


def tls_checked(c: Claim, gap: float | None, tol: float | None, confounds,
                what: str = "BlockFFN's") -> Claim:
    """``c``, a comparison of two sparse models, made inconclusive where the other model's
    mean TLS lies further than ``tol`` from the first's (``gap``: its TLS minus the first's)
    in the direction that would explain the verdict (``confounds(holds, gap)``), or where a
    gap or ``tol`` is not recorded and could be. Close TLS (BlockFFN, Table 2): ``tol`` is
    half an expert, the most ``k = round(N (1 - TLS))`` rounding moves it."""
    if c.holds is None:
        return c
    if gap is None or tol is None:
        return unjudged(c, "TLS not recorded: close TLS unchecked")
    if confounds(c.holds, gap) and abs(gap) > tol:
        return unjudged(c, f"its TLS {gap:+.4f} from {what}, not close (within {tol:.4f}, "
                           "half an expert)")
    return c


__all__ = ["PAPER_SCALE", "SparseLMStudyConfig", "denser_explains_cls", "sparser_explains_ppl",
           "tls_checked"]
