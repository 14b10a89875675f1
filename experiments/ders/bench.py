"""Benchmark: what DeRS's compressed experts save at run time (DeRS Sec. 3.4). One dense
decoder LM upcycled into an MoE three ways: vanilla (``N`` full expert copies), DeRS-SM and
DeRS-LM (one shared weight plus sparse / low-rank increments per expert), then decoded greedily
at batch 1. DeRS runs two ways: ``synthesis="all"`` builds every expert's weights each step
(the training-time formulation); ``"selected"`` applies the shared weight once per token and
only the selected experts' increments (:mod:`moejax.ops.ders_apply`). The increments are drawn
at random (non-zero, as after training) and the ``selected`` tokens must equal the ``all``
tokens.

Each row: decode tokens/s, the weight bytes read per generated token
(:func:`moejax.nn.ders_moe.expert_bytes_per_token` for the experts, plus every other weight
once) and the memory-bandwidth bound beside it (the bytes over this machine's copy bandwidth,
measured here: bytes read plus written by a large numpy copy). A row faster than its bound
did not read what it is charged, and the run's notes name it (:func:`beyond_bound`).

Training memory (``train_memory``): XLA's compiled temporaries of one loss gradient over
``train_batch`` x ``train_seq`` tokens, every model on the capacity dispatch (factor
``capacity``): vanilla, DeRS synthesising every expert (``"all"``: the ``N`` copies kept for
the backward) and DeRS streaming one expert at a time (``"stream"``).

    python -m experiments.ders.bench                 # >= 100M parameters (vanilla), CPU
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.bench.decode_timing import decode_timing
from moejax.config import Config, config
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.nn.decoder import DecoderLM, dense_decoder_config
from moejax.nn.ders_moe import DeRSMoE, check_lm_rank, expert_bytes_per_token
from moejax.nn.moe import MoE
from moejax.nn.surgery import with_slot_config
from moejax.ops.losses import cross_entropy
from moejax.pytree import count_params
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig, upcycle_model


@config
class DeRSBenchConfig(Config):
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    d_hidden: int = 1408
    n_experts: int = 8
    top_k: int = 2
    sm_rate: float = 0.99
    lm_rank: int = 16
    vocab_size: int = 256
    n_prompts: int = 4
    prompt_len: int = 16
    max_new_tokens: int = 32
    train_batch: int = 16
    train_seq: int = 48
    capacity: float = 1.25
    seed: int = 0

    def validate(self) -> None:
        r = self._require
        r(1 <= self.top_k <= self.n_experts, "top_k must be in [1, n_experts]")
        r(0 <= self.sm_rate < 1 and self.lm_rank >= 1, "sm_rate in [0, 1), lm_rank >= 1")
        r(min(self.n_prompts, self.prompt_len, self.max_new_tokens) >= 1,
          "n_prompts, prompt_len and max_new_tokens must be >= 1")
        r(self.train_batch >= 1 and 1 <= self.train_seq <= self.prompt_len
          + self.max_new_tokens + 7, "train_batch >= 1 and train_seq within the models' "
          "max_seq_len (prompt_len + max_new_tokens + 8, minus the shifted target)")
        r(self.capacity > 0, f"capacity={self.capacity} must be > 0")
        self._checked(self.dense_config)  # heads that divide d_model ...
        self._checked(check_lm_rank, self.lm_rank, "gate", self.d_model, self.d_hidden)

    def dense_config(self):
        """The dense decoder every MoE is upcycled from."""
        return dense_decoder_config(vocab_size=self.vocab_size, d_model=self.d_model,
                                    n_layers=self.n_layers, n_heads=self.n_heads,
                                    d_hidden=self.d_hidden,
                                    max_seq_len=self.prompt_len + self.max_new_tokens + 8)


def make_config(preset: str) -> DeRSBenchConfig:
    del preset  # one size: >= 100M parameters for the vanilla MoE
    return DeRSBenchConfig()


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second of a large numpy copy, counting bytes read plus bytes written (best
    of ``repeats``)."""
    src = np.random.default_rng(0).random(n_bytes // 8)
    dst = np.empty_like(src)
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def _random_increments(model, seed: int):
    """Every DeRS increment (SM values, LM ``B``) drawn N(0, 0.02^2), as after training."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and str(path[-1])[:2] in ("v_", "b_"):
            var[...] = jnp.asarray(rng.normal(size=var[...].shape) * 0.02, var[...].dtype)
    return model


def _models(cfg: DeRSBenchConfig):
    dense = DecoderLM(cfg.dense_config(), rngs=nnx.Rngs(cfg.seed))
    moe = UPCYCLE_MOE.replace(n_experts=cfg.n_experts, top_k=cfg.top_k)
    out = {}
    for form in ("vanilla", "sm", "lm"):
        rule = UpcycleConfig(blocks="all", moe=moe, expert_form=form,
                             **{"vanilla": {}, "sm": {"sm_rate": cfg.sm_rate},
                                "lm": {"lm_rank": cfg.lm_rank}}[form])
        m = upcycle_model(dense, rule, jax.random.key(cfg.seed))
        if form == "vanilla":
            out[("vanilla", "-")] = m
            continue
        m = _random_increments(m, cfg.seed + 1)
        for synthesis in ("all", "selected"):
            out[(f"DeRS-{form.upper()}", synthesis)] = with_slot_config(m, DeRSMoE,
                                                                        synthesis=synthesis)
    return dense, out


def _on_capacity(model, synthesis: str, capacity: float):
    """``model`` with its MoE slots on the capacity dispatch at factor ``capacity`` (DeRS
    slots: with ``synthesis``)."""
    slot = next(m for _, m in nnx.iter_modules(model) if isinstance(m, (MoE, DeRSMoE)))
    if isinstance(slot, MoE):
        return with_slot_config(model, MoE, dispatch="capacity", capacity_factor=capacity)
    return with_slot_config(model, DeRSMoE, synthesis=synthesis, moe=slot.cfg.moe.replace(
        dispatch="capacity", capacity_factor=capacity))


def train_memory(cfg: DeRSBenchConfig, models: dict) -> list[dict]:
    """Compiled temporaries (bytes) of one cross-entropy gradient per model (module
    docstring)."""
    tokens = jnp.asarray(np.random.default_rng(cfg.seed).integers(
        3, cfg.vocab_size, (cfg.train_batch, cfg.train_seq + 1)), jnp.int32)
    rows = []
    for (name, synthesis), model in models.items():
        if synthesis == "selected":  # the decode path
            continue
        for s in (("-",) if name == "vanilla" else ("all", "stream")):
            m = _on_capacity(model, s, cfg.capacity)
            graphdef, params, rest = nnx.split(m, nnx.Param, ...)

            def loss(p, g=graphdef, r=rest):
                logits, _ = nnx.merge(g, p, r)(tokens[:, :-1])
                return cross_entropy(logits, tokens[:, 1:])

            mem = jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis()
            rows.append({"model": name, "synthesis": s,
                         "temp_mb": mem.temp_size_in_bytes / 1e6,
                         "params_mb": 4 * count_params(m) / 1e6})
    base = rows[0]["temp_mb"]
    for r in rows:
        r["vs_vanilla"] = r["temp_mb"] / base
    return rows


def run(cfg: DeRSBenchConfig, run: RunDir) -> dict:
    dense, models = _models(cfg)
    D = cfg.d_model
    ffn_params = cfg.n_layers * 3 * D * cfg.d_hidden
    other_bytes = 4 * (count_params(dense) - ffn_params + cfg.n_layers * D * cfg.n_experts)
    bandwidth = copy_bandwidth()
    prompts = np.random.default_rng(cfg.seed).integers(
        3, cfg.vocab_size, (cfg.n_prompts, cfg.prompt_len))
    rows = _decode_rows(cfg, models, prompts, other_bytes, bandwidth)
    vanilla = rows[0]
    for r in rows:
        r["vs_vanilla_tokens_per_s"] = r["tokens_per_s"] / vanilla["tokens_per_s"]
        r["vs_vanilla_bytes"] = r["weight_bytes_per_token"] / vanilla["weight_bytes_per_token"]
    for line in beyond_bound(rows):
        run.note(line)
    dev = jax.devices()[0]
    run.table("decode", rows, title=(
        f"Greedy decoding at batch 1, {cfg.n_prompts} prompts x {cfg.max_new_tokens} new "
        f"tokens: {cfg.n_layers} layers, d {D}, {cfg.n_experts} SwiGLU experts of width "
        f"{cfg.d_hidden}, top-{cfg.top_k}; DeRS-SM sparse rate {cfg.sm_rate}, DeRS-LM rank "
        f"{cfg.lm_rank}; on {dev.platform} ({dev.device_kind}); bound = copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (measured) / weight bytes per token; x_bound = bound / "
        "measured tokens/s"))
    labels = [f"{r['model']} {r['synthesis']}".replace(" -", "") for r in rows]
    run.bar_plot("tokens_per_s", labels, [r["tokens_per_s"] for r in rows],
                 ylabel="tokens/s", title="Decode tokens/s (batch 1)",
                 hlines={"vanilla's bandwidth bound": vanilla["bound_tokens_per_s"]})
    mem = train_memory(cfg, models)
    run.table("train_memory", mem, title=(
        f"Training memory: XLA's compiled temporaries of one cross-entropy gradient over "
        f"{cfg.train_batch} x {cfg.train_seq} tokens, capacity dispatch (factor "
        f"{cfg.capacity}); params_mb: the model's parameters (float32)"))
    best = {r["model"]: r for r in rows if r["synthesis"] in ("-", "selected")}
    return {"headline": "; ".join(
        f"{m} {r['tokens_per_s']:.1f} tok/s ({r['vs_vanilla_tokens_per_s']:.2f}x vanilla), "
        f"{r['weight_bytes_per_token'] / 1e6:.1f} MB/token ({r['vs_vanilla_bytes']:.2f}x)"
        for m, r in best.items()) + f"; vanilla {vanilla['params'] / 1e6:.1f}M parameters; "
        "training temporaries " + ", ".join(
            f"{r['model']} {r['synthesis']} {r['temp_mb']:.0f} MB" for r in mem),
        **{f"{lab} tok/s": round(r["tokens_per_s"], 2) for lab, r in zip(labels, rows)}}


def beyond_bound(rows: list[dict]) -> list[str]:
    """One line per decode row faster than its memory-bandwidth bound (``x_bound`` < 1): its
    tokens did not read every weight byte they are charged, so its time is not the time of
    what the row names (work hoisted out of the decode loop, or weights served from a
    cache)."""
    return [f"{r['model']} {r['synthesis']} decoded faster than its bandwidth bound "
            f"({r['tokens_per_s']:.1f} against {r['bound_tokens_per_s']:.1f} tokens/s): a "
            "token did not read every weight byte it is charged (work hoisted out of the "
            "decode loop, or weights served from a cache), so the row does not time what it "
            "names" for r in rows if r["x_bound"] < 1]


def _decode_rows(cfg: DeRSBenchConfig, models: dict, prompts, other_bytes: float,
                 bandwidth: float) -> list[dict]:
    """Per model and synthesis: decode tokens/s against the bandwidth bound of the weight
    bytes a token reads; refuses a synthesis that decodes other tokens than ``"all"``."""
    rows, tokens = [], {}
    for (name, synthesis), model in models.items():
        t = decode_timing(model, prompts, cfg.max_new_tokens)
        tokens[(name, synthesis)] = t["tokens"]
        slot = next(m for _, m in nnx.iter_modules(model) if hasattr(m, "moe_cfg"))
        expert = expert_bytes_per_token(slot.cfg, cfg.d_model)  # the layer's own cfg
        per_token = other_bytes + cfg.n_layers * expert
        rows.append({"model": name, "synthesis": synthesis, "params": count_params(model),
                     "expert_bytes_per_token": cfg.n_layers * expert,
                     "weight_bytes_per_token": per_token,
                     "bound_tokens_per_s": bandwidth / per_token,
                     "tokens_per_s": t["tokens_per_s"],
                     "x_bound": bandwidth / per_token / t["tokens_per_s"]})
    for form in ("SM", "LM"):
        if not np.array_equal(tokens[(f"DeRS-{form}", "all")],
                              tokens[(f"DeRS-{form}", "selected")]):
            raise AssertionError(f"DeRS-{form}: synthesis='selected' decoded other tokens "
                                 "than synthesis='all'")
    return rows


STUDY = Study(
    "bench_ders", make_config, run,
    smoke=("n_prompts=1",),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
