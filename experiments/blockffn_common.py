"""Shared pieces of the BlockFFN studies (not an experiment itself; not part of the library).

:class:`SparseLMConfig` describes one decoder LM whose every FFN is one of

* ``blockffn``: ReLU + RMSNorm router, AL / CS (and ablation L1 / entropy) objectives, the
  adaptive lambda_cs scheduler of Eq. 7 (``ScheduledLM``);
* ``remoe``: ReLU router without RMSNorm, L1 with ReMoE's adaptive coefficient;
* ``topk``: softmax top-k MoE; ``dsmoe``: top-k MoE + ``n_shared`` always-active experts;
* ``grin``: GRIN top-2 MoE (SparseMixer-v2 routing, :mod:`moejax.nn.grin`; ``grin_eps`` is
  its masked-softmax ``jitter_eps``, ``top_k`` is ignored: always 2);
* ``dense``: one FFN of width ``n_experts * d_expert``.

Every MoE has ``n_experts`` non-gated Swish experts of width ``d_expert`` (DSMoE: ``n_shared``
of them shared), so total parameters match up to the router; active parameters are matched
through TLS (top-k ``k = round(n_experts (1 - TLS))``).

:func:`train_and_eval` trains on the CPython stdlib source bytes and streams the validation
metrics of :mod:`moejax.ops.sparsity_metrics` over fixed validation batches.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config, config
from moejax.data.corpora import corpus_bytes
from moejax.data.lm_batches import WindowBatches
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.grin import GRINConfig
from moejax.nn.moe import MoEConfig
from moejax.nn.remoe import ReMoEConfig
from moejax.ops.losses import cross_entropy
from moejax.ops.sparsity_metrics import CHUNK_LENS, SparsityAccumulator
from moejax.pytree import count_params
from moejax.train.lambda_schedule import CoefScheduleConfig, ScheduledLM, sparsity_lm_loss_fn
from moejax.train.loop import train
from moejax.train.optim import TrainConfig

Arch = Literal["blockffn", "remoe", "topk", "dsmoe", "grin", "dense"]


@config
class SparseLMConfig(Config):
    arch: Arch = "blockffn"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 16
    d_expert: int = 32
    top_k: int = 2  # topk / dsmoe (routed + shared = top_k active)
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

    def slot(self):
        if self.arch == "blockffn":
            return BlockFFNConfig(n_experts=self.n_experts, d_expert=self.d_expert,
                                  rmsnorm=self.rmsnorm, alpha=self.alpha, al_coef=self.al_coef,
                                  chunk_len=self.chunk_len, l1_coef=self.l1_coef,
                                  entropy_coef=self.entropy_coef)
        if self.arch == "remoe":
            return ReMoEConfig(n_experts=self.n_experts, d_expert=self.d_expert)
        if self.arch == "grin":
            return GRINConfig(n_experts=self.n_experts, d_expert=self.d_expert,
                              activation="swish", jitter_eps=self.grin_eps, dispatch="dense",
                              balance_loss="switch", balance_coef=0.01)
        if self.arch == "dense":
            return DenseFFNConfig(d_hidden=self.n_experts * self.d_expert, activation="swish")
        shared = self.n_shared if self.arch == "dsmoe" else 0
        return MoEConfig(n_experts=self.n_experts - shared, top_k=self.top_k - shared,
                         d_expert=self.d_expert, activation="swish", dispatch="dense",
                         n_shared_experts=shared, balance_loss="switch", balance_coef=0.01)

    def build(self, seed: int):
        dec = DecoderConfig(vocab_size=256, d_model=self.d_model, n_layers=self.n_layers,
                            n_heads=self.n_heads, ffn_slots=(self.slot(),) * self.n_layers,
                            max_seq_len=self.max_seq_len)
        lm = DecoderLM(dec, rngs=nnx.Rngs(seed))
        if self.arch == "blockffn":
            kind = "blockffn_cs" if self.use_cs else "none"
            return ScheduledLM(lm, CoefScheduleConfig(kind=kind, lam0=self.cs_lam0 if
                                                      self.use_cs else 0.0, n_st=self.n_st,
                                                      n_adj=self.n_adj))
        if self.arch == "remoe":
            return ScheduledLM(lm, CoefScheduleConfig(kind="remoe_l1", lam0=self.remoe_lam0,
                                                      target_sparsity=self.target_tls))
        return lm


def active_sets(spec: SparseLMConfig, layer_aux: dict):
    """``(active_BTE bool, a_BTE or None)`` of one layer's aux (None for a dense FFN)."""
    if "active_BTE" in layer_aux:
        return layer_aux["active_BTE"], layer_aux["a_BTE"]
    if "expert_ids" in layer_aux:
        ids = layer_aux["expert_ids"]
        shared = spec.n_shared if spec.arch == "dsmoe" else 0
        routed = jax.nn.one_hot(ids, spec.n_experts - shared, dtype=jnp.int32).sum(-2) > 0
        if shared:
            on = jnp.ones(routed.shape[:2] + (shared,), bool)
            routed = jnp.concatenate([on, routed], -1)
        return routed, None
    return None, None


def param_counts(spec: SparseLMConfig, model) -> dict:
    n = count_params(model)
    n_ffn = spec.n_layers * 2 * spec.d_model * spec.d_expert * spec.n_experts
    return {"params": n, "ffn_params": n_ffn}


def evaluate(spec: SparseLMConfig, model, batches, chunk_lens=CHUNK_LENS) -> dict:
    """Validation CE / PPL and the streaming sparsity metrics (mean over layers)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def fwd(params, rest, batch):
        m = nnx.merge(graphdef, params, rest)
        logits, aux = m(batch["inputs"], train=False, mask_BT=batch["mask"] > 0)
        ce = cross_entropy(logits, batch["targets"], batch["mask"])
        return ce, [active_sets(spec, la) for la in aux["layers"]]

    acc = SparsityAccumulator(chunk_lens)
    ces = []
    for b in batches:
        ce, layers = jax.device_get(fwd(params, rest, b))
        ces.append(float(ce))
        for i, (act, a) in enumerate(layers):
            if act is not None:
                acc.update(i, act, mask_BT=b["mask"] > 0, a_BTE=a, tokens_BT=b["inputs"])
    ce = float(np.mean(ces))
    out = {"val_ce": ce, "val_ppl": math.exp(ce)}
    res = acc.result()
    out.update(res["mean"])
    out["layers"] = res["layers"]
    out["allocation"] = acc.allocation()
    return out


def data_sources(batch_size: int, seq_len: int, seed: int, eval_batches: int):
    train_src = WindowBatches(corpus_bytes("stdlib_code", "train"), batch_size=batch_size,
                              seq_len=seq_len, seed=seed)
    val = WindowBatches(corpus_bytes("stdlib_code", "validation"), batch_size=batch_size,
                        seq_len=seq_len, seed=10_000 + seed)
    return train_src, [val.batch(i) for i in range(eval_batches)]


def train_and_eval(spec: SparseLMConfig, tcfg: TrainConfig, train_src, val_batches,
                   run_dir=None, desc: str = "") -> dict:
    """Train one model from scratch; return its validation metrics and training summary."""
    model = spec.build(tcfg.seed)
    hist = train(model, train_src, tcfg, run_dir=run_dir, loss_fn=sparsity_lm_loss_fn,
                 progress=True)
    ev = evaluate(spec, model, val_batches)
    ev.update(param_counts(spec, model))
    ev["train_ce_last"] = float(np.mean([h["ce"] for h in hist[-10:]]))
    ev["lambda_final"] = float(hist[-1].get("aux/lambda", float("nan")))
    ev["history"] = hist
    ev["model"] = model
    return ev


def row(name: str, ev: dict, extra: dict | None = None) -> dict:
    r = {"model": name}
    r.update(extra or {})
    r.update({"val_ppl": ev["val_ppl"], "TLS": ev.get("tls", 0.0),
              "CLS_8": ev.get("cls_8", 0.0), "reuse": ev.get("reuse", float("nan")),
              "params": ev["params"]})
    return r
