"""Benchmark: does extracting experts save wall-clock time? One MiniLM-shaped FFN (D 384,
F 1536, GELU, biases) timed dense, as extracted experts in the masked layout (the trainable
oracle: every kept neuron computed) and in the compact layout (each expert's neurons
contiguous, tokens routed through the MoE dispatch: the host kernel on a CPU), against the
MAC reduction each plan promises.

Plans are synthetic, one expert per token (MoEE's routing): ``experts`` experts that each keep
``keep`` of the neurons; ``"equal"`` gives every expert that share, ``"skewed"`` spreads the
sizes linearly from half to one and a half times it (same mean); the compact layout pads
every expert to the largest, and the host kernel skips each expert's padding. Tokens:
``batch`` x ``seq_len`` for each batch of ``batches`` (MiniLM's mean sentence length in the
MoEE study's data is about 16 tokens; the first batch is the one the target is judged at),
routed uniformly at random.

    python -m experiments.bench_extracted
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

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
    batches: tuple[int, ...] = (32, 128, 512)
    seq_len: int = 16
    repeats: int = 20
    seed: int = 0

    def validate(self) -> None:
        self._require(0 < self.keep < 1, f"keep={self.keep} must be in (0, 1)")
        self._require(self.experts >= 2 and self.seq_len >= 1, "experts >= 2, seq_len >= 1")
        self._require(len(self.batches) > 0 and min(self.batches) >= 1,
                      f"batches={self.batches} must be >= 1")


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


def _time_batch(cfg, slots: dict, batch: int, rng) -> tuple[dict, dict]:
    """Median seconds of each slot on ``batch`` x ``seq_len`` tokens (interleaved calls),
    after checking the compact layouts against the masked ones; and per plan, which experts
    the tokens use (bool ``[C]``)."""
    x = jnp.asarray(rng.normal(size=(batch, cfg.seq_len, cfg.d_model)), jnp.float32)
    used = {}
    with jax.default_matmul_precision("highest"):  # GPUs default to TF32 products
        for name, slot in slots.items():
            if name.endswith("compact"):
                want, aux = slots[name.replace("compact", "masked")](x)
                np.testing.assert_allclose(np.asarray(slot(x)[0]), np.asarray(want),
                                           rtol=1e-4, atol=1e-4)
                used[name.split()[0]] = np.asarray(aux["load"]) > 0
    call = nnx.jit(lambda m, x: m(x)[0])
    return time_interleaved({k: (lambda s=s: call(s, x)) for k, s in slots.items()},
                            repeats=cfg.repeats), used


def run(cfg: ExtractedBenchConfig, run: RunDir) -> dict:
    rng = np.random.default_rng(cfg.seed)
    vit = ViT(vit_config(image_size=8, patch_size=4, d_model=cfg.d_model, n_layers=1,
                         n_heads=4, d_hidden=cfg.d_hidden, n_classes=2, n_channels=1),
              rngs=nnx.Rngs(cfg.seed))
    slots, plans = {"dense": vit.blocks[0].ffn}, {}
    for sizes in ("equal", "skewed"):
        plan = _plan(cfg, sizes, rng)
        slots[f"{sizes} masked"] = extract_model(vit, {0: plan}, router="dot").blocks[0].ffn
        slots[f"{sizes} compact"] = compact = compact_model(
            extract_model(vit, {0: plan}, router="dot")).blocks[0].ffn
        plans[sizes] = {"padded_share": compact.cfg.d_expert / cfg.d_hidden,
                        "mean_share": float(plan.sizes_C.mean()) / cfg.d_hidden,
                        "sizes": plan.sizes_C, "kept": slots[f"{sizes} masked"].cfg.d_hidden}
    out = []
    for batch in tqdm(cfg.batches, desc="batches", leave=False):
        times, used = _time_batch(cfg, slots, batch, rng)
        dense_s = times["dense"]["median_s"]
        tokens = batch * cfg.seq_len
        mb = lambda neurons: 2 * cfg.d_model * neurons * 4 / 1e6  # noqa: E731  W_up + W_down
        out.append({"tokens": tokens, "plan": "-", "layout": "dense", "ms": dense_s * 1e3,
                    "vs_dense": 1.0, "weight_mb": mb(cfg.d_hidden)})
        for name in slots:
            if name == "dense":
                continue
            sizes, layout = name.split()
            t = times[name]["median_s"]
            saved, promised = 1 - t / dense_s, 1 - plans[sizes]["mean_share"]
            pl = plans[sizes]
            read = (mb(pl["kept"]) if layout == "masked"  # compact: each used expert's copy
                    else mb(int(np.sum(pl["sizes"][used[sizes]]))))
            out.append({"tokens": tokens, "plan": sizes, "layout": layout, "ms": t * 1e3,
                        "vs_dense": t / dense_s, "weight_mb": read,
                        "experts_used": int(np.sum(used[sizes])),
                        "kept_share": plans[sizes]["mean_share"],
                        "padded_share": plans[sizes]["padded_share"], "time_saved": saved,
                        "mac_saved": promised, "saved_over_promised": saved / promised})
    dev = jax.devices()[0]
    run.table("ffn_time", out, title=(
        f"One FFN (D {cfg.d_model}, F {cfg.d_hidden}, GELU) on batch x {cfg.seq_len} tokens, "
        f"{cfg.experts} experts, top-1, median of {cfg.repeats} interleaved calls on "
        f"{dev.platform} ({dev.device_kind}); kept_share: the mean expert's share of the "
        "neurons (its MACs); weight_mb: expert weights read per call (W_up and W_down, "
        "float32; compact: every used expert's own copy of its neurons, so experts that "
        "share neurons read them once each); time_saved / mac_saved >= 0.8 is the target"),
        columns=["tokens", "plan", "layout", "ms", "vs_dense", "weight_mb", "experts_used",
                 "kept_share", "padded_share", "time_saved", "mac_saved",
                 "saved_over_promised"])
    series = {f"{p} {lay}": ([r["tokens"] for r in out if r["plan"] == p and r["layout"] == lay],
                             [r["vs_dense"] for r in out if r["plan"] == p
                              and r["layout"] == lay])
              for p in plans for lay in ("masked", "compact")}
    run.line_plot("ffn_vs_dense", series, xlabel="tokens", ylabel="time / dense FFN time",
                  markers=True, logx=True, title="Extracted FFN time against the dense FFN",
                  hlines={"dense": 1.0, "target: 1 - 0.8 x the MAC saving":
                          1 - 0.8 * (1 - cfg.keep)})
    compact = [r for r in out if r["layout"] == "compact"]
    first = [r for r in compact if r["tokens"] == cfg.batches[0] * cfg.seq_len]
    last = [r for r in compact if r["tokens"] == cfg.batches[-1] * cfg.seq_len]
    say = lambda rs: "; ".join(  # noqa: E731
        f"{r['plan']} plan {r['time_saved']:.0%} ({r['saved_over_promised']:.2f}x)" for r in rs)
    met = all(r["saved_over_promised"] >= 0.8 for r in first)
    return {"headline": (
        f"compact layout, time saved against the dense FFN for {first[0]['mac_saved']:.0%} "
        f"fewer MACs: at {first[0]['tokens']} tokens {say(first)}"
        + (f"; at {last[0]['tokens']} tokens {say(last)}" if last != first else "")
        + f"; target (0.8x the MAC saving at {first[0]['tokens']} tokens) "
        + ("met" if met else "not met")),
        **{f"{r['tokens']} {r['plan']} {r['layout']} ms": round(r["ms"], 3) for r in out}}


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run))
