"""The sparsely activated decoder LMs BlockFFN is compared with, trained from scratch.

:class:`SparseLMConfig` describes one decoder LM whose every FFN is one of

* ``blockffn``: ReLU + RMSNorm router, AL / CS (and ablation L1 / entropy) objectives, the
  adaptive lambda_cs scheduler of BlockFFN Eq. 7
  (:class:`~moejax.chunk_sparse.schedule.ScheduledLM`);
* ``remoe``: ReLU router without RMSNorm, ReMoE's load-balanced L1 (``k = E (1 - target_tls)``)
  with its adaptive coefficient;
* ``topk``: softmax top-k MoE; ``dsmoe``: top-k MoE + ``n_shared`` always-active experts;
* ``grin``: GRIN MoE (SparseMixer-v2 routing, :mod:`moejax.nn.grin`; ``grin_eps`` is
  its masked-softmax ``jitter_eps``; GRIN is top-2, ``top_k > 2`` runs more stages);
* ``dense``: one FFN of width ``n_experts * d_expert``.

Every MoE has ``n_experts`` non-gated Swish experts of width ``d_expert`` (DSMoE: ``n_shared``
of them shared), so total parameters match up to the router; active parameters are matched
through TLS (top-k ``k = round(n_experts (1 - TLS))``).

:func:`sparse_lm_preset` holds the one quick (CPU) and full (GPU) setting the BlockFFN studies
share; :func:`train_and_evaluate` trains one model through :func:`moejax.train.loop.train` on
the CPython stdlib source bytes and scores it with :class:`moejax.evaluate.SparsityEvaluator`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Literal

import numpy as np
from flax import nnx

from moejax.chunk_sparse.schedule import CoefScheduleConfig, ScheduledLM
from moejax.config import Config, ConfigError, config
from moejax.data.corpora import corpus_windows
from moejax.evaluate import SparsityEvaluator, router_active_sets
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.grin import GRIN_MOE, GRINConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.remoe import ReMoEConfig
from moejax.pytree import count_params
from moejax.train.hparams import TrainConfig
from moejax.train.logs import read_csv
from moejax.train.loop import train

__all__ = ["Arch", "ARCH_FIELDS", "ARCH_NAMES", "SHARED_FIELDS", "SparseLMConfig", "TrainedLM",
           "active_sets", "decoder_of", "sparse_lm_preset", "data_sources", "train_and_evaluate",
           "summary_row"]

Arch = Literal["blockffn", "remoe", "topk", "dsmoe", "grin", "dense"]

# each architecture as the BlockFFN paper's tables name it
ARCH_NAMES = {"blockffn": "BlockFFN", "remoe": "ReMoE", "topk": "TopK MoE", "dsmoe": "DSMoE",
              "grin": "GRIN", "dense": "dense"}

# the fields of :class:`SparseLMConfig` each architecture's model reads besides those every
# model reads (:data:`SHARED_FIELDS`)
SHARED_FIELDS = ("arch", "d_model", "n_layers", "n_heads", "n_experts", "d_expert",
                 "max_seq_len")
ARCH_FIELDS: dict[str, tuple[str, ...]] = {
    "blockffn": ("rmsnorm", "al_coef", "alpha", "use_cs", "chunk_len", "cs_lam0", "n_st",
                 "n_adj", "l1_coef", "entropy_coef"),
    "remoe": ("target_tls", "remoe_lam0"),
    "topk": ("top_k",),
    "dsmoe": ("top_k", "n_shared"),
    "grin": ("top_k", "grin_eps"),
    "dense": (),
}


@config
class SparseLMConfig(Config):
    arch: Arch = "blockffn"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 16
    d_expert: int = 32
    top_k: int = 2  # topk / dsmoe / grin (routed + shared = top_k active)
    n_shared: int = 1  # dsmoe
    rmsnorm: bool = True
    al_coef: float = 2e-3
    alpha: float = 100.0
    use_cs: bool = True
    chunk_len: int = 64
    cs_lam0: float = 5e-2
    n_st: int = 1000
    n_adj: int = 100
    l1_coef: float = 0.0
    entropy_coef: float = 0.0
    target_tls: float = 0.875  # remoe controller target
    remoe_lam0: float = 1e-4
    grin_eps: float = 0.01  # GRIN-MoE's router_jitter_noise
    max_seq_len: int = 1024

    def validate(self) -> None:
        # both schedules multiply their coefficient: started at 0 it stays 0, and the
        # regulariser the arm is named after never acts
        self._require(self.cs_lam0 > 0, f"cs_lam0={self.cs_lam0} must be > 0: lambda_cs's "
                      "schedule scales it, so from 0 CS never acts (use_cs=false trains "
                      "without CS)")
        self._require(self.remoe_lam0 > 0, f"remoe_lam0={self.remoe_lam0} must be > 0: "
                      "ReMoE's controller scales it, so from 0 its L1 penalty never acts")
        try:  # the model this config builds must be valid too: fail at construction
            self.slot()
            stub = DenseFFNConfig(d_hidden=1, activation="swish")
            DecoderConfig(vocab_size=256, d_model=self.d_model, n_layers=self.n_layers,
                          n_heads=self.n_heads, ffn_slots=(stub,) * self.n_layers,
                          max_seq_len=self.max_seq_len)
        except ConfigError as e:
            raise ConfigError(f"SparseLMConfig: {e}") from None

    def unread(self, archs, set_here=()) -> dict:
        """The fields no model of ``archs`` reads, or that the caller sets itself
        (``set_here``), that hold a value other than their default: ``{name: value}``. A
        study refuses them (its recorded config would name a setting that did not run)."""
        read = {*SHARED_FIELDS, *(f for a in archs for f in ARCH_FIELDS[a])} - set(set_here)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in read and getattr(self, f.name) != self._default(f.name)}

    def without_unread(self, archs, set_here=()) -> SparseLMConfig:
        """This config with :meth:`unread`'s fields at their defaults (a study's model from
        the preset, which holds settings for the studies that read them)."""
        return self.replace(**{k: self._default(k) for k in self.unread(archs, set_here)})

    @property
    def n_always_on(self) -> int:
        return self.n_shared if self.arch == "dsmoe" else 0

    def slot(self):
        if self.arch == "blockffn":
            return BlockFFNConfig(n_experts=self.n_experts, d_expert=self.d_expert,
                                  rmsnorm=self.rmsnorm, alpha=self.alpha, al_coef=self.al_coef,
                                  chunk_len=self.chunk_len, l1_coef=self.l1_coef,
                                  entropy_coef=self.entropy_coef)
        if self.arch == "remoe":
            return ReMoEConfig(n_experts=self.n_experts, d_expert=self.d_expert,
                               l1_k=self.n_experts * (1.0 - self.target_tls))
        if self.arch == "grin":
            return GRINConfig(moe=GRIN_MOE.replace(n_experts=self.n_experts,
                                                   d_expert=self.d_expert, top_k=self.top_k,
                                                   balance_loss="switch", balance_coef=0.01),
                              jitter_eps=self.grin_eps)
        if self.arch == "dense":
            return DenseFFNConfig(d_hidden=self.n_experts * self.d_expert, activation="swish")
        shared = self.n_always_on
        return MoEConfig(n_experts=self.n_experts - shared, top_k=self.top_k - shared,
                         d_expert=self.d_expert, activation="swish", dispatch="dense",
                         n_shared_experts=shared, balance_loss="switch", balance_coef=0.01)

    def build(self, seed: int):
        dec = DecoderConfig(vocab_size=256, d_model=self.d_model, n_layers=self.n_layers,
                            n_heads=self.n_heads, ffn_slots=(self.slot(),) * self.n_layers,
                            max_seq_len=self.max_seq_len)
        lm = DecoderLM(dec, rngs=nnx.Rngs(seed))
        if self.arch == "blockffn":
            return ScheduledLM(lm, CoefScheduleConfig(
                kind="blockffn_cs" if self.use_cs else "none",
                lam0=self.cs_lam0 if self.use_cs else 0.0, n_st=self.n_st, n_adj=self.n_adj))
        if self.arch == "remoe":
            return ScheduledLM(lm, CoefScheduleConfig(kind="remoe_l1", lam0=self.remoe_lam0,
                                                      target_sparsity=self.target_tls))
        return lm


def decoder_of(model) -> DecoderLM:
    """The decoder LM a model of :meth:`SparseLMConfig.build` decodes with: a BlockFFN or
    ReMoE model trains wrapped in its coefficient schedule (:class:`ScheduledLM`), the others
    are the decoder itself."""
    return model.lm if isinstance(model, ScheduledLM) else model


def active_sets(spec: SparseLMConfig, layer_aux: dict):
    """``(active_BTE bool, a_BTE or None)`` of one layer's aux (None for a dense FFN); top-k
    layers' ``expert_ids`` become a mask over all ``n_experts`` (shared experts first)."""
    return router_active_sets(layer_aux, spec.n_experts - spec.n_always_on, spec.n_always_on)


def sparse_lm_preset(preset: str) -> dict:
    """The model, training and data settings every BlockFFN study starts from (a study
    overrides what its recipe changes): ``{"model", "train", "seq_len", "eval_batches"}``.

    quick: a 2-layer width-48 LM with 16 experts of width 16 trained 200 steps (CPU, ~30 s);
    the AL sharpness is 10 instead of the paper's 100 (see ``blockffn_ablations``' ``alpha``
    table). full: 8 layers, width 256, 40 experts, 8000 steps of 64 x 512 tokens (GPU)."""
    if preset == "quick":
        return dict(
            model=SparseLMConfig(d_model=48, d_expert=16, n_layers=2, n_heads=4, n_experts=16,
                                 chunk_len=16, alpha=10.0, cs_lam0=5e-2, n_st=40, n_adj=10,
                                 remoe_lam0=1e-3),
            train=TrainConfig(steps=200, batch_size=16, lr=3e-3, warmup_steps=20,
                              schedule="wsd", decay_fraction=0.2, log_every=20),
            seq_len=64, eval_batches=4)
    if preset == "full":
        return dict(
            model=SparseLMConfig(d_model=256, d_expert=64, n_layers=8, n_heads=8, n_experts=40,
                                 chunk_len=64, cs_lam0=5e-2, n_st=1000, n_adj=100,
                                 remoe_lam0=1e-4, max_seq_len=512),
            train=TrainConfig(steps=8000, batch_size=64, lr=2e-3, warmup_steps=400,
                              schedule="wsd", decay_fraction=0.1, log_every=50),
            seq_len=512, eval_batches=32)
    raise ValueError(f"unknown preset {preset!r}; use 'quick' or 'full'")


def data_sources(batch_size: int, seq_len: int, seed: int, eval_batches: int,
                 corpus: str = "stdlib_code"):
    """``(train source, fixed validation batches)`` of byte windows of ``corpus``."""
    train_src = corpus_windows(corpus, "train", batch_size=batch_size, seq_len=seq_len,
                               seed=seed)
    val = corpus_windows(corpus, "validation", batch_size=batch_size, seq_len=seq_len,
                         seed=10_000 + seed)
    return train_src, [val.batch(i) for i in range(eval_batches)]


@config
class TrainedLM(Config):
    """What a checkpoint of :func:`train_and_evaluate` holds: the model and its training
    (a resume into the same ``run_dir`` with either changed is refused)."""

    model: SparseLMConfig = SparseLMConfig()
    train: TrainConfig = TrainConfig()


def train_and_evaluate(spec: SparseLMConfig, tcfg: TrainConfig, train_src, val_batches,
                       run_dir=None) -> dict:
    """Train one model from scratch (seed ``tcfg.seed``); its validation metrics
    (:class:`SparsityEvaluator`), ``params`` / ``ffn_params``, ``train_ce_last`` (mean of the
    last 10 logged steps), ``lambda_final``, the ``history`` and the trained ``model``.

    ``run_dir``: checkpoints and logs there, so a stopped run resumes exactly and a finished
    one is restored instead of trained again (its logged steps read back from
    ``metrics.csv``; ``history`` holds this call's steps only)."""
    model = spec.build(tcfg.seed)
    hist = train(model, train_src, tcfg, run_dir=run_dir, progress=True,
                 config=TrainedLM(model=spec, train=tcfg))
    logged = hist if run_dir is None else [
        {k: float(v) for k, v in r.items() if v not in ("", None)}
        for r in read_csv(os.path.join(run_dir, "metrics.csv"))]
    ev = SparsityEvaluator(val_batches, active_fn=functools.partial(active_sets, spec))(model)
    ev["params"] = count_params(model)
    ev["ffn_params"] = spec.n_layers * 2 * spec.d_model * spec.d_expert * spec.n_experts
    ev["train_ce_last"] = float(np.mean([h["ce"] for h in logged[-10:]]))
    ev["lambda_final"] = float(logged[-1].get("aux/lambda", float("nan")))
    ev["history"] = hist
    ev["model"] = model
    return ev


def summary_row(name: str, ev: dict, extra: dict | None = None) -> dict:
    """One results-table row: ``model``, ``extra``, PPL, TLS, CLS_8, reuse, params."""
    r = {"model": name}
    r.update(extra or {})
    r.update({"val_ppl": ev["val_ppl"], "TLS": ev.get("tls", 0.0),
              "CLS_8": ev.get("cls_8", 0.0), "reuse": ev.get("reuse", float("nan")),
              "params": ev["params"]})
    return r
