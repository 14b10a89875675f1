"""What the blockffn studies share: the scale the paper measured its claims on, the fields of
the studies that train sparse LMs (:class:`SparseLMStudyConfig`), and the close-TLS check of
a comparison between two sparse models (:func:`tls_checked`)."""

from __future__ import annotations

from moejax.config import Config, ConfigError, config
from moejax.harness.claims import Claim, lookup, measured, paired_compare, per_seed, unjudged
from moejax.sparse_lm import SparseLMConfig, data_sources, sparse_lm_preset
from moejax.train.hparams import TrainConfig, require_read

# the models and data the paper measured its claims on (beside every verdict)
PAPER_SCALE = ("BlockFFN and baseline LMs of 0.1B, 0.5B, 0.8B and 1.2B parameters at close "
               "total and active parameters and training tokens (BlockFFN Sec. 4.1); decoding "
               "on an NVIDIA Jetson Orin NX (Table 6)")

# the abstract: "achieving over 80% TLS and 70% 8-token CLS"
PAPER_TLS, PAPER_CLS_8 = 0.8, 0.7

# Sec. 4.1.2, Table 4: "the high reuse ratios of BlockFFN models over 85%"
PAPER_REUSE = 0.85


@config
class SparseLMStudyConfig(Config):
    """The sparse LM a study trains (:mod:`moejax.sparse_lm`), its training, the window
    length and the validation batches; a study's config adds its own fields. Presets:
    ``cls(**moejax.sparse_lm.sparse_lm_preset(preset), ...)``."""

    model: SparseLMConfig = SparseLMConfig()
    train: TrainConfig = TrainConfig()
    seq_len: int = 64
    eval_batches: int = 4

    # the architectures a study trains from ``model``, and the fields of ``model`` it sets
    # itself (name -> what sets it): any other field no such model reads must keep its
    # default, or the recorded config would name a setting that did not run
    MODEL_ARCHS = ("blockffn",)
    MODEL_SET_HERE = {"arch": "every model it trains is BlockFFN"}

    def validate(self):
        require_read(self, "train", "each model's training")
        self._require(self.seq_len <= self.model.max_seq_len,
                      f"seq_len={self.seq_len} exceeds model.max_seq_len")
        for name, value in self.model.unread(self.MODEL_ARCHS, self.MODEL_SET_HERE).items():
            why = self.MODEL_SET_HERE.get(name) or (
                f"no model it trains ({', '.join(self.MODEL_ARCHS)}) reads it")
            raise ConfigError(f"model.{name}={value!r} is not read by this study: {why}; "
                              f"leave it at its default, {SparseLMConfig._default(name)!r}")

    @classmethod
    def from_preset(cls, preset: str, **fields):
        """The study's config of ``preset`` (:func:`moejax.sparse_lm.sparse_lm_preset`),
        its model's unread fields at their defaults, with ``fields`` set."""
        base = sparse_lm_preset(preset)
        model = base.pop("model").without_unread(cls.MODEL_ARCHS, cls.MODEL_SET_HERE)
        return cls(model=model, **{**base, **fields})

    def sources(self, seed: int | None = None):
        """``(train source, validation batches)`` of the byte corpus, at ``seed`` (default
        ``train.seed``)."""
        seed = self.train.seed if seed is None else seed
        return data_sources(self.train.batch_size, self.seq_len, seed, self.eval_batches)


# BlockFFN's router and objective settings, each with what it is; SparseLMConfig's defaults
# are the paper's (Sec. 3, App. B)
BLOCKFFN_SETTINGS = {"rmsnorm": "the router RMSNorm", "al_coef": "the AL weight",
                     "alpha": "AL's sharpness alpha", "use_cs": "the CS loss",
                     "chunk_len": "CS's chunk length", "cs_lam0": "lambda_cs's start",
                     "n_st": "the scheduler's constant steps N_st",
                     "n_adj": "its window N_adj", "l1_coef": "an L1 weight",
                     "entropy_coef": "a router-entropy weight"}


def blockffn_changes(model: SparseLMConfig, set_here=()) -> str:
    """The note naming each BlockFFN setting of ``model`` that differs from the paper's
    (:data:`BLOCKFFN_SETTINGS`; ``set_here``: those the study sets per model, left out), so
    a summary says which BlockFFN ran; ``""`` when it is the paper's."""
    paper = SparseLMConfig()
    changed = [f"{what} {getattr(model, k)!r} (the paper's: {getattr(paper, k)!r})"
               for k, what in BLOCKFFN_SETTINGS.items()
               if k not in set_here and getattr(model, k) != getattr(paper, k)]
    return ("BlockFFN here differs from the paper's in " + "; ".join(changed) + "."
            if changed else "")


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


def at_close_tls(claim: str, t: dict, table: str, a, b, column: str = "val_ppl", *,
                 key: str = "model", labels: tuple[str, str] | None = None) -> Claim:
    """``claim`` that the row ``key == a`` of ``table`` beats the row ``key == b`` on
    ``column`` (``val_ppl``: lower is better; ``CLS_8``: higher), paired over the seed runs
    (:func:`moejax.harness.claims.paired_compare`), and judged only where ``b``'s mean TLS
    lies within half an expert of ``a``'s (``n_experts`` of ``a``'s rows) or on the side that
    cannot explain the verdict (:func:`tls_checked`)."""
    la, lb = labels or (str(a), str(b))
    ppl = column == "val_ppl"

    def value(x):
        return lambda r: lookup(r.get(table), {key: x}, column)

    c = paired_compare(claim, t, (la, value(a)), (lb, value(b)),
                       better="lower" if ppl else "higher")
    gaps, tol = [], None
    for run in per_seed(t):
        ra, rb = (lookup(run.get(table), {key: x}) or {} for x in (a, b))
        ta, tb = measured(ra.get("TLS")), measured(rb.get("TLS"))
        gaps.append(None if ta is None or tb is None else tb - ta)
        n = measured(ra.get("n_experts"))
        tol = tol if n is None else 0.5 / n + 1e-6
    gap = None if not gaps or None in gaps else sum(gaps) / len(gaps)
    return tls_checked(c, gap, tol, sparser_explains_ppl if ppl else denser_explains_cls,
                       what=f"{la}'s")


__all__ = ["PAPER_CLS_8", "PAPER_REUSE", "PAPER_SCALE", "PAPER_TLS", "BLOCKFFN_SETTINGS",
           "SparseLMStudyConfig", "at_close_tls", "blockffn_changes", "denser_explains_cls",
           "sparser_explains_ppl", "tls_checked"]
