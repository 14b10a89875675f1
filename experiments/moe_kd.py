"""Distillation from an MoE teacher ("Every Expert Matters", Kim et al. 2025): the main table
(KD, GKD, ALL, KA, SAR with an MoE and a dense teacher) and the Fig. 1, 2 and 6 analyses.

Recipe (Every Expert Matters, Sec. 4-5). Starting point: the ``dense_lm_prose`` substrate
(byte-level decoder pre-trained on the Python docs' prose; ``preset=full``:
SmolLM2-135M-Instruct). Teacher: that model made a noisy-top-k MoE the way Llama-MoE is built
(``upcycle``: every FFN's neurons split into 8 experts, top-2, CV^2 balance loss; full: 16
experts, top-4) and fine-tuned on chit-chat prompt/response pairs. Dense teacher: the substrate
fine-tuned the same way. Student: the substrate's first ``student_layers`` blocks (same
tokenizer), fine-tuned the same way (SFT). Every method then continues from that SFT student for
``distill.steps`` steps (``moejax.train.distill``); the checkpoint kept is the one with the best
validation ROUGE-L; the score is test ROUGE-L of responses sampled at temperature 1 / top-p 1
(the paper's generation settings), mean and standard deviation over ``eval_seeds`` generation
seeds and ``seeds`` training seeds.

Tables: ``main`` (the paper's layout: teacher x method), ``gate_mass`` (Fig. 1: gate mass of
the activated experts per layer), ``teacher_k`` (Fig. 2: teacher and KD-student quality as the
teacher's k grows, when ``teacher_ks`` is set), ``ka_sweep`` (KA's lambda and M), ``sar_kl``
(Fig. 6: per-layer KL between the original and the SAR-trained router).

    python -m experiments.moe_kd                     # quick (CPU)
    python -m experiments.moe_kd preset=full         # GPU: SmolLM2-135M substrate sizes
"""

from __future__ import annotations

from typing import Literal

import jax
import numpy as np

from moejax.claims import Claim, compare, lookup
from moejax.config import Config, config
from moejax.data.batches import PromptResponseBatches
from moejax.data.loader import chat_prompt_response
from moejax.data.tokenizer import ByteTokenizer
from moejax.evaluate import GenerationEvaluator, gate_mass_by_layer, router_kl_by_layer
from moejax.experiment import main
from moejax.io.smollm2 import load_smollm2
from moejax.nn.decoder import keep_layers
from moejax.nn.routing_modes import RoutingMode, with_routing
from moejax.results import RunDir
from moejax.substrates import build as build_substrate
from moejax.substrates import substrate_config
from moejax.substrates.lm import LMSubstrateConfig
from moejax.train.distill import (
    METHODS,
    DistillConfig,
    Method,
    distill_loss_fn,
    distill_pair,
    distill_tx,
)
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig, upcycle_model

NAME = "moe_kd"

LABELS = {"sft": "SFT", "kd": "KD", "gkd": "GKD", "all": "ALL", "ka": "KA", "sar": "SAR"}


@config
class MoEKDConfig(Config):
    # the dense starting point: the byte-level prose substrate, or SmolLM2-135M-Instruct
    model: Literal["substrate", "smollm2_135m"] = "substrate"
    substrate: LMSubstrateConfig = substrate_config("dense_lm_prose", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    # Llama-MoE style: every FFN's neurons split into N experts, noisy top-k, CV^2 balance
    upcycle: UpcycleConfig = UpcycleConfig(
        blocks="all", expert_form="split",
        moe=UPCYCLE_MOE.replace(n_experts=8, top_k=2, router="noisy", balance_loss="cv2",
                                balance_coef=0.01, dispatch="dense"))
    student_layers: int = 2  # the student keeps the substrate's first blocks
    prompt_len: int = 48  # tokens of the prompt block (bos + prompt tail + eos bos)
    response_len: int = 32  # response tokens incl. eos (the sampling length too)
    n_train: int = 20000  # chit-chat pairs used for training
    n_val: int = 32
    n_test: int = 96
    sft: TrainConfig = TrainConfig(steps=300, batch_size=16, lr=1e-3, warmup_steps=30,
                                   schedule="cosine", log_every=50)
    distill: TrainConfig = TrainConfig(steps=150, batch_size=16, lr=3e-4, warmup_steps=10,
                                       schedule="constant", eval_every=50, log_every=25)
    kd: DistillConfig = DistillConfig(router_lr=3e-4)  # method is set per row
    methods: tuple[Method, ...] = METHODS
    dense_teacher_methods: tuple[Method, ...] = ("kd", "gkd")
    teacher_ks: tuple[int, ...] = (1, 2, 4, 8)  # Fig. 2 sweep; () = skip
    ka_lambdas: tuple[float, ...] = (0.0, 0.2)  # extra KA runs (lambda sweep at kd.ka_m)
    ka_ms: tuple[int, ...] = (1, 4)  # extra KA runs (M sweep at kd.ka_lambda)
    seeds: int = 1  # training seeds of every distillation run
    eval_seeds: int = 5  # generation seeds of every ROUGE-L score (as the paper)
    # the paper samples evaluation responses at temperature 1 (top-p 1); 0 = greedy
    eval_temperature: float = 1.0
    seed: int = 0

    def validate(self):
        r = self._require
        n_layers = self.substrate.n_layers if self.model == "substrate" else 30
        r(1 <= self.student_layers < n_layers,
          f"student_layers={self.student_layers} must be in [1, {n_layers}) (the teacher's "
          "layers)")
        r(self.model != "substrate"
          or self.prompt_len + self.response_len <= self.substrate.max_seq_len,
          "prompt_len + response_len exceeds substrate.max_seq_len")
        r(all(1 <= k <= self.upcycle.moe.n_experts for k in self.teacher_ks),
          f"teacher_ks={self.teacher_ks} must lie in [1, upcycle.moe.n_experts]")
        r(bool(self.methods or self.dense_teacher_methods),
          "methods=() and dense_teacher_methods=(): nothing to distil; give at least one")
        r(self.upcycle.moe.router == "noisy" or "sar" not in self.methods,
          "SAR trains W_g and W_noise of a noisy top-k router: set upcycle.moe.router=noisy")
        r(self.seeds >= 1 and self.eval_seeds >= 1, "seeds and eval_seeds must be >= 1")
        r(self.eval_temperature >= 0, "eval_temperature must be >= 0 (0 = greedy)")


def make_config(preset: str) -> MoEKDConfig:
    if preset == "quick":
        # tiny byte-level models: temperature-1 samples are near-random bytes whose ROUGE-L is
        # noise (measured: 0.005-0.05 for every model), so the quick preset scores greedy
        # responses and reports the spread over training seeds instead of generation seeds
        return MoEKDConfig(
            sft=TrainConfig(steps=600, batch_size=16, lr=1e-3, warmup_steps=30,
                            schedule="cosine", log_every=50),
            distill=TrainConfig(steps=100, batch_size=16, lr=3e-4, warmup_steps=10,
                                schedule="constant", eval_every=50, log_every=25),
            teacher_ks=(2, 8), ka_lambdas=(0.2,), ka_ms=(4,), seeds=3, eval_seeds=1,
            eval_temperature=0.0)
    return MoEKDConfig(
        model="smollm2_135m", substrate=substrate_config("dense_lm_prose", "full"),
        upcycle=UpcycleConfig(
            blocks="all", expert_form="split",
            moe=UPCYCLE_MOE.replace(n_experts=16, top_k=4, router="noisy", balance_loss="cv2",
                                    balance_coef=0.01, dispatch="ragged")),
        student_layers=15,
        prompt_len=256, response_len=256, n_train=100_000, n_val=500, n_test=2000,
        sft=TrainConfig(steps=3000, batch_size=16, lr=1e-4, warmup_steps=100,
                        schedule="cosine", log_every=50),
        distill=TrainConfig(steps=6000, batch_size=16, lr=1e-5, warmup_steps=0,
                            schedule="constant", eval_every=1000, log_every=50),
        kd=DistillConfig(router_lr=1e-5), teacher_ks=(1, 2, 4, 7, 8),
        ka_lambdas=(0.0, 0.05, 0.1, 0.2), ka_ms=(1, 2, 4), seeds=5, eval_seeds=5)


# ------------------------------------------------------------------------------ pieces


def _dense_start(cfg: MoEKDConfig):
    """``(dense model, tokenizer, description)``."""
    if cfg.model == "smollm2_135m":
        model, tok = load_smollm2(max_seq_len=max(512, cfg.prompt_len + cfg.response_len))
        return model, tok, "SmolLM2-135M-Instruct"
    sub = build_substrate("dense_lm_prose", cfg.substrate, cache_dir=cfg.substrate_cache or None,
                          progress=True)
    return sub.model, ByteTokenizer(), (f"substrate dense_lm_prose ({sub.path.name}, val loss "
                                        f"{sub.metrics['val_loss']:.3f})")


def _data(cfg: MoEKDConfig, tok):
    kw = dict(prompt_len=cfg.prompt_len, response_len=cfg.response_len)

    def fixed(split, n):
        return chat_prompt_response(split, tok, batch_size=n, limit=n, shuffle=False,
                                    **kw).batch(0)

    rows = chat_prompt_response("train", tok, batch_size=1, limit=cfg.n_train, **kw).rows
    train_src = lambda bs, seed: PromptResponseBatches(rows, batch_size=bs, seed=seed)  # noqa: E731
    gen = dict(temperature=cfg.eval_temperature, top_p=cfg.kd.top_p, eos_id=tok.eos_id,
               pad_id=tok.pad_id or 0)
    val = GenerationEvaluator([fixed("validation", cfg.n_val)], tok.decode, seeds=(0,), **gen)
    test = GenerationEvaluator([fixed("test", cfg.n_test)], tok.decode,
                               seeds=tuple(range(cfg.eval_seeds)), **gen)
    return train_src, val, test


def _sft(model, train_src, tcfg: TrainConfig, desc: str):
    train(model, train_src(tcfg.batch_size, tcfg.seed), tcfg, desc=desc)
    return model


def _distil(student_sft, teacher, dcfg: DistillConfig, tcfg: TrainConfig, train_src, val, desc):
    """One distillation run from a copy of the SFT student; returns ``(student, pair)``
    with the validation-best student."""
    student = keep_layers(student_sft, range(student_sft.cfg.n_layers))  # a fresh copy
    pair = distill_pair(student, teacher, dcfg)
    train(pair, train_src(tcfg.batch_size, tcfg.seed), tcfg, loss_fn=distill_loss_fn(dcfg),
          tx=distill_tx(dcfg, tcfg), eval_fn=lambda p, step: val(p.student, step),
          keep_best="rouge_l", desc=desc)
    return pair.student, pair


def _scores(test, model) -> dict:
    ev = test(model)
    return {"rouge_l": ev["rouge_l"], "seed_scores": ev["rouge_l_seeds"]}


def _row(teacher: str, method: str, scores: list[list[float]]) -> dict:
    flat = [s for run in scores for s in run]
    return {"teacher": teacher, "method": method, "rouge_l": float(np.mean(flat)),
            "std": float(np.std(flat)), "runs": len(scores), "scores": len(flat)}


# ------------------------------------------------------------------------------ study


def run(cfg: MoEKDConfig, run: RunDir) -> dict:
    dense, tok, start = _dense_start(cfg)
    run.note(f"Teacher and student start from {start}.")
    train_src, val, test = _data(cfg, tok)
    kd = cfg.kd.replace(eos_id=tok.eos_id, pad_id=tok.pad_id or 0)
    n = dense.cfg.n_layers
    sft = cfg.sft.replace(seed=cfg.seed)
    moe_teacher = _sft(upcycle_model(dense, cfg.upcycle, jax.random.key(cfg.seed)), train_src,
                       sft, "SFT MoE teacher")
    dense_teacher = (_sft(keep_layers(dense, range(n)), train_src, sft, "SFT dense teacher")
                     if cfg.dense_teacher_methods else None)
    student_sft = _sft(keep_layers(dense, range(cfg.student_layers)), train_src, sft,
                       "SFT student")
    refs = {"MoE teacher": _scores(test, moe_teacher)["rouge_l"],
            "student (SFT)": _scores(test, student_sft)["rouge_l"]}
    if dense_teacher is not None:
        refs["dense teacher"] = _scores(test, dense_teacher)["rouge_l"]

    rows, sar_pair = [], None
    plan = [("MoE", moe_teacher, m) for m in cfg.methods]
    plan += [("dense", dense_teacher, m) for m in cfg.dense_teacher_methods]
    for teacher_name, teacher, method in plan:
        scores = []
        for s in range(cfg.seeds):
            tcfg = cfg.distill.replace(seed=cfg.seed + 100 * (s + 1))
            student, pair = _distil(student_sft, teacher, kd.replace(method=method), tcfg,
                                    train_src, val, f"{LABELS[method]} ({teacher_name}) s{s}")
            scores.append(_scores(test, student)["seed_scores"])
            if method == "sar" and sar_pair is None:
                sar_pair = pair
        rows.append(_row(f"{teacher_name} teacher", LABELS[method], scores))
    run.table("main", rows, title="Test ROUGE-L of the distilled student (mean and std over "
              "training and generation seeds); references: "
              + ", ".join(f"{k} {v:.4f}" for k, v in refs.items()),
              columns=["teacher", "method", "rouge_l", "std", "runs", "scores"])
    labels = [f"{r['method']} ({r['teacher'].split()[0]})" for r in rows]
    run.bar_plot("main", labels, [r["rouge_l"] for r in rows], errors=[r["std"] for r in rows],
                 ylabel="test ROUGE-L", title="Student ROUGE-L by method and teacher",
                 hlines={k: v for k, v in refs.items()})

    # Fig. 1: gate mass of the activated experts, per layer
    val_batch = val.batches[0]
    mass = gate_mass_by_layer(moe_teacher, [val_batch])
    run.table("gate_mass", [{"layer": i, "activated": m, "not_activated": 1 - m}
                            for i, m in enumerate(mass)],
              title=f"Gate mass of the top-{cfg.upcycle.moe.top_k} experts vs the other "
                    f"{cfg.upcycle.moe.n_experts - cfg.upcycle.moe.top_k} (validation tokens)")
    run.bar_plot("gate_mass", [f"layer {i}" for i in range(len(mass))], mass,
                 ylabel="gate mass of activated experts", hlines={"50%": 0.5},
                 title="Fig. 1 analog: activated experts' share of the gate")
    out = {"student_sft": refs["student (SFT)"], "moe_teacher": refs["MoE teacher"],
           "dense_teacher": refs.get("dense teacher", float("nan")),
           "gate_mass_mean": float(np.mean(mass)) if mass else float("nan")}

    # Fig. 2: teacher k sweep
    if cfg.teacher_ks:
        k_rows = []
        for k in cfg.teacher_ks:
            t_k = with_routing(moe_teacher, RoutingMode(mode="topk", top_k=int(k)))
            st, _ = _distil(student_sft, moe_teacher, kd.replace(method="kd", teacher_k=int(k)),
                            cfg.distill.replace(seed=cfg.seed + 100), train_src, val,
                            f"KD teacher k={k}")
            k_rows.append({"k": int(k), "teacher_rouge_l": _scores(test, t_k)["rouge_l"],
                           "student_rouge_l": _scores(test, st)["rouge_l"]})
        run.table("teacher_k", k_rows, title="Teacher and KD student as the teacher's k grows "
                  "(Fig. 2 analog)")
        ks = [r["k"] for r in k_rows]
        run.line_plot("teacher_k", {"teacher": (ks, [r["teacher_rouge_l"] for r in k_rows]),
                                    "student (KD)": (ks, [r["student_rouge_l"] for r in k_rows])},
                      xlabel="teacher experts k", ylabel="test ROUGE-L", markers=True,
                      title="Fig. 2 analog")

    # KA sweeps
    ka = [("lambda", float(x), kd.replace(method="ka", ka_lambda=float(x)))
          for x in cfg.ka_lambdas]
    ka += [("M", int(x), kd.replace(method="ka", ka_m=int(x))) for x in cfg.ka_ms]
    if ka:
        ka_rows = []
        for what, x, dcfg in ka:
            st, _ = _distil(student_sft, moe_teacher, dcfg, cfg.distill.replace(
                seed=cfg.seed + 100), train_src, val, f"KA {what}={x}")
            ka_rows.append({"swept": what, "value": x, "lambda": dcfg.ka_lambda,
                            "M": dcfg.ka_m, "rouge_l": _scores(test, st)["rouge_l"]})
        run.table("ka_sweep", ka_rows, title="KA: lambda and M")

    # Fig. 6: how far SAR moved each router
    if sar_pair is not None:
        kl = router_kl_by_layer(moe_teacher, sar_pair.teacher, [val_batch])
        run.table("sar_kl", kl, title="KL(original gate || SAR gate) per layer (Fig. 6 "
                  "analog; each teacher on its own hidden states)")
        run.line_plot("sar_kl", {"mean": ([r["layer"] for r in kl], [r["mean_kl"] for r in kl]),
                                 "max": ([r["layer"] for r in kl], [r["max_kl"] for r in kl])},
                      xlabel="layer", ylabel="KL", markers=True, title="Fig. 6 analog")

    by = {(r["teacher"], r["method"]): r["rouge_l"] for r in rows}
    moe = lambda m: by.get(("MoE teacher", m))  # noqa: E731
    shape = {}
    if moe("GKD") is not None and moe("KD") is not None:
        shape["GKD > KD (MoE)"] = moe("GKD") > moe("KD")
    for m in ("ALL", "KA", "SAR"):
        if moe(m) is not None and moe("GKD") is not None:
            shape[f"{m} > GKD (MoE)"] = moe(m) > moe("GKD")
    for m in ("KD", "GKD"):
        d = by.get(("dense teacher", m))
        if moe(m) is not None and d is not None:
            gain_moe, gain_dense = moe(m) - refs["student (SFT)"], d - refs["student (SFT)"]
            shape[f"{m} gains less from MoE than dense teacher"] = gain_moe < gain_dense
    run.note("Shape of the paper's main table (with the MoE teacher: ALL, KA, SAR > GKD > KD; "
             "KD and GKD gain less from the MoE teacher than from the dense one): "
             + "; ".join(f"{k}: {'holds' if v else 'does not hold'}" for k, v in shape.items())
             + ". KD's loss: " + (f"{cfg.kd.kd_ratio:g} forward KL + "
                                  f"{1 - cfg.kd.kd_ratio:g} cross-entropy (the official code's "
                                  "kd-ratio 0.5)" if cfg.kd.kd_ratio < 1 else
                                  "pure forward KL (kd.kd_ratio=1)")
             + ". SAR runs the paper's two stages per step (router AdamW step, then "
             "distillation under the updated router). Evaluation "
             + ("samples at temperature 1, top-p 1 (the paper's setting)."
                if cfg.eval_temperature == 1.0 else
                f"decodes at temperature {cfg.eval_temperature:g} (0 = greedy; the paper "
                "samples at 1)."))
    out.update({f"{r['method']}_{r['teacher'].split()[0]}": r["rouge_l"] for r in rows})
    out["shape_holds"] = {k: bool(v) for k, v in shape.items()}
    out["headline"] = ("student ROUGE-L (MoE teacher): " + ", ".join(
        f"{r['method']} {r['rouge_l']:.4f}" for r in rows if r["teacher"] == "MoE teacher")
        + f"; SFT student {refs['student (SFT)']:.4f}, MoE teacher {refs['MoE teacher']:.4f}")
    return out


def claims(t: dict[str, list[dict]]) -> list[Claim]:
    """The paper's main-table claims (Table 1): with an MoE teacher ALL, KA and SAR beat GKD,
    which beats KD; the MoE teacher helps KD more than the dense teacher."""
    main_rows = t.get("main") or []
    at = lambda teacher, m: (f"{m} ({teacher.split()[0]})",  # noqa: E731
                             lookup(main_rows, {"teacher": teacher, "method": m}, "rouge_l"))
    out = [compare("GKD beats KD with the MoE teacher (Table 1)", at("MoE teacher", "GKD"),
                   at("MoE teacher", "KD"))]
    for m in ("ALL", "KA", "SAR"):
        out.append(compare(f"{m} beats GKD with the MoE teacher (Table 1)",
                           at("MoE teacher", m), at("MoE teacher", "GKD")))
    out.append(compare("KD from the MoE teacher beats KD from the dense teacher (Table 1)",
                       at("MoE teacher", "KD"), at("dense teacher", "KD")))
    return out


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run, claims=claims))
