"""Benchmark: does extracting experts save wall-clock time?

Part 1, MoEE plans (``model=minilm``, the default; ``vit``; ``none`` skips it): the MoEE
recipe (:mod:`moejax.extract.pipeline`: record, cluster, select, route) run on a trained
substrate, then every extracted FFN timed on the FFN inputs of one batch of ``rows`` test
examples without padding (MiniLM: glosses at least the mean gloss length long, cut to it)
in three layouts: dense (the unmodified FFN), masked (the trainable oracle: every neuron some
expert keeps, the unused ones zeroed) and compact (each expert's neurons contiguous, each
token through its expert only, by the MoE dispatch: the host kernel on a CPU, the grouped
matmul on GPU/TPU). The serving model is compact with shared neurons: in each layer the
neurons of the most used experts (:func:`moejax.extract.layer_surgery.shared_neurons`, chosen from
the first batch's expert loads, a routed MAC costing ``grouped_cost`` dense ones) are computed
for every token in one masked dense product and only the rest are routed; the whole encoder
is timed in every layout. The MAC
saving each layer promises is exact (:mod:`moejax.extract.macs`, active neurons measured on
the timed batch); the target is FFN time saved >= 0.8 x FFN MACs saved.

Part 2, synthetic plans on one MiniLM-shaped FFN (D 384, F 1536, GELU, biases): ``experts``
experts that each keep ``keep`` of the neurons at random (so they overlap far more than MoEE's
few experts do); ``"equal"`` gives every expert that share, ``"skewed"`` spreads the sizes
linearly from half to one and a half times it (same mean); the compact layout pads every
expert to the largest, and the host kernel skips each expert's padding. Tokens: ``batch`` x
``seq_len`` for each batch of ``batches``, routed uniformly at random. Every compact output is
checked against the masked layout before it is timed.

    python -m experiments.extraction.bench                  # MiniLM MoEE plans + synthetic
    python -m experiments.extraction.bench model=vit        # the ViT substrate's plans
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from moejax.bench.timing import time_interleaved
from moejax.config import config
from moejax.extract.layer_surgery import (
    apply_model,
    compact_model,
    extract_model,
    ffn_holder,
    record_ffn,
    slot_layers,
)
from moejax.extract.macs import ffn_macs, model_macs
from moejax.extract.pipeline import cluster_layers, moee_plans, routing_stats
from moejax.extract.plan import ExpertPlan
from moejax.extract.start import ExtractionSource, source_preset
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.nn.encoder import ViT, vit_config
from moejax.substrates.classifier_data import ClassifierData
from moejax.train.budget import lowered_fitting


@config
class ExtractedBenchConfig(ExtractionSource):
    """Part 1: the substrate whose MoEE plans are timed and its recording, as the moee study
    takes them (:class:`moejax.extract.start.ExtractionSource`; ``model=none``: skip), ``rows``
    (examples per timed batch; the first is judged), ``grouped_cost`` (the serving layout's
    price of a routed MAC in dense MACs, for choosing each layer's shared neurons). Part 2
    (``synthetic``): one FFN of ``d_model`` x ``d_hidden``, ``experts`` random experts
    keeping ``keep`` of the neurons, ``batches`` x ``seq_len`` tokens. ``repeats``:
    interleaved timed calls."""

    model: Literal["minilm", "vit", "none"] = "minilm"
    rows: tuple[int, ...] = (32, 128)
    grouped_cost: float = 2.0
    synthetic: bool = True
    d_model: int = 384
    d_hidden: int = 1536
    experts: int = 16
    keep: float = 0.564  # kept share of the FFN neurons per token
    batches: tuple[int, ...] = (32, 128, 512)
    seq_len: int = 16
    repeats: int = 20
    seed: int = 0

    def unread_fields(self) -> dict[str, str]:
        plans = ("vit", "minilm")  # the MoEE plans' part (model=none: the synthetic part only)
        return {**self._read_only_with("model", {"vit": ("vit",), "minilm": ("minilm",), **{
            f: plans for f in ("extract", "record_rows", "eval_rows", "rows", "grouped_cost")}}),
                **self._read_only_with("synthetic", {f: (True,) for f in (
                    "d_model", "d_hidden", "experts", "keep", "batches", "seq_len")})}

    def validate(self) -> None:
        if self.model != "none":
            super().validate()
        self._require(0 < self.keep < 1, f"keep={self.keep} must be in (0, 1)")
        self._require(self.experts >= 2 and self.seq_len >= 1, "experts >= 2, seq_len >= 1")
        self._require(len(self.batches) > 0 and min(self.batches) >= 1,
                      f"batches={self.batches} must be >= 1")
        self._require(len(self.rows) > 0 and min(self.rows) >= 1 and self.record_rows >= 1
                      and self.repeats >= 1, "rows (each), record_rows and repeats must be >= 1")
        self._require(self.grouped_cost >= 1, f"grouped_cost={self.grouped_cost} must be >= 1")
        self._require(self.model != "none" or self.synthetic,
                      "model=none with synthetic=false times nothing")


def make_config(preset: str) -> ExtractedBenchConfig:
    return ExtractedBenchConfig(**source_preset(preset), repeats=20 if preset == "quick" else 50)


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
    calls = {k: _forward(s) for k, s in slots.items()}
    _fitting({k: (f, x) for k, f in calls.items()}, f"lower batches (now {cfg.batches}) or "
             f"seq_len (now {cfg.seq_len})")
    with jax.default_matmul_precision("highest"):  # GPUs default to TF32 products
        for name, slot in slots.items():
            if name.endswith("compact"):
                want, aux = slots[name.replace("compact", "masked")](x)
                np.testing.assert_allclose(np.asarray(slot(x)[0]), np.asarray(want),
                                           rtol=1e-4, atol=1e-4)
                used[name.split()[0]] = np.asarray(aux["load"]) > 0
    return time_interleaved({k: (lambda f=f: f(x)) for k, f in calls.items()},
                            repeats=cfg.repeats), used


def synthetic_plans(cfg: ExtractedBenchConfig, run: RunDir) -> dict:
    """Part 2 (module docstring): table ``ffn_time`` and plot ``ffn_vs_dense``."""
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
                        "mean_share": float(plan.sizes_E.mean()) / cfg.d_hidden,
                        "sizes": plan.sizes_E, "kept": slots[f"{sizes} masked"].cfg.d_hidden}
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
        f"synthetic plans ({cfg.experts} random experts), compact layout, time saved against "
        f"the dense FFN for {first[0]['mac_saved']:.0%} "
        f"fewer MACs: at {first[0]['tokens']} tokens {say(first)}"
        + (f"; at {last[0]['tokens']} tokens {say(last)}" if last != first else "")
        + f"; target (0.8x the MAC saving at {first[0]['tokens']} tokens) "
        + ("met" if met else "not met")),
        **{f"{r['tokens']} {r['plan']} {r['layout']} ms": round(r["ms"], 3) for r in out}}


def _forward(module, encoder: bool = False):
    """``f(x)``: ``module(x)[0]`` (an FFN slot) or, with ``encoder``, the model's logits on a
    batch dict, jitted over the module's state (split once: no per-call graph traversal)."""
    graphdef, state = nnx.split(module)
    if encoder:
        fn = jax.jit(lambda s, b: apply_model(nnx.merge(graphdef, s), b)[0])
    else:
        fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
    f = lambda x: fn(state, x)  # noqa: E731
    f.lower = lambda x: fn.lower(state, x)  # to check its memory before the first call
    return f


def _fitting(calls: dict, fix: str) -> None:
    """Each ``name: (f, x)`` of :func:`_forward` compiled for its ``x`` and checked against
    the device's memory before any runs (a later call reuses the compilation)."""
    for name, (f, x) in calls.items():
        lowered_fitting(f.lower(x), what=f"the {name} forward", fix=fix)


def _timed_batch(data: ClassifierData, rows: int) -> dict:
    """``rows`` test examples without padding: images as they are; glosses at least the
    mean gloss length long, cut to it (a batch of ``rows`` x the mean length, every token
    real)."""
    if data.seq_len is None:
        if len(data.test["inputs"]) < rows:
            raise ValueError(f"rows={rows}: the test split holds {len(data.test['inputs'])} "
                             "images; lower rows (or raise eval_rows)")
        return {"inputs": data.test["inputs"][:rows]}
    length = int(round(data.seq_len))
    idx = np.flatnonzero(data.test["mask"].sum(1) >= length)[:rows]
    if len(idx) < rows:
        raise ValueError(f"rows={rows}: only {len(idx)} of the {len(data.test['mask'])} test "
                         f"glosses hold {length} tokens; lower rows or raise eval_rows")
    return {"inputs": data.test["inputs"][idx, :length], "mask": data.test["mask"][idx, :length]}


def _n_tokens(data: ClassifierData, batch: dict) -> int:
    if data.seq_len is None:
        return len(batch["inputs"]) * (1 + ffn_holder(data.model).cfg.n_patches)
    return int(np.sum(batch["mask"]))


def _time_layouts(cfg, data, models: dict, stats: dict, batch: dict) -> tuple[list, list]:
    """Per-layer FFN rows (``all`` last) and whole-model rows of one batch (``stats``: its
    :func:`routing_stats`), after checking every compact and serving output against the
    masked layout's."""
    masked, dense = ffn_holder(models["masked"]), ffn_holder(data.model)
    served = ffn_holder(models["serving"])
    layers, tokens = slot_layers(models["masked"]), _n_tokens(data, batch)
    active = {i: s["active_neurons"] for i, s in stats.items()}
    xs = {i: jnp.asarray(x)[None] for i, (x, _) in record_ffn(
        data.model, [batch], n_tokens=tokens, layers=layers).items()}
    names = ("dense", "masked", "compact", "serving")
    fns = {(i, name): _forward(ffn_holder(models[name]).blocks[i].ffn)
           for i in layers for name in names}
    encs = {name: _forward(m, encoder=True) for name, m in models.items()}
    _fitting({**{f"layer {i} {name}": (f, xs[i]) for (i, name), f in fns.items()},
              **{f"{name} model": (f, batch) for name, f in encs.items()}},
             f"lower rows (now {cfg.rows})")
    with jax.default_matmul_precision("highest"):  # GPUs default to TF32 products
        for i in layers:
            for name in ("compact", "serving"):
                np.testing.assert_allclose(np.asarray(fns[i, name](xs[i])),
                                           np.asarray(fns[i, "masked"](xs[i])),
                                           rtol=1e-4, atol=1e-4)
        want = np.asarray(encs["masked"](batch))
        for name in ("compact", "serving"):
            np.testing.assert_allclose(np.asarray(encs[name](batch)), want, rtol=1e-4, atol=1e-4)
    t = time_interleaved({f"{i} {name}": (lambda f=f, x=xs[i]: f(x))
                          for (i, name), f in fns.items()}, repeats=cfg.repeats)
    ms = {k: v["median_s"] * 1e3 for k, v in t.items()}
    D = dense.cfg.d_model
    macs = lambda c, a=None: sum(ffn_macs(c, D, tokens, a).values())  # noqa: E731
    rows = []
    for i in layers:
        slot, srv = masked.blocks[i].ffn.cfg, served.blocks[i].ffn.cfg
        rows.append({"tokens": tokens, "layer": i, "experts": slot.n_experts,
                     "neurons": dense.cfg.ffn_slots[i].d_hidden, "kept": slot.d_hidden,
                     "active": active[i], "shared": srv.d_shared, "routed": srv.d_expert,
                     **{f"{name}_ms": ms[f"{i} {name}"] for name in names},
                     "_dense_macs": macs(dense.cfg.ffn_slots[i]), "_macs": macs(slot, active[i])})
    rows.append({"tokens": tokens, "layer": "all", **{k: sum(r[k] for r in rows) for k in (
        "dense_ms", "masked_ms", "compact_ms", "serving_ms", "_dense_macs", "_macs")}})
    for r in rows:
        r["mac_saved"] = 1 - r["_macs"] / r["_dense_macs"]
        for lay in ("masked", "compact", "serving"):
            r[f"{lay}_saved"] = 1 - r[f"{lay}_ms"] / r["dense_ms"]
        r["serving_over_macs"] = r["serving_saved"] / r["mac_saved"]
    te = time_interleaved({n: (lambda f=f: f(batch)) for n, f in encs.items()},
                          repeats=cfg.repeats)
    length = None if data.seq_len is None else float(np.shape(batch["inputs"])[1])
    saved = 1 - model_macs(models["masked"], length, active)["total"] / model_macs(
        data.model, length)["total"]
    enc = [{"tokens": tokens, "model": n, "ms": v["median_s"] * 1e3,
            "speedup": te["dense"]["median_s"] / v["median_s"],
            "time_saved": 1 - v["median_s"] / te["dense"]["median_s"],
            "mac_saved": 0.0 if n == "dense" else saved} for n, v in te.items()]
    return rows, enc


def moee_plans_part(cfg: ExtractedBenchConfig, run: RunDir) -> dict:
    """Part 1 (module docstring): tables ``moee_ffn`` and ``moee_encoder``."""
    data = cfg.classifier_data()
    # the timed batches first: a size the test glosses cannot fill fails before any recording
    batches = [_timed_batch(data, r) for r in cfg.rows]
    ex = cfg.extract
    records = record_ffn(data.model, data.record_batches(cfg.record_rows, cfg.seed),
                         n_tokens=ex.n_tokens, seed=cfg.seed)
    plans = moee_plans(records, cluster_layers(records, ex.cluster, seed=cfg.seed), ex,
                       seed=cfg.seed)
    masked = extract_model(data.model, plans, router=ex.router)
    layers = slot_layers(masked)
    if not layers:
        run.note(f"MoEE formed no cluster in any layer of {data.substrate}: nothing to time.")
        return {"headline": f"MoEE plans ({cfg.model}): no layer extracted"}
    stats = [routing_stats(masked, [b]) for b in batches]
    loads = {i: np.asarray(s["load"]) for i, s in stats[0].items()}  # the first batch's
    models = {"dense": data.model, "masked": masked, "compact": compact_model(masked),
              "serving": compact_model(masked, loads=loads, grouped_cost=cfg.grouped_cost)}
    ffn, enc = [], []
    for batch, st in tqdm(list(zip(batches, stats)), desc="batches", leave=False):
        f, e = _time_layouts(cfg, data, models, st, batch)
        ffn, enc = ffn + f, enc + e
    dev = jax.devices()[0]
    where = f"{dev.platform} ({dev.device_kind})"
    shape = ("rows x 1 + patches" if data.seq_len is None
             else f"rows x {np.shape(batches[0]['inputs'])[1]} (the mean gloss length)")
    run.table("moee_ffn", ffn, title=(
        f"MoEE-extracted FFNs of {data.substrate} on the FFN inputs of batches of {shape} "
        f"real tokens, rows in {list(cfg.rows)}; median of {cfg.repeats} interleaved calls on "
        f"{where}; kept: neurons some expert keeps (the masked layout's width); active: "
        "neurons a token's expert uses, mean over the batch; mac_saved: 1 - the layer's MACs "
        "(router + experts) / the dense FFN's; compact: every neuron routed; serving: "
        "shared neurons computed for every token in one masked dense product, the routed "
        "rest per expert (the widest expert's, padded), chosen from the first batch's loads "
        f"with a routed MAC at {cfg.grouped_cost:g} dense ones; *_saved: 1 - time / dense "
        "time; target: serving_over_macs >= 0.8"),
        columns=["tokens", "layer", "experts", "neurons", "kept", "active", "mac_saved",
                 "dense_ms", "masked_ms", "compact_ms", "shared", "routed", "serving_ms",
                 "masked_saved", "compact_saved", "serving_saved", "serving_over_macs"])
    run.table("moee_encoder", enc, title=(
        f"The whole {cfg.model} model (every layer, head included) on the same batches, "
        f"median of {cfg.repeats} interleaved calls on {where}; compact: every extracted "
        "layer compact, every neuron routed; serving: shared neurons dense (table above); "
        "mac_saved: the whole model's MAC saving"))
    run.note(f"MoEE on {data.substrate}: extracted layers {layers} with "
             f"{[ffn_holder(masked).blocks[i].ffn.cfg.n_experts for i in layers]} experts; "
             f"serving: shared neurons "
             f"{[ffn_holder(models['serving']).blocks[i].ffn.cfg.d_shared for i in layers]}, "
             "the rest routed.")
    a = next(r for r in ffn if r["layer"] == "all")
    srv = next(r for r in enc if r["model"] == "serving")
    return {"headline": (
        f"MoEE plans ({cfg.model}, {a['tokens']} tokens): FFN MACs {-a['mac_saved']:+.1%}, "
        f"FFN time {-a['serving_saved']:+.1%} served (masked {-a['masked_saved']:+.1%}, all "
        f"compact {-a['compact_saved']:+.1%}), {a['serving_over_macs']:.2f}x the MAC saving, "
        "target 0.8x " + ("met" if a["serving_over_macs"] >= 0.8 else "not met")
        + f"; whole model {srv['speedup']:.2f}x the dense speed for "
        f"{-srv['mac_saved']:+.1%} MACs"),
        "ffn_mac_saved": round(a["mac_saved"], 4), "ffn_time_saved": round(a["serving_saved"], 4),
        "encoder_speedup": round(srv["speedup"], 3)}


def run(cfg: ExtractedBenchConfig, run: RunDir) -> dict:
    parts = ([moee_plans_part(cfg, run)] if cfg.model != "none" else []) + (
        [synthetic_plans(cfg, run)] if cfg.synthetic else [])
    out = {k: v for p in parts for k, v in p.items() if k != "headline"}
    return {"headline": "; ".join(p["headline"] for p in parts), **out}


STUDY = Study(
    "bench_extracted", make_config, run,
    smoke=("repeats=1", "rows=(32,)", "batches=(32,)", "record_rows=200", "eval_rows=128",
             "extract.n_tokens=2000"),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
