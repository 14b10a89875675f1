"""BlockFFN vs TopK MoE / DeepSeekMoE / GRIN / ReMoE / dense at matched total and active parameters
(BlockFFN paper Table 2 and Fig. 1a analogs), on the CPython stdlib source bytes.

Per size: BlockFFN (AL + CS, adaptive lambda_cs) is trained first; its validation TLS fixes the
active parameters of the baselines: TopK and DSMoE use ``k = round(N (1 - TLS))`` of the same
``N`` experts (DSMoE: one of them shared), GRIN (SparseMixer-v2 routing) is top-2 of the same
experts, ReMoE's controller targets the same TLS, and the dense model has one FFN of width
``N d_expert``. Writes the PPL / TLS / CLS_8 / reuse table, CLS_L against L (Fig. 1a),
per-layer activation magnitudes (Fig. 4) and BlockFFN's per-token expert allocation histogram
(Fig. 3). The quick preset uses AL sharpness alpha = 10 instead of the
paper's 100 (see experiments/blockffn_ablations.py, table ``alpha``).

    python -m experiments.blockffn_baselines                 # quick (CPU)
    python -m experiments.blockffn_baselines preset=full     # GPU
"""

from __future__ import annotations

import numpy as np

from moejax.config import Config, config
from moejax.experiment import main
from moejax.ops.sparsity_metrics import CHUNK_LENS
from moejax.results import RunDir
from moejax.sparse_lm import (
    SparseLMConfig,
    data_sources,
    sparse_lm_preset,
    summary_row,
    train_and_evaluate,
)
from moejax.train.optim import TrainConfig

NAME = "blockffn_baselines"


@config
class BaselinesConfig(Config):
    model: SparseLMConfig = SparseLMConfig()
    train: TrainConfig = TrainConfig()
    small_d_model: int = 48
    small_d_expert: int = 16
    large_d_model: int = 64
    large_d_expert: int = 32
    seq_len: int = 64
    eval_batches: int = 4

    def validate(self):
        self._require(self.seq_len <= self.model.max_seq_len,
                      f"seq_len={self.seq_len} exceeds model.max_seq_len")


def make_config(preset: str) -> BaselinesConfig:
    base = sparse_lm_preset(preset)
    if preset == "quick":
        return BaselinesConfig(**base)
    return BaselinesConfig(**base, small_d_model=256, small_d_expert=64, large_d_model=512,
                           large_d_expert=128)


def run(cfg: BaselinesConfig, run: RunDir) -> dict:
    train_src, val = data_sources(cfg.train.batch_size, cfg.seq_len, cfg.train.seed,
                                  cfg.eval_batches)
    N = cfg.model.n_experts
    rows, cls_series, mag_rows = [], {}, []
    sizes = {"small": (cfg.small_d_model, cfg.small_d_expert),
             "large": (cfg.large_d_model, cfg.large_d_expert)}
    alloc = None
    for size, (d, de) in sizes.items():
        base = cfg.model.replace(d_model=d, d_expert=de)
        bf = train_and_evaluate(base.replace(arch="blockffn"), cfg.train, train_src, val)
        k = int(min(N, max(2, round(N * (1.0 - bf["tls"])))))
        runs = {"BlockFFN": (bf, {})}
        for name, spec in [
            ("TopK", base.replace(arch="topk", top_k=k)),
            ("DSMoE", base.replace(arch="dsmoe", top_k=k, n_shared=1)),
            ("GRIN", base.replace(arch="grin", top_k=2)),
            ("ReMoE", base.replace(arch="remoe", target_tls=float(bf["tls"]))),
            ("Dense", base.replace(arch="dense")),
        ]:
            runs[name] = (train_and_evaluate(spec, cfg.train, train_src, val), {})
        for name, (ev, _) in runs.items():
            active = {"TopK": k, "DSMoE": k, "GRIN": 2, "Dense": N}.get(
                name, N * (1 - ev.get("tls", 0)))
            rows.append(summary_row(name, ev, {"size": size, "d_model": d, "d_expert": de,
                                       "active_experts": active}))
            if name != "Dense":
                cls_series[f"{name} ({size})"] = (
                    list(CHUNK_LENS), [ev[f"cls_{L}"] for L in CHUNK_LENS])
            if name in ("BlockFFN", "ReMoE"):
                for layer, m in ev["layers"].items():
                    mag_rows.append({"size": size, "model": name, "layer": layer,
                                     "act_magnitude": m.get("magnitude", float("nan"))})
        if size == "large":
            alloc = bf["allocation"]
    run.table("baselines", rows, title="Validation PPL and sparsity at matched parameters "
              "(TopK/DSMoE k and ReMoE target set from BlockFFN's TLS; GRIN k=2)",
              columns=["size", "model", "d_model", "d_expert", "active_experts", "val_ppl",
                       "TLS", "CLS_8", "reuse", "params"])
    run.line_plot("cls_vs_L", cls_series, xlabel="chunk length L", ylabel="CLS_L",
                  title="Chunk-level sparsity vs chunk length (Fig. 1a)", logx=True,
                  markers=True)
    run.table("act_magnitude", mag_rows, title="Mean ||A||_2 per layer (Fig. 4 analog)")
    if alloc is not None:
        ids, counts, frac = alloc
        hi = float(min(1.0, max(0.05, frac.max() * 1.05)))
        hist, edges = np.histogram(frac, bins=20, range=(0, hi), weights=counts)
        run.bar_plot("allocation_hist", [f"{edges[i]:.2f}" for i in range(20)],
                     (hist / hist.sum()).tolist(), ylabel="fraction of tokens",
                     title="BlockFFN (large) expert allocation per token id (Fig. 3)")
    bf_rows = {r["size"]: r for r in rows if r["model"] == "BlockFFN"}
    moe = [r for r in rows if r["model"] != "Dense"]
    best = {s: min((r for r in moe if r["size"] == s), key=lambda r: r["val_ppl"])["model"]
            for s in sizes}
    b = bf_rows["large"]
    return {"headline": (f"BlockFFN (large): PPL {b['val_ppl']:.3f}, TLS {b['TLS']:.3f}, "
                         f"CLS_8 {b['CLS_8']:.3f}, reuse {b['reuse']:.3f}; lowest-PPL MoE: "
                         f"{best}"),
            "best_moe": best}


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run))
