"""DeRS compression of vanilla upcycled MoEs (paper section 3.3, Tables S13-S18, Fig. 1, 4-6).

Two scenarios, each: dense LM -> vanilla upcycling -> training on the downstream corpus ->
Decompose (``W_i = W_base + Delta_i``, ``W_base`` = the dense FFN the experts were copied from)
-> Replace (DARE sparsification at drop rates / k-bit quantisation of the deltas) -> Synthesis.

* ``finetuned`` (MoE-LLaVA analog): the dense model was pre-fine-tuned on the downstream
  domain before upcycling; every other block, N=4, top-2.
* ``not_finetuned`` (Coder-MoE analog): upcycled straight from the pre-trained dense model;
  universal FFN + MoE (N=4, top-1) in every other block; also the extended variant that
  decomposes the universal FFN together with the experts (N+1 deltas).

Outputs: validation loss against stored parameters and bytes for every setting, the cosine
similarity of the trained experts to the base and to each other per layer (Fig. 1 analog),
and a compressed orbax checkpoint per scenario (drop 0.9 and 4 bits) re-loaded and evaluated
with on-the-fly expert synthesis, with compiled peak inference memory.

    python -m experiments.ders.compression                    # quick (CPU)
    python -m experiments.ders.compression preset=full        # SmolLM2-135M-Instruct (GPU)
"""

from __future__ import annotations

import shutil
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from experiments.ders.common import PAPER_SCALE
from experiments.ders.compression_claims import claims
from moejax.config import Config, config
from moejax.ders_compress import (
    QuantSpec,
    bases_from_dense,
    build_synth_model,
    compress,
    compression_report,
    decompose,
    decompress,
    decompress_deltas,
    disk_bytes,
    expert_cosines,
    load_compressed,
    recompose,
    save_compressed,
)
from moejax.evaluate import LMEvaluator
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.pytree import fmt_count
from moejax.substrates.ders import FULL_PRESET, SubstrateConfig, batches, dense_substrate, fit
from moejax.train.hparams import TrainConfig, require_read
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig, output_scale, upcycle_model, upcycled_layers

SCENARIOS = {
    "finetuned": (True, UpcycleConfig(blocks="every_other",
                                      moe=UPCYCLE_MOE.replace(n_experts=4, top_k=2))),
    "not_finetuned": (False, UpcycleConfig(
        blocks="every_other", moe=UPCYCLE_MOE.replace(n_experts=4, top_k=1, universal_ffn=True))),
}


@config
class DeRSCompressionConfig(Config):
    NONEMPTY = ("scenarios",)

    substrate: SubstrateConfig = SubstrateConfig()
    train: TrainConfig = TrainConfig(steps=200, batch_size=16, lr=3e-4, warmup_steps=20,
                                     log_every=50, seed=2)
    drop_rates: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.99)
    bits: tuple[int, ...] = (16, 8, 4, 2, 1)
    scenarios: tuple[Literal["finetuned", "not_finetuned"], ...] = ("finetuned", "not_finetuned")
    eval_batches: int = 8
    ckpt_drop: float = 0.9
    ckpt_bits: int = 4
    # The k-bit quantiser (the paper does not name one): midrise 2^k levels per group of
    # quant_group input rows, 1 bit = sign x mean|delta|; "symmetric" + "channel" quantises
    # per output column (2^k - 1 levels from the column max).
    quant_scheme: Literal["midrise", "symmetric"] = "midrise"
    quant_granularity: Literal["group", "channel"] = "group"
    quant_group: int = 64

    def unread_fields(self) -> dict[str, str]:
        return {f"substrate.{field}": f"read only with {name!r} in scenarios (this config has "
                                      f"scenarios={self.scenarios})"
                for name, field in (("finetuned", "prefinetuned"),
                                    ("not_finetuned", "pretrained"))
                if name not in self.scenarios}

    def validate(self) -> None:
        require_read(self, "train", "each upcycled model's training")
        self._require(all(s in SCENARIOS for s in self.scenarios),
                      f"scenarios={self.scenarios}; allowed: {tuple(SCENARIOS)}")
        self._require(all(0 <= p < 1 for p in self.drop_rates), "drop_rates must be in [0, 1)")
        self._require(all(b in (1, 2, 3, 4, 5, 6, 7, 8, 16) for b in self.bits),
                      "bits must be in 1..8 or 16")
        self._require(self.quant_group >= 1, f"quant_group={self.quant_group} must be >= 1")
        self._require(0 <= self.ckpt_drop < 1, f"ckpt_drop={self.ckpt_drop} must be in [0, 1) "
                      "(1 would drop every delta and divide by zero in the rescale)")
        self._require(self.ckpt_bits in (1, 2, 3, 4, 5, 6, 7, 8),
                      f"ckpt_bits={self.ckpt_bits} must be in 1..8")

    @property
    def quant(self) -> QuantSpec:
        return QuantSpec(self.quant_scheme, self.quant_granularity, self.quant_group)


def make_config(preset: str) -> DeRSCompressionConfig:
    if preset == "quick":
        return DeRSCompressionConfig()
    return DeRSCompressionConfig(**FULL_PRESET)


def _params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _with_params(model, pure):
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _similarity_rows(name: str, pure, base) -> tuple[list[dict], list[dict]]:
    """Per MoE layer: the trained experts' cosine similarity to the base FFN and to each other
    (summary rows) and the full matrix, base first (Fig. 1 analog)."""
    cos_rows, mat_rows = [], []
    for i, c in expert_cosines(pure, base).items():
        n = c["pairwise"].shape[0]
        names = ["FFN"] + [f"E{j + 1}" for j in range(n)]
        full = np.ones((n + 1, n + 1))
        full[0, 1:] = full[1:, 0] = c["to_base"]
        full[1:, 1:] = c["pairwise"]
        mat_rows += [{"scenario": name, "layer": int(i), "weight": a,
                      **{b: f"{v:.6f}" for b, v in zip(names, row)}}
                     for a, row in zip(names, full)]
        off = c["pairwise"][~np.eye(n, dtype=bool)]
        cos_rows.append({"scenario": name, "layer": int(i), "min_cos_to_base": c["to_base"].min(),
                         "mean_1-cos_to_base": float(np.mean(1 - c["to_base"])),
                         "min_cos_pairwise": off.min(),
                         "mean_1-cos_pairwise": float(np.mean(1 - off))})
    return cos_rows, mat_rows


def _settings(cfg) -> list[tuple[str, Any]]:
    return ([("none", "fp32")] + [("sparse", p) for p in cfg.drop_rates]
            + [("quant", b) for b in cfg.bits])


def _compressed(cfg, dec, method: str, setting, key):
    if method == "sparse":
        return compress(dec, "sparse", drop_rate=setting, key=key)
    if method == "quant":
        return compress(dec, "quant", bits=setting, quant=cfg.quant)
    return compress(dec, "none")


def _sweep_rows(cfg, name: str, decomp: str, dec, moe, moe_loss: float, evaluate, key):
    """The compression sweep of one decomposition: every delta dropped (how much the deltas
    matter at all), then every setting; each row's stored size, error and loss change."""
    zero = {i: {w: np.zeros_like(a) for w, a in layer.items()}
            for i, layer in dec.deltas.items()}
    rep = compression_report(compress(dec, "sparse", drop_rate=0.0, key=key))
    loss = evaluate(_with_params(moe, recompose(dec, zero)))["loss"]
    rows = [{"scenario": name, "decomposed": decomp, "method": "base_only",
             "setting": "all deltas dropped", "expert_params": rep["base"],
             "expert_params_with_index": rep["base"],
             "vanilla_expert_params": rep["vanilla_expert_params"], "delta_bytes": 0,
             "expert_bytes": rep["expert_bytes"] - rep["delta_bytes"],
             "vanilla_expert_bytes": rep["vanilla_expert_bytes"], "rel_err": 1.0,
             "val_loss": loss, "d_loss": loss - moe_loss}]
    norm = sum(float(np.sum(a ** 2)) for layer in dec.deltas.values() for a in layer.values())
    for method, setting in _settings(cfg):
        c = _compressed(cfg, dec, method, setting, key)
        rep, got = compression_report(c), decompress_deltas(c)
        err = sum(float(np.sum((got[i][w] - a) ** 2)) for i, layer in dec.deltas.items()
                  for w, a in layer.items())
        loss = evaluate(_with_params(moe, decompress(c)))["loss"]
        rows.append({"scenario": name, "decomposed": decomp, "method": method,
                     "setting": setting, "expert_params": rep["expert_params"],
                     "expert_params_with_index": rep["expert_params_with_index"],
                     "vanilla_expert_params": rep["vanilla_expert_params"],
                     "delta_bytes": rep["delta_bytes"], "expert_bytes": rep["expert_bytes"],
                     "vanilla_expert_bytes": rep["vanilla_expert_bytes"],
                     "rel_err": (err / norm) ** 0.5 if norm else 0.0,
                     "val_loss": loss, "d_loss": loss - moe_loss})
    return rows


def _checkpoint_rows(cfg, run: RunDir, name: str, decomp: str, dec, moe, evaluate, key):
    """A compressed orbax checkpoint per method, reloaded and evaluated by on-the-fly expert
    synthesis and by decompressing it."""
    rows = []
    for method, kw in (("sparse", {"drop_rate": cfg.ckpt_drop}),
                       ("quant", {"bits": cfg.ckpt_bits})):
        c = compress(dec, method, key=key, quant=cfg.quant, **kw)
        path = run.path / f"ckpt_{name}_{decomp.replace('+', '_')}_{method}"
        shutil.rmtree(path, ignore_errors=True)
        save_compressed(path, c, moe.cfg)
        c2, moe_cfg = load_compressed(path)
        synth = build_synth_model(type(moe), moe_cfg, c2)
        rows.append({
            "scenario": name, "decomposed": decomp, "method": method,
            "setting": kw.get("drop_rate", kw.get("bits")),
            "synth_val_loss": evaluate(synth)["loss"],
            "decompressed_val_loss": evaluate(_with_params(moe, decompress(c2)))["loss"],
            "expert_bytes": compression_report(c2)["expert_bytes"],
            "disk_bytes": disk_bytes(path),
            "peak_infer_bytes_synth": evaluate.memory(synth)["peak_bytes"],
            "peak_infer_bytes_vanilla": evaluate.memory(moe)["peak_bytes"]})
    return rows


def _scenario(cfg, run: RunDir, name: str, evaluate) -> dict:
    """One scenario: the dense substrate upcycled and trained, its experts decomposed into a
    base and deltas, then the similarity, sweep and checkpoint rows and the losses."""
    key = jax.random.fold_in(jax.random.key(cfg.train.seed), 7)  # DeRS-sparse draws
    s = cfg.substrate
    prefinetune, rule = SCENARIOS[name]
    dense, origin = dense_substrate(s, prefinetune=prefinetune)
    run.note(f"Scenario {name}: upcycled from {origin}.")
    dense_loss = evaluate(dense)["loss"]
    moe = upcycle_model(dense, rule, jax.random.key(cfg.train.seed))
    src = batches(s.downstream_corpus, "train", batch_size=cfg.train.batch_size,
                  seq_len=s.seq_len, seed=100 + cfg.train.seed, source=s.source)
    fit(moe, src, cfg.train, desc=f"upcycled ({name})")
    moe_loss = evaluate(moe)["loss"]
    pure = _params(moe)
    layers = upcycled_layers(dense.cfg.n_layers, rule)  # the model upcycled (SmolLM2: 30)
    base = bases_from_dense(_params(dense), layers, output_scale(rule))
    cos_rows, mat_rows = _similarity_rows(name, pure, base)
    rows, ckpt_rows = [], []
    variants = [("experts", False)] + ([("experts+universal", True)] if rule.moe.universal_ffn
                                       else [])
    for decomp, extended in variants:
        dec = decompose(pure, base, extended=extended)
        rows += _sweep_rows(cfg, name, decomp, dec, moe, moe_loss, evaluate, key)
        ckpt_rows += _checkpoint_rows(cfg, run, name, decomp, dec, moe, evaluate, key)
    return {"rows": rows, "cos_rows": cos_rows, "mat_rows": mat_rows, "ckpt_rows": ckpt_rows,
            "losses": {"scenario": name, "dense_val_loss": dense_loss,
                       "upcycled_val_loss": moe_loss}}


def _curves(rows: list[dict]) -> dict:
    """Per scenario, decomposition and compression method: (stored parameters, bytes, loss
    change) of each setting."""
    out = {}
    for r in rows:
        if r["method"] in ("sparse", "quant"):
            out.setdefault(f"{r['scenario']}/{r['decomposed']}/{r['method']}", []).append(
                (r["expert_params_with_index"], r["expert_bytes"], r["d_loss"]))
    return out


def run(cfg: DeRSCompressionConfig, run: RunDir) -> dict:
    s = cfg.substrate
    val = batches(s.downstream_corpus, "validation", batch_size=cfg.train.batch_size,
                  seq_len=s.seq_len, seed=10_000, source=s.source)
    evaluate = LMEvaluator.from_source(val, cfg.eval_batches)
    parts = [_scenario(cfg, run, name, evaluate) for name in cfg.scenarios]
    rows, cos_rows, mat_rows, ckpt_rows = ([r for p in parts for r in p[k]] for k in (
        "rows", "cos_rows", "mat_rows", "ckpt_rows"))
    run.table("losses", [p["losses"] for p in parts], title="Dense vs trained vanilla "
              "upcycled MoE (validation cross-entropy, nats/byte, downstream corpus)")
    run.table("sweep", rows, title="DeRS compression sweep: validation loss vs stored expert "
              "parameters (paper count = base + kept values; with_index also charges the "
              "index vector) and bytes")
    run.table("similarity", cos_rows, title="Cosine similarity of trained experts to the base "
              "FFN and to each other (Fig. 1 analog; flattened gate|up|down)")
    run.table("similarity_matrix", mat_rows, title="Fig. 1 analog: cosine similarity "
              "between the base FFN and the trained experts, per MoE layer")
    run.table("checkpoint", ckpt_rows, title="Compressed orbax checkpoint, reloaded, evaluated "
              "by on-the-fly expert synthesis (peak inference memory = XLA compiled memory "
              "analysis of one evaluation step, not process RSS)")
    _plots(cfg, run, rows, cos_rows)
    run.note(f"Quantiser: {cfg.quant_scheme}, scales per {cfg.quant_granularity}"
             + (f" of {cfg.quant_group} input rows" if cfg.quant_granularity == "group" else "")
             + " (the paper names none). rel_err = ||F(Delta) - Delta|| / ||Delta|| over all "
             "deltas; the base_only row drops every delta (rel_err 1).")
    return {"headline": "DeRS compression, validation-loss change vs uncompressed: "
            + _headline(cfg, rows), "n_settings": len(rows), "vanilla_expert_params": fmt_count(
                rows[0]["vanilla_expert_params"]) if rows else ""}


def _plots(cfg: DeRSCompressionConfig, run: RunDir, rows: list[dict], cos_rows) -> None:
    """Loss against stored parameters and bytes (with the uncompressed and every-delta-dropped
    references), and the experts' similarity per layer (Fig. 1)."""
    curves = _curves(rows)
    refs = {"uncompressed": 0.0}  # and every delta dropped, per scenario (the worst case)
    refs.update({f"base only ({r['scenario']})": r["d_loss"] for r in rows
                 if r["method"] == "base_only" and r["decomposed"] == "experts"})
    run.line_plot("loss_vs_params", {k: ([p for p, _, _ in v], [loss for _, _, loss in v])
                                     for k, v in curves.items() if k.endswith("/sparse")},
                  logx=True, markers=True,
                  xlabel="stored expert parameters incl. index (base + deltas)",
                  ylabel="val loss increase vs uncompressed (nats/byte)",
                  title="DeRS compression", hlines=refs)
    run.line_plot("loss_vs_bytes", {k: ([b for _, b, _ in v], [loss for _, _, loss in v])
                                    for k, v in curves.items()}, logx=True, markers=True,
                  xlabel="expert bytes (base + compact deltas)",
                  ylabel="val loss increase vs uncompressed (nats/byte)",
                  title="DeRS compression (bytes)", hlines=refs)
    sim = {}
    for name in cfg.scenarios:
        r = [x for x in cos_rows if x["scenario"] == name]
        sim[f"{name}: 1-cos to base"] = ([x["layer"] for x in r],
                                         [x["mean_1-cos_to_base"] for x in r])
        sim[f"{name}: 1-cos pairwise"] = ([x["layer"] for x in r],
                                          [x["mean_1-cos_pairwise"] for x in r])
    run.line_plot("similarity", sim, xlabel="layer", ylabel="1 - cosine similarity",
                  logy=True, markers=True, title="Trained experts vs base (Fig. 1 analog)")


def _headline(cfg: DeRSCompressionConfig, rows: list[dict]) -> str:
    """Each scenario's loss change at its two highest drop rates and two fewest bits (the
    most compressed settings the run swept), and with every delta dropped."""
    def at(name, method, setting):
        for r in rows:
            if (r["scenario"], r["decomposed"], r["method"], r["setting"]) == (
                    name, "experts", method, setting):
                return r["d_loss"]
        return float("nan")

    rates = sorted(p for p in set(cfg.drop_rates) if p > 0)[-2:]
    bits = sorted(set(cfg.bits), reverse=True)[-2:]

    def one(n):
        parts = ([f"drop{p:g} {at(n, 'sparse', p):+.4f}" for p in rates]
                 + [f"{b}-bit {at(n, 'quant', b):+.4f}" for b in bits])
        return (f"{n}: d_loss {', '.join(parts)}, base only "
                f"{at(n, 'base_only', 'all deltas dropped'):+.4f}")

    return "; ".join(one(n) for n in cfg.scenarios)


STUDY = Study(
    "ders_compression", make_config, run, claims=claims,
    seed_keys=("train.seed",),
    quick_repeat=5,
    paper_scale=PAPER_SCALE,
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
