"""DeRS upcycling vs vanilla upcycling (paper section 3.4, Tables 1, 4, 5, 6).

A pre-fine-tuned dense LM is upcycled (every other block, N=4, top-2) in several ways and each
MoE is trained on the downstream corpus with the same budget:
* vanilla: N dense copies of the FFN;
* DeRS-SM at sparse rates ``sm_rates``: ``W_i = W_shared + scatter(I_i, V_i)``;
* DeRS-LM at ranks ``lm_ranks``: ``W_i = W_shared + A_i B_i``;
* the frozen-shared ablation (``W_shared`` fixed) for SM at ``frozen_sm_rate`` and LM at
  ``frozen_lm_rank`` (Table 5);
* the control: the dense model itself trained alike (no added parameters). Where it comes
  within the claim's tolerance of vanilla upcycling too, the experts make no measurable
  difference at this scale and the claim cannot be judged;
* with ``baseline=hf:<dir>``, an imported Hugging Face MoE (Mixtral, Qwen2-MoE, Qwen3-MoE or
  OLMoE; :func:`moejax.io.hf_moe.load_hf_moe`) beside them: evaluated as imported and after
  the same training run, on the same validation text read with its own tokenizer. Its
  tokens are not the study's, so rows compare in bits per byte (``val_bpb``); its
  ``val_loss`` is that loss per byte times the study's bytes per token (nats per study
  token). It is a baseline, not an upcycling: no added-parameter counts, no claim.

Tables: validation loss with exact trainable / added-over-dense / stored parameter counts
(Tables 1, 4, 5) and the cost table (Table 6): model size (stored numbers and bytes), peak
training memory and peak inference memory, both from XLA's compiled memory analysis of the
jitted training / evaluation step (``compiled.memory_analysis()``: arguments + outputs +
temporaries - aliased), NOT process RSS.

    python -m experiments.ders.upcycling                  # quick (CPU)
    python -m experiments.ders.upcycling preset=full      # SmolLM2-135M-Instruct (GPU)
    python -m experiments.ders.upcycling preset=full baseline=hf:/data/OLMoE-1B-7B-0924
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from experiments.ders.common import PAPER_SCALE
from experiments.ders.upcycling_claims import CONTROL, claims
from moejax.config import Config, config
from moejax.evaluate import LMEvaluator
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.io.hf_moe import hf_checkpoint_dir, hf_moe_config, hf_spec_config, load_hf_moe
from moejax.io.hf_moe_checkpoints import CHECKPOINTS
from moejax.io.hf_tokenizer import tokenizer_from_hf_dir
from moejax.nn.decoder import DecoderLM
from moejax.pytree import count_bytes, fmt_count
from moejax.substrates.ders import (
    FULL_PRESET,
    SubstrateConfig,
    batches,
    dense_substrate,
    fit,
    text_windows,
)
from moejax.train.aot import abstract_run
from moejax.train.hparams import TrainConfig, require_read
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig, model_variables, param_report, upcycle_model

VAL_SEED = 10_000  # the validation windows' seed


@config
class DeRSUpcyclingConfig(Config):
    NONEMPTY = ("sm_rates", "lm_ranks")

    substrate: SubstrateConfig = SubstrateConfig()
    train: TrainConfig = TrainConfig(steps=120, batch_size=16, lr=1e-3, warmup_steps=12,
                                     log_every=50, seed=2)
    n_experts: int = 4
    top_k: int = 2
    sm_rates: tuple[float, ...] = (0.9, 0.99, 0.999, 0.9999)
    lm_ranks: tuple[int, ...] = (1, 4, 16, 64)
    frozen_sm_rate: float = 0.9
    frozen_lm_rank: int = 4
    eval_batches: int = 6
    # "" = none; "hf:<dir>" = an imported Hugging Face MoE beside the upcycled ones (docstring)
    baseline: str = ""

    def unread_fields(self) -> dict[str, str]:
        return {"substrate.pretrained": "read by no part of this study (it upcycles the "
                                        "pre-fine-tuned model, substrate.prefinetuned)"}

    def validate(self) -> None:
        require_read(self, "train", "each upcycled model's training")
        self._require(all(0 <= p < 1 for p in self.sm_rates), "sm_rates must be in [0, 1)")
        self._require(0 <= self.frozen_sm_rate < 1,
                      f"frozen_sm_rate={self.frozen_sm_rate} must be in [0, 1) (1 would leave the "
                      "frozen-shared DeRS-SM no trainable value)")
        self._require(all(r >= 1 for r in self.lm_ranks), "lm_ranks must be >= 1")
        self._require(len(self.sm_rates) >= 1 and len(self.lm_ranks) >= 1,
                      "sm_rates and lm_ranks need at least one value each")
        if self.substrate.source == "substrates":  # the FFN's matrices: [d, h] and [h, d]
            full = min(self.substrate.prefinetuned.d_model, self.substrate.prefinetuned.d_hidden)
            self._require(max(self.lm_ranks + (self.frozen_lm_rank,)) <= full,
                          f"lm_ranks={self.lm_ranks} / frozen_lm_rank={self.frozen_lm_rank}: "
                          f"a rank past min(d_model, d_hidden) = {full} is full rank already")
        self._checked(_variants, self)  # every variant's MoE builds (top_k <= n_experts ...)
        if self.baseline:
            hf = self.hf_baseline()
            self._require(self.substrate.seq_len <= hf.max_seq_len,
                          f"substrate.seq_len={self.substrate.seq_len}: the baseline "
                          f"{self.baseline!r} takes at most {hf.max_seq_len} positions")

    def hf_baseline(self):
        """The imported baseline's DecoderConfig (``baseline=hf:<dir>``), read from its
        ``config.json`` (an unsupported family refused in one line)."""
        return self._checked(hf_spec_config, self.baseline, "baseline")


def make_config(preset: str) -> DeRSUpcyclingConfig:
    if preset == "quick":
        return DeRSUpcyclingConfig()
    return DeRSUpcyclingConfig(**FULL_PRESET)


def _variants(cfg: DeRSUpcyclingConfig):
    base = UpcycleConfig(blocks="every_other",
                         moe=UPCYCLE_MOE.replace(n_experts=cfg.n_experts, top_k=cfg.top_k))
    out = [("vanilla", "vanilla", "", base)]
    out += [(f"DeRS-SM p={p}", "sm", p, base.replace(expert_form="sm", sm_rate=p))
            for p in cfg.sm_rates]
    out += [(f"DeRS-LM r={r}", "lm", r, base.replace(expert_form="lm", lm_rank=r))
            for r in cfg.lm_ranks]
    out.append((f"DeRS-SM p={cfg.frozen_sm_rate} frozen shared", "sm-frozen",
                cfg.frozen_sm_rate, base.replace(expert_form="sm", sm_rate=cfg.frozen_sm_rate,
                                                 freeze_shared=True)))
    out.append((f"DeRS-LM r={cfg.frozen_lm_rank} frozen shared", "lm-frozen",
                cfg.frozen_lm_rank, base.replace(expert_form="lm", lm_rank=cfg.frozen_lm_rank,
                                                 freeze_shared=True)))
    out.append((CONTROL, "dense", "", None))
    return out


def run(cfg: DeRSUpcyclingConfig, run: RunDir) -> dict:
    s = cfg.substrate
    dense, origin = dense_substrate(s, prefinetune=True)
    run.note(f"Upcycled from {origin}.")
    val, bytes_per_token = text_windows(s, "validation", batch_size=cfg.train.batch_size,
                                        seed=VAL_SEED)
    evaluate = LMEvaluator.from_source(val, cfg.eval_batches, bytes_per_token=bytes_per_token)
    dense_loss = evaluate(dense)["loss"]
    src = batches(s.downstream_corpus, "train", batch_size=cfg.train.batch_size,
                  seq_len=s.seq_len, seed=100 + cfg.train.seed, source=s.source)
    rows = [_variant_row(cfg, dense, evaluate, src, *v) for v in _variants(cfg)]
    if cfg.baseline:
        rows.append(_imported_row(cfg, bytes_per_token))
        run.note(f"Imported baseline: {rows[-1]['variant']}, evaluated on the same validation "
                 f"text in its own tokens ({rows[-1]['bytes_per_token']:.3f} bytes per token; "
                 f"the study's: {bytes_per_token:.3f}) and compared in bits per byte"
                 + (f"; {rows[-1]['unknown_share']:.2%} of its tokens are its unknown token, "
                    "whose bytes it never has to predict, so its bits per byte flatter it."
                    if rows[-1]["unknown_share"] else "."))
    van = rows[0]
    for r in rows:
        r["added_vs_vanilla"] = (van["added"] / max(r["added"], 1) if r["form"] != "imported"
                                 else "-")
        r["d_loss_vs_vanilla"] = r["val_loss"] - van["val_loss"]
    run.note(f"Dense (pre-fine-tuned) validation loss: {dense_loss:.4f} nats/byte; every "
             "upcycled model equals it at step 0 (column val_loss_step0).")
    _tables(run, rows, {"dense (pre-fine-tuned)": dense_loss})

    def get(form, setting):
        return next(r for r in rows if r["form"] == form and r["setting"] == setting)

    # headline settings: the second of each sweep (p = 0.99, r = 4 by default)
    sm = get("sm", cfg.sm_rates[min(1, len(cfg.sm_rates) - 1)])
    lm = get("lm", cfg.lm_ranks[min(1, len(cfg.lm_ranks) - 1)])
    return {"headline": (
        f"vanilla val {van['val_loss']:.4f} (added {fmt_count(van['added'])}); DeRS-SM "
        f"p={sm['setting']} {sm['val_loss']:.4f} (added {fmt_count(sm['added'])}, "
        f"{sm['added_vs_vanilla']:.0f}x fewer); DeRS-LM r={lm['setting']} {lm['val_loss']:.4f} "
        f"(added {fmt_count(lm['added'])}, {lm['added_vs_vanilla']:.0f}x fewer)"),
        "dense_val_loss": dense_loss, "vanilla_val_loss": van["val_loss"]}


def _variant_row(cfg: DeRSUpcyclingConfig, dense, evaluate, src, label, form, setting,
                 rule) -> dict:
    """One variant upcycled from the dense model (``rule`` None: the dense control, trained
    as is), trained, evaluated and counted."""
    moe = (nnx.clone(dense) if rule is None
           else upcycle_model(dense, rule, jax.random.key(cfg.train.seed)))
    step0 = evaluate(moe)["loss"]
    tr = fit(moe, src, cfg.train, desc=label)
    counts = param_report(dense, moe)
    infer = evaluate.memory(moe)
    after = evaluate(moe)
    return {"variant": label, "form": form, "setting": setting,
            "val_loss": after["loss"], "val_bpb": after["bpb"], "val_loss_step0": step0,
            "trainable": counts["trainable"], "added": counts["added"],
            "added_with_index": counts["added_with_index"], "stored": counts["stored"],
            "model_bytes": count_bytes(moe), "peak_train_bytes": tr["peak_train_bytes"],
            "train_state_bytes": tr["train_state_bytes"],
            "peak_infer_bytes": infer["peak_bytes"], "infer_arg_bytes": infer["argument_bytes"],
            "train_loss_last10": tr["final_loss"]}


def _imported_row(cfg: DeRSUpcyclingConfig, study_bytes_per_token: float) -> dict:
    """The imported MoE (``baseline=hf:<dir>``) evaluated as imported and after the study's
    training run, on the validation text in its own tokens; losses in bits per byte and in
    nats per study token (nats per byte times ``study_bytes_per_token``)."""
    d = hf_checkpoint_dir(cfg.baseline, "baseline")
    model, tok = load_hf_moe(d, dispatch=UPCYCLE_MOE.dispatch), tokenizer_from_hf_dir(d)
    val, bpt = text_windows(cfg.substrate, "validation", batch_size=cfg.train.batch_size,
                            seed=VAL_SEED, tokenizer=tok)
    src, _ = text_windows(cfg.substrate, "train", batch_size=cfg.train.batch_size,
                          seed=100 + cfg.train.seed, tokenizer=tok)
    evaluate = LMEvaluator.from_source(val, cfg.eval_batches, bytes_per_token=bpt)
    unk = getattr(tok.tokenizer.model, "unk_token", None)
    unk_id = tok.token_to_id(unk) if unk else None
    per_study_token = study_bytes_per_token / bpt  # nats per own token -> per study token
    step0 = evaluate(model)["loss"]
    label = f"imported {d.name} ({model.cfg.ffn_slots[0].n_experts} experts, fine-tuned alike)"
    tr = fit(model, src, cfg.train, desc=label)
    infer, after = evaluate.memory(model), evaluate(model)
    n = model_variables(model)["trainable"]
    return {"variant": label, "form": "imported", "setting": d.name,
            "val_loss": after["loss"] * per_study_token, "val_bpb": after["bpb"],
            "val_loss_step0": step0 * per_study_token, "trainable": n, "added": "-",
            "added_with_index": "-", "stored": n, "model_bytes": count_bytes(model),
            "peak_train_bytes": tr["peak_train_bytes"],
            "train_state_bytes": tr["train_state_bytes"],
            "peak_infer_bytes": infer["peak_bytes"], "infer_arg_bytes": infer["argument_bytes"],
            "train_loss_last10": tr["final_loss"] * per_study_token,
            "bytes_per_token": bpt,
            "unknown_share": 0.0 if unk_id is None else float(np.mean(val.tokens == unk_id))}


def _tables(run: RunDir, rows: list[dict], dense_ref: dict) -> None:
    """Tables 1/4/5 (loss and parameters), Table 6 (cost), the SM and LM ablations."""
    van = rows[0]
    run.table("upcycling", rows, title="Vanilla vs DeRS upcycling (Tables 1/4/5 analog): "
              "validation loss and exact parameter counts (added = weights - dense; "
              "with_index also charges the SM index vectors)",
              columns=["variant", "form", "val_loss", "val_bpb", "d_loss_vs_vanilla",
                       "val_loss_step0",
                       "trainable", "added", "added_with_index", "added_vs_vanilla",
                       "train_loss_last10"])
    run.table("cost", rows, title="Cost efficiency (Table 6 analog). model size = stored "
              "numbers (weights + SM index) and bytes; peak memories from XLA compiled "
              "memory analysis (not process RSS) of the jitted train step / eval step "
              "(peak = arguments + outputs + temporaries - aliased); train_state_bytes / "
              "infer_arg_bytes = the arguments alone (params + optimizer state / weights + "
              "buffers, plus one batch), the part that scales with the model",
              columns=["variant", "stored", "model_bytes", "peak_train_bytes",
                       "train_state_bytes", "peak_infer_bytes", "infer_arg_bytes",
                       "val_loss"])
    for form, xlab, logx in (("sm", "sparse rate p (1 - p = kept fraction)", False),
                             ("lm", "rank r", True)):
        sel = [r for r in rows if r["form"] == form]
        run.line_plot(f"{form}_ablation", {
            f"DeRS-{form.upper()}": ([r["setting"] for r in sel], [r["val_loss"] for r in sel]),
            "vanilla": ([sel[0]["setting"], sel[-1]["setting"]], [van["val_loss"]] * 2)},
            xlabel=xlab, ylabel="validation loss (nats/byte)", logx=logx, markers=True,
            title=f"DeRS-{form.upper()} ablation (Table 4 analog)", hlines=dense_ref)
    run.bar_plot("val_loss", [r["variant"] for r in rows], [r["val_loss"] for r in rows],
                 ylabel="validation loss (nats/byte)", title="Vanilla vs DeRS upcycling",
                 hlines=dense_ref)


def checkpoint_runs(cfg: DeRSUpcyclingConfig) -> list:
    """The baseline's training run on each named real checkpoint
    (:data:`moejax.io.hf_moe_checkpoints.CHECKPOINTS`) at this preset's shapes, from its
    ``config.json`` alone (``make full-aot``)."""
    s, t = cfg.substrate, cfg.train
    batch = {k: jax.ShapeDtypeStruct((t.batch_size, s.seq_len), d) for k, d in
             (("inputs", np.int32), ("targets", np.int32), ("mask", np.float32))}
    out = []
    for name, c in CHECKPOINTS.items():
        hf = hf_moe_config(c)
        out.append(abstract_run(lambda hf=hf: DecoderLM(hf, rngs=nnx.Rngs(0)), t, batch,
                                label=f"baseline=hf:{name} fine-tuned alike (config.json only)"))
    return out


STUDY = Study(
    "ders_upcycling", make_config, run, claims=claims, checkpoint_runs=checkpoint_runs,
    seed_keys=("train.seed",),
    quick_repeat=5,
    paper_scale=PAPER_SCALE,
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
