"""Benchmark: does extracting experts save wall-clock time? One MiniLM-shaped FFN (D 384,
F 1536, GELU, biases) timed dense, as extracted experts in the masked layout (the trainable
oracle: every kept neuron computed) and in the compact layout (each expert's neurons
contiguous, tokens routed through the MoE dispatch: the host kernel on a CPU), against the
MAC reduction each plan promises.

Plans are synthetic, one expert per token (MoEE's routing): ``experts`` experts that each keep
``keep`` of the neurons; ``"equal"`` gives every expert that share, ``"skewed"`` spreads the
sizes linearly from half to one and a half times it (same mean), so the compact layout, padded
to the largest expert, pays for the spread. Tokens: ``batch`` x ``seq_len`` (MiniLM's mean
sentence length in the MoEE study's data is about 16 tokens), routed uniformly at random.

    python -m experiments.bench_extracted
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench import time_interleaved
from moejax.config import Config, config
from moejax.experiment import main
from moejax.extract.plan import ExpertPlan
from moejax.extract.surgery import compact_model, extract_model
from moejax.nn.encoder import ViT, vit_config
from moejax.results import RunDir

NAME = "bench_extracted"


@config
class ExtractedBenchConfig(Config):
    d_model: int = 384
    d_hidden: int = 1536
    experts: int = 16
    keep: float = 0.564  # kept share of the FFN neurons per token (43.6% fewer MACs)
    batch: int = 32
    seq_len: int = 16
    repeats: int = 20
    seed: int = 0

    def validate(self) -> None:
        self._require(0 < self.keep < 1, f"keep={self.keep} must be in (0, 1)")
        self._require(self.experts >= 2 and self.batch >= 1 and self.seq_len >= 1,
                      "experts >= 2, batch >= 1, seq_len >= 1")


def make_config(preset: str) -> ExtractedBenchConfig:
    return ExtractedBenchConfig(repeats=20 if preset == "quick" else 50)


def _plan(cfg: ExtractedBenchConfig, sizes: str, rng) -> ExpertPlan:
    F, C = cfg.d_hidden, cfg.experts
    share = np.full(C, cfg.keep) if sizes == "equal" else cfg.keep * np.linspace(0.5, 1.5, C)
    masks = np.zeros((C, F), bool)
    for c in range(C):
        masks[c, rng.choice(F, int(round(share[c] * F)), replace=False)] = True
    router = rng.normal(size=(C, cfg.d_model)).astype(np.float32)
    return ExpertPlan(masks, router, np.zeros(C, np.float32))


def run(cfg: ExtractedBenchConfig, run: RunDir) -> dict:
    rng = np.random.default_rng(cfg.seed)
    vit = ViT(vit_config(image_size=8, patch_size=4, d_model=cfg.d_model, n_layers=1,
                         n_heads=4, d_hidden=cfg.d_hidden, n_classes=2, n_channels=1),
              rngs=nnx.Rngs(cfg.seed))
    dense = vit.blocks[0].ffn
    x = jnp.asarray(rng.normal(size=(cfg.batch, cfg.seq_len, cfg.d_model)), jnp.float32)
    rows = []
    slots = {"dense": dense}
    for sizes in ("equal", "skewed"):
        plan = _plan(cfg, sizes, rng)
        masked = extract_model(vit, {0: plan}, router="dot").blocks[0].ffn
        compact = compact_model(extract_model(vit, {0: plan}, router="dot")).blocks[0].ffn
        with jax.default_matmul_precision("highest"):  # GPUs default to TF32 products
            y_m, aux = masked(x)
            y_c, _ = compact(x)
        np.testing.assert_allclose(np.asarray(y_c), np.asarray(y_m), rtol=1e-4, atol=1e-4)
        kept = float(aux["active_neurons"]) / cfg.d_hidden
        for layout, slot in (("masked", masked), ("compact", compact)):
            slots[f"{sizes} {layout}"] = slot
        rows += [{"plan": sizes, "layout": layout, "kept_share": kept,
                  "padded_share": compact.cfg.d_expert / cfg.d_hidden}
                 for layout in ("masked", "compact")]
    call = nnx.jit(lambda m, x: m(x)[0])
    times = time_interleaved({k: (lambda s=s: call(s, x)) for k, s in slots.items()},
                             repeats=cfg.repeats)
    dense_s = times["dense"]["median_s"]
    out = [{"plan": "-", "layout": "dense", "ms": dense_s * 1e3, "vs_dense": 1.0,
            "kept_share": 1.0}]
    for r in rows:
        t = times[f"{r['plan']} {r['layout']}"]["median_s"]
        saved, promised = 1 - t / dense_s, 1 - r["kept_share"]
        out.append(r | {"ms": t * 1e3, "vs_dense": t / dense_s, "time_saved": saved,
                        "mac_saved": promised, "saved_over_promised": saved / promised})
    dev = jax.devices()[0]
    run.table("ffn_time", out, title=(
        f"One FFN (D {cfg.d_model}, F {cfg.d_hidden}, GELU) on {cfg.batch} x {cfg.seq_len} "
        f"tokens, {cfg.experts} experts, top-1, median of {cfg.repeats} interleaved calls on "
        f"{dev.platform} ({dev.device_kind}); time_saved / mac_saved >= 0.8 is the target"),
        columns=["plan", "layout", "ms", "vs_dense", "kept_share", "padded_share",
                 "time_saved", "mac_saved", "saved_over_promised"])
    timed = [r for r in out if r["layout"] != "dense"]
    run.bar_plot("ffn_ms", [f"{r['plan']} {r['layout']}" for r in out], [r["ms"] for r in out],
                 ylabel="ms", title="FFN time by layout",
                 hlines={"dense": dense_s * 1e3, "target: 0.8 x the MAC saving":
                         dense_s * 1e3 * (1 - 0.8 * (1 - cfg.keep))})
    best = {r["plan"]: r for r in timed if r["layout"] == "compact"}
    return {"headline": "; ".join(
        f"{p} plan: compact layout saves {r['time_saved']:.0%} of the dense FFN time for "
        f"{r['mac_saved']:.0%} fewer MACs ({r['saved_over_promised']:.2f}x)"
        for p, r in best.items()),
        **{f"{r['plan']} {r['layout']} ms": round(r["ms"], 3) for r in out}}


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run))
