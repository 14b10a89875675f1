"""Distillation from an MoE teacher ("Every Expert Matters", Kim et al. 2025): the main table
(KD, GKD, ALL, KA, SAR with an MoE and a dense teacher) and the Fig. 1, 2 and 6 analyses.

Recipe (Every Expert Matters, Sec. 4-5). Starting point: the ``dense_lm_chat`` substrate (a
byte-level decoder pre-trained on the chit-chat dialogues; ``model=dense_lm_prose``: the
smaller prose model; ``preset=full``: SmolLM2-135M-Instruct). Teacher: that model made a
noisy-top-k MoE the way Llama-MoE is built (``upcycle``: every FFN's neurons split into 8
experts, top-2, CV^2 balance loss; full: 16 experts, top-4) and fine-tuned on chit-chat
prompt/response pairs. Dense teacher: the substrate fine-tuned the same way. Student: the
substrate's first ``student_layers`` blocks (same tokenizer), fine-tuned the same way (SFT).
Each training seed has its own draw of the three (``teachers="per_seed"``: the MoE teacher
upcycled with that seed's key, every fine-tuning on that seed's batch order), so the paired
intervals cover the teachers' training too; a student's ROUGE-L moves with its teacher's draw
as much as with the method, and a dense-versus-MoE comparison of one teacher of each kind
could only speak for those two teachers. ``teachers="shared"`` fine-tunes one of each (seed
0's) for every seed: cheaper, and the dense-versus-MoE claims then read inconclusive. The
default, ``"auto"``, is per seed for the upcycled teacher and shared for an imported one.
Every method then continues from that SFT student for ``distill.steps`` steps
(:func:`moejax.distill.training.distil`; KD is 0.5 forward KL + 0.5 cross-entropy as the
official code trains it, ``kd.kd_ratio=1`` for pure forward KL); the checkpoint kept is the one
with the best validation ROUGE-L. Scores (:class:`moejax.evaluate_generation.ResponseScorer`):
test ROUGE-L (words Porter-stemmed, as MiniLLM's evaluation the paper follows) of responses
sampled at temperature 1 / top-p 1 (the paper's generation settings) over ``eval_seeds``
sampling seeds, response-token perplexity and the per-token
``KL(MoE teacher || student)`` on the test responses (the seed's own MoE teacher), each for
``seeds`` training seeds.

Tables: ``references`` (teachers and SFT student before distillation, over the draws: is the
teacher worth distilling?), ``references_per_seed`` (each draw's, with several), ``main`` (the
paper's layout: teacher x method), ``per_seed`` (every run), ``paired`` (the paper's
comparisons per training seed: mean, std and sign of each difference), ``gate_mass`` (Fig. 1),
``teacher_k`` and ``teacher_k_per_seed`` (Fig. 2, every training seed, when ``teacher_ks``
is set), ``ka_sweep`` (KA's lambda and M over the training seeds), ``sar_kl`` (Fig. 6:
per-layer KL between the original and the SAR-trained router, over the training seeds),
``lr_sweep`` (student and router learning rates within the step budget, when set).

``teacher=hf:<dir>`` distils an imported Hugging Face MoE instead (Mixtral, Qwen2-MoE,
Qwen3-MoE or OLMoE with its ``tokenizer.json``; :func:`moejax.io.hf_moe.load_hf_moe`): it is
fine-tuned on the pairs like the upcycled teacher, and the student is its first
``student_layers`` blocks, MoE FFNs included (an imported checkpoint has no dense sibling
sharing its tokenizer); there is no dense teacher, and SAR, which trains a noisy top-k router,
is refused for its softmax router. The summary names the teacher that ran.

    python -m experiments.kd.moe_kd                     # quick (CPU)
    python -m experiments.kd.moe_kd preset=full         # GPU: SmolLM2-135M substrate sizes
    python -m experiments.kd.moe_kd preset=full teacher=hf:/data/OLMoE-1B-7B-0924 \
        student_layers=4 dense_teacher_methods=() "methods=(kd,gkd,all,ka)"
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from flax import nnx

from experiments.kd.claims import CLAIMS, claims, paired_rows, teacher_gap, teacher_gap_note
from experiments.kd.common import PAPER_SCALE
from experiments.kd.setup import Setup, setup
from experiments.kd.sweeps import ka_sweep, lr_sweeps, sar_kl_table, teacher_k_sweep
from moejax.config import Config, config
from moejax.data.loader import chat_prompt_response
from moejax.data.tokenizer import ByteTokenizer
from moejax.distill.training import (
    METHODS,
    DistillConfig,
    Method,
    distill_loss_fn,
    distill_pair,
)
from moejax.evaluate_generation import (
    gate_mass_by_layer,
    router_kl_by_layer,
)
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.harness.tables import mean_std
from moejax.io.hf_moe import hf_moe_config, hf_spec_config
from moejax.io.hf_moe_checkpoints import CHECKPOINTS
from moejax.nn.decoder import DecoderLM, keep_layers
from moejax.nn.moe import MoEConfig
from moejax.substrates import substrate_config
from moejax.substrates.lm import LMSubstrateConfig
from moejax.train.aot import abstract_run
from moejax.train.hparams import TrainConfig, require_read
from moejax.upcycle import UPCYCLE_MOE, UpcycleConfig

LABELS = {"sft": "SFT", "kd": "KD", "gkd": "GKD", "all": "ALL", "ka": "KA", "sar": "SAR"}


@config
class MoEKDConfig(Config):
    # the dense starting point: a cached substrate (configured below) or SmolLM2-135M-Instruct
    model: Literal["dense_lm_chat", "dense_lm_prose", "smollm2_135m"] = "dense_lm_chat"
    dense_lm_chat: LMSubstrateConfig = substrate_config("dense_lm_chat", "quick")
    dense_lm_prose: LMSubstrateConfig = substrate_config("dense_lm_prose", "quick")
    substrate_cache: str = ""  # "" = $MOEJAX_SUBSTRATE_DIR or ~/.cache/moejax/substrates
    # "" = the MoE teacher upcycled from `model` (the paper's recipe); "hf:<dir>" = an imported
    # Hugging Face MoE checkpoint (module docstring)
    teacher: str = ""
    # Llama-MoE style: every FFN's neurons split into N experts, noisy top-k, CV^2 balance
    upcycle: UpcycleConfig = UpcycleConfig(
        blocks="all", expert_form="split",
        moe=UPCYCLE_MOE.replace(n_experts=8, top_k=2, router="noisy", balance_loss="cv2",
                                balance_coef=0.01, dispatch="dense"))
    student_layers: int = 1  # the student keeps the substrate's first blocks
    prompt_len: int = 48  # tokens of the prompt block (bos + prompt tail + eos bos)
    response_len: int = 32  # response tokens incl. eos (the sampling length too)
    n_train: int = 20000  # chit-chat pairs used for training
    n_val: int = 32
    n_test: int = 96
    sft: TrainConfig = TrainConfig(steps=600, batch_size=16, lr=1e-3, warmup_steps=30,
                                   schedule="cosine", weight_decay=0.01, log_every=50)
    # the paper: AdamW, lr 1e-5 (student and router), weight decay 0.01, batch 16
    distill: TrainConfig = TrainConfig(steps=150, batch_size=16, lr=1e-5, warmup_steps=0,
                                       schedule="constant", weight_decay=0.01, eval_every=50,
                                       log_every=25)
    kd: DistillConfig = DistillConfig(router_lr=1e-5)  # method is set per row
    methods: tuple[Method, ...] = METHODS
    dense_teacher_methods: tuple[Method, ...] = ("kd", "gkd")
    teacher_ks: tuple[int, ...] = (1, 2, 4, 8)  # Fig. 2 sweep (every training seed); () = skip
    ka_lambdas: tuple[float, ...] = (0.0, 0.2)  # extra KA runs (lambda sweep at kd.ka_m)
    ka_ms: tuple[int, ...] = (1, 4)  # extra KA runs (M sweep at kd.ka_lambda)
    # KD (MoE teacher) at each student learning rate, first training seed: shows which rates
    # train within distill.steps; () = skip
    lr_sweep: tuple[float, ...] = ()
    # SAR at each router learning rate, first training seed (how far the router moves); () = skip
    router_lr_sweep: tuple[float, ...] = ()
    seeds: int = 3  # training seeds of every distillation run and sweep
    # "per_seed": each training seed fine-tunes its own teachers and SFT student (module
    # docstring); "shared": seed 0's for every seed (the dense-vs-MoE claims unjudged);
    # "auto": per_seed for the upcycled teacher, shared for an imported one (no dense teacher
    # to compare; `seeds` copies of a large checkpoint would not fit)
    teachers: Literal["auto", "per_seed", "shared"] = "auto"
    eval_seeds: int = 5  # sampling seeds of every ROUGE-L score (as the paper)
    # the paper samples evaluation responses at temperature 1 (top-p 1); 0 = greedy
    eval_temperature: float = 1.0
    seed: int = 0

    def unread_fields(self) -> dict[str, str]:
        return self._read_only_with("model", {"dense_lm_chat": ("dense_lm_chat",),
                                              "dense_lm_prose": ("dense_lm_prose",)})

    def validate(self):
        require_read(self, "sft", "the SFT run")
        require_read(self, "distill", "each distillation", eval_fn=True)
        r = self._require
        sub = None if self.model == "smollm2_135m" else getattr(self, self.model)
        n_layers, max_len = 30, None if sub is None else sub.max_seq_len
        n_layers = n_layers if sub is None else sub.n_layers
        moe, where = self.teacher_moe()
        if self.teacher:
            hf = self.hf_teacher()
            n_layers, max_len = hf.n_layers, hf.max_seq_len
            r(not self.dense_teacher_methods, f"teacher={self.teacher} has no dense teacher: "
              "set dense_teacher_methods=()")
        r(1 <= self.student_layers < n_layers,
          f"student_layers={self.student_layers} must be in [1, {n_layers}) (the teacher's "
          "layers)")
        r(max_len is None or self.prompt_len + self.response_len <= max_len,
          f"prompt_len + response_len exceeds the model's max_seq_len ({max_len})")
        if sub is not None and not self.teacher and self.upcycle.expert_form == "lm":
            full = min(sub.d_model, sub.d_hidden)  # the FFN's matrices: [d, h] and [h, d]
            r(self.upcycle.lm_rank <= full, f"upcycle.lm_rank={self.upcycle.lm_rank}: a rank "
              f"past min(d_model, d_hidden) = {full} of {self.model} is full rank already")
        r(all(1 <= k <= moe.n_experts for k in self.teacher_ks),
          f"teacher_ks={self.teacher_ks} must lie in [1, {moe.n_experts}] (the experts of "
          f"{where})")
        r(bool(self.methods or self.dense_teacher_methods),
          "methods=() and dense_teacher_methods=(): nothing to distil; give at least one")
        r(moe.router == "noisy" or not ({"sar"} & set(self.methods) or self.router_lr_sweep),
          f"SAR trains W_g and W_noise of a noisy top-k router, and {where}'s router is "
          f"{moe.router}: drop sar from methods and router_lr_sweep"
          + ("" if self.teacher else ", or set upcycle.moe.router=noisy"))
        r(all(x > 0 for x in self.lr_sweep + self.router_lr_sweep),
          "lr_sweep and router_lr_sweep take learning rates > 0")
        r(self.seeds >= 1 and self.eval_seeds >= 1, "seeds and eval_seeds must be >= 1")
        r(self.eval_temperature >= 0, "eval_temperature must be >= 0 (0 = greedy)")

    @property
    def teacher_draws(self) -> int:
        """How many draws of the teachers and SFT student the study fine-tunes."""
        shared = self.teachers == "shared" or (self.teachers == "auto" and bool(self.teacher))
        return 1 if shared else self.seeds

    def teacher_moe(self) -> tuple[MoEConfig, str]:
        """The MoE teacher's expert layer and where it is configured (the upcycling, or the
        imported checkpoint's ``config.json``)."""
        if self.teacher:
            return self.hf_teacher().ffn_slots[0], "the imported teacher"
        return self.upcycle.moe, "upcycle.moe"

    def hf_teacher(self):
        """The imported teacher's DecoderConfig (``teacher=hf:<dir>``), read from its
        ``config.json`` (an unsupported family refused in one line)."""
        return self._checked(hf_spec_config, self.teacher, "teacher")


def make_config(preset: str) -> MoEKDConfig:
    if preset == "quick":
        # the paper's rates (1e-5) barely move the student or the router in a CPU step
        # budget; the lr sweeps show it, and the study distils at the nearest rate that trains
        return MoEKDConfig(
            distill=TrainConfig(steps=150, batch_size=16, lr=1e-4, warmup_steps=10,
                                schedule="constant", weight_decay=0.01, eval_every=50,
                                log_every=25),
            kd=DistillConfig(router_lr=1e-4), teacher_ks=(2, 4, 8), ka_lambdas=(0.2,),
            ka_ms=(4,), lr_sweep=(1e-5, 1e-4, 3e-4, 1e-3), router_lr_sweep=(1e-5, 1e-4, 1e-3))
    return MoEKDConfig(
        model="smollm2_135m", dense_lm_chat=substrate_config("dense_lm_chat", "full"),
        dense_lm_prose=substrate_config("dense_lm_prose", "full"),
        upcycle=UpcycleConfig(
            blocks="all", expert_form="split",
            moe=UPCYCLE_MOE.replace(n_experts=16, top_k=4, router="noisy", balance_loss="cv2",
                                    balance_coef=0.01, dispatch="auto")),
        student_layers=15,
        prompt_len=256, response_len=256, n_train=100_000, n_val=500, n_test=2000,
        sft=TrainConfig(steps=3000, batch_size=16, lr=1e-4, warmup_steps=100,
                        schedule="cosine", weight_decay=0.01, log_every=50),
        distill=TrainConfig(steps=6000, batch_size=16, lr=1e-5, warmup_steps=0,
                            schedule="constant", weight_decay=0.01, eval_every=1000,
                            log_every=50),
        kd=DistillConfig(router_lr=1e-5), teacher_ks=(1, 2, 4, 7, 8),
        ka_lambdas=(0.0, 0.05, 0.1, 0.2), ka_ms=(1, 2, 4), seeds=5, eval_seeds=5)


def _summary_row(teacher: str, method: str, runs: list[dict]) -> dict:
    """The ``main`` table's row of one (teacher, method): its runs pooled (:func:`_pooled`),
    with the spread over the sampling seeds and, of the perplexity, over the runs."""
    p, ppl = _pooled(runs), [r["ppl"] for r in runs]
    return {"teacher": teacher, "method": method, "rouge_l": p["rouge_l"],
            "std": mean_std(p["rouge_l_seeds"])[1], "ppl": p["ppl"],
            "ppl std": mean_std(ppl)[1],
            "kl_to_moe_teacher": p["kl"], "runs": len(runs), "scores": len(p["rouge_l_seeds"])}


# ------------------------------------------------------------------------------ study


def run(cfg: MoEKDConfig, run: RunDir) -> dict:
    s, start = setup(cfg)
    run.note(start)
    refs, gap = _references(cfg, run, s)
    per_seed, sar_kls = _methods(cfg, s)
    rows, paired_tab = _main_tables(cfg, run, per_seed, refs)
    mass = _gate_mass(cfg, run, s)
    teacher_k_sweep(cfg, run, s)
    ka_sweep(cfg, run, s, per_seed)
    sar_kl_table(run, sar_kls)
    lr_sweeps(cfg, run, s, per_seed, sar_kls)
    ran = {r["comparison"] for r in paired_tab}
    verdicts = {label: c for label, c in zip(CLAIMS, claims(
        {"paired": paired_tab, "references": reference_rows(refs), "per_seed": per_seed}))
        if label in ran}
    run.note(_setting_note(cfg))
    out = {"student_sft": refs["student (SFT)"]["rouge_l"],
           "moe_teacher": refs["MoE teacher"]["rouge_l"],
           "dense_teacher": refs.get("dense teacher", {}).get("rouge_l", float("nan")),
           "teacher_worth_distilling": gap["worth_distilling"],
           "gate_mass_mean": float(np.mean(mass)) if mass else float("nan")}
    out.update({f"{r['method']}_{r['teacher'].split()[0]}": r["rouge_l"] for r in rows})
    out["shape_holds"] = {k: bool(c.holds) for k, c in verdicts.items()}
    out["headline"] = ("student ROUGE-L (MoE teacher): " + ", ".join(
        f"{r['method']} {r['rouge_l']:.4f}" for r in rows if r["teacher"] == "MoE teacher")
        + f"; SFT student {out['student_sft']:.4f}, MoE teacher {out['moe_teacher']:.4f}")
    return out


def _references(cfg: MoEKDConfig, run: RunDir, s: Setup) -> tuple[dict, dict]:
    """Teachers and SFT student before distillation (each draw's, and over the draws), and
    whether the teacher is worth it."""
    per_draw = []
    for d in s.draws:
        refs = {"MoE teacher": d.score(d.moe_teacher), "student (SFT)": d.score(d.student_sft)}
        if d.dense_teacher is not None:
            refs["dense teacher"] = d.score(d.dense_teacher)
        per_draw.append(refs)
    refs = {k: _pooled([r[k] for r in per_draw]) for k in per_draw[0]}
    gap = teacher_gap(refs)
    over = (f"over {len(s.draws)} draws (one per training seed) and " if len(s.draws) > 1
            else "over ")
    run.table("references", reference_rows(refs),
              title=f"Before distillation: test ROUGE-L {over}{cfg.eval_seeds} sampling seeds, "
                    "response-token perplexity, KL(MoE teacher || model) per response token")
    if len(s.draws) > 1:
        run.table("references_per_seed",
                  [{"seed": i, **row} for i, r in enumerate(per_draw)
                   for row in reference_rows(r)],
                  title="Before distillation, each training seed's draw of the teachers and "
                        "the SFT student (ROUGE-L over the sampling seeds)")
    run.note(teacher_gap_note(gap))
    return refs, gap


def _pooled(scores: list[dict]) -> dict:
    """One model's scores over several runs or draws: ROUGE-L over every one's sampling
    seeds, mean perplexity and KL."""
    flat = [x for sc in scores for x in sc["rouge_l_seeds"]]
    return {"rouge_l_seeds": flat, "rouge_l": float(np.mean(flat)),
            "ppl": float(np.mean([sc["ppl"] for sc in scores])),
            "kl": float(np.mean([sc["kl"] for sc in scores]))}


def reference_rows(refs: dict) -> list[dict]:
    """The ``references`` table: each model's scores before distillation."""
    return [{"model": k, "rouge_l": v["rouge_l"], "std": mean_std(v["rouge_l_seeds"])[1],
             "ppl": v["ppl"], "kl_to_moe_teacher": v["kl"]} for k, v in refs.items()]


def _methods(cfg: MoEKDConfig, s: Setup) -> tuple[list[dict], list[dict]]:
    """Every (teacher, method, training seed) run's scores, and SAR's router KL per layer."""
    per_seed, sar_kls = [], []
    plan = [("MoE", "moe_teacher", m) for m in cfg.methods]
    plan += [("dense", "dense_teacher", m) for m in cfg.dense_teacher_methods]
    for teacher_name, which, method in plan:
        for seed in range(cfg.seeds):
            d = s.draw(seed)
            student, pair = s.distil(cfg, s.kd.replace(method=method), seed,
                                     f"{LABELS[method]} ({teacher_name}) s{seed}",
                                     teacher=getattr(d, which))
            sc = d.score(student)
            per_seed.append({"teacher": f"{teacher_name} teacher", "method": LABELS[method],
                             "seed": seed, "teacher_draw": s.draw_index(seed),
                             "rouge_l": sc["rouge_l"],
                             "rouge_l_sampling_std": mean_std(sc["rouge_l_seeds"])[1],
                             "ppl": sc["ppl"], "kl_to_moe_teacher": sc["kl"],
                             "_seeds": sc["rouge_l_seeds"]})
            if method == "sar":
                sar_kls += [{**r, "seed": seed} for r in router_kl_by_layer(
                    d.moe_teacher, pair.teacher, [s.val.batches[0]])]
    return per_seed, sar_kls


def _main_tables(cfg, run: RunDir, per_seed: list[dict], refs: dict):
    """The paper's table (teacher x method), every run, the paired comparisons, the plot."""
    groups = {}
    for r in per_seed:
        groups.setdefault((r["teacher"], r["method"]), []).append(
            {"rouge_l_seeds": r.pop("_seeds"), "ppl": r["ppl"], "kl": r["kl_to_moe_teacher"]})
    rows = [_summary_row(t, m, runs) for (t, m), runs in groups.items()]
    run.table("main", rows, title="Test ROUGE-L of the distilled student (mean and std over "
              "training and sampling seeds), response perplexity (mean and std over training "
              "seeds), KL(MoE teacher || student); references: " + ", ".join(
                  f"{k} {v['rouge_l']:.4f} (ppl {v['ppl']:.3f})" for k, v in refs.items()),
              columns=["teacher", "method", "rouge_l", "std", "ppl", "ppl std",
                       "kl_to_moe_teacher", "runs", "scores"])
    run.table("per_seed", per_seed, title="Every distillation run (ROUGE-L: mean over the "
              "sampling seeds)")
    paired_tab = paired_rows(per_seed)
    if paired_tab:
        run.table("paired", paired_tab, title="Paired per training seed (same seeds, same "
                  "sampling seeds): first minus second; -ppl rows: a positive difference "
                  "means lower perplexity for the first")
    labels = [f"{r['method']} ({r['teacher'].split()[0]})" for r in rows]
    run.bar_plot("main", labels, [r["rouge_l"] for r in rows], errors=[r["std"] for r in rows],
                 ylabel="test ROUGE-L", title="Student ROUGE-L by method and teacher",
                 hlines={k: v["rouge_l"] for k, v in refs.items()})
    return rows, paired_tab


def _gate_mass(cfg: MoEKDConfig, run: RunDir, s: Setup) -> list[float]:
    """Fig. 1: the gate mass of the activated experts, per layer."""
    mass = gate_mass_by_layer(s.moe_teacher, [s.val.batches[0]])
    run.table("gate_mass", [{"layer": i, "activated": m, "not_activated": 1 - m}
                            for i, m in enumerate(mass)],
              title=f"Gate mass of the top-{cfg.upcycle.moe.top_k} experts vs the other "
                    f"{cfg.upcycle.moe.n_experts - cfg.upcycle.moe.top_k} (validation tokens)")
    run.bar_plot("gate_mass", [f"layer {i}" for i in range(len(mass))], mass,
                 ylabel="gate mass of activated experts", hlines={"50%": 0.5},
                 title="Fig. 1 analog: activated experts' share of the gate")
    return mass


# the distillation settings a run may change from the paper's (DistillConfig's defaults),
# each named in the summary where it does
KD_SETTINGS = {"on_policy_fraction": "the share of rows whose response the student samples",
               "temperature": "the student's sampling temperature",
               "top_p": "the student's sampling top-p",
               "reduction": "the divergence's mean over positions",
               "ka_lambda": "KA's probability of sampling the N-1 experts",
               "sar_beta": "SAR's balance-loss weight"}


def _kd_changes(kd: DistillConfig) -> str:
    """A sentence naming each of :data:`KD_SETTINGS` that ``kd`` changes from the paper's
    (``""`` when none)."""
    paper = DistillConfig()
    changed = [f"kd.{k}={getattr(kd, k)!r} ({what}; the paper's: {getattr(paper, k)!r})"
               for k, what in KD_SETTINGS.items() if getattr(kd, k) != getattr(paper, k)]
    return f" Changed from the paper's distillation: {'; '.join(changed)}." if changed else ""


def _setting_note(cfg: MoEKDConfig) -> str:
    """How the comparisons are judged, and the settings that ran, beside the paper's."""
    kd_loss = (f"{cfg.kd.kd_ratio:g} forward KL + {1 - cfg.kd.kd_ratio:g} cross-entropy (the "
               "official code's kd-ratio 0.5)" if cfg.kd.kd_ratio < 1 else
               "pure forward KL (kd.kd_ratio=1)")
    sampling = ("samples at temperature 1, top-p 1 (the paper's setting)."
                if cfg.eval_temperature == 1.0 else
                f"decodes at temperature {cfg.eval_temperature:g} (0 = greedy; the paper "
                "samples at 1).")
    return ("Paired comparisons are judged on ROUGE-L (the paper's metric; response perplexity "
            "beside it, not judged), a method's win only where the winner also beats the SFT "
            "student trained on alike (the paper: with the MoE teacher ALL, KA, SAR > GKD > KD, "
            "each winner above the SFT student; a comparable dense teacher gives better KD and "
            "GKD students). "
            f"KD's loss: {kd_loss}. KA: M = {cfg.kd.ka_m} "
            + ("optimizer updates per batch, one per teacher pass (Algorithm 1)"
               if cfg.kd.ka_updates == "sequential" else
               "teacher passes averaged into one update (kd.ka_updates=averaged)")
            + f". Student lr {cfg.distill.lr:g}, router lr "
            f"{cfg.kd.router_lr:g} (the paper: 1e-5 both), weight decay "
            f"{cfg.distill.weight_decay:g}. SAR runs the paper's two stages per step (router "
            f"AdamW step, then distillation under the updated router). Evaluation {sampling} "
            + ("Teachers: each training seed fine-tunes its own MoE teacher, dense teacher and "
               f"SFT student (teachers={cfg.teachers}), so the intervals cover their training "
               "too." if cfg.teacher_draws > 1 or cfg.seeds == 1 else
               "Teachers: one MoE teacher, dense teacher and SFT student for every training "
               f"seed (teachers={cfg.teachers}): the dense-vs-MoE claims are not judged.")
            + _kd_changes(cfg.kd))


def checkpoint_runs(cfg: MoEKDConfig) -> list:
    """The preset's runs with each named real checkpoint as ``teacher=hf:<dir>``
    (:data:`moejax.io.hf_moe_checkpoints.CHECKPOINTS`), from its ``config.json`` alone: the
    teacher's and the student's SFT and each method's distillation (SAR aside: these
    routers are softmax, not noisy top-k) at this preset's shapes (``make full-aot``)."""
    tok = ByteTokenizer()  # the batches' shapes, not their ids, make the program

    def batch(bs: int):
        return chat_prompt_response("train", tok, batch_size=bs, limit=bs,
                                    prompt_len=cfg.prompt_len,
                                    response_len=cfg.response_len).batch(0)

    out = []
    for name, c in CHECKPOINTS.items():
        hf = hf_moe_config(c, dispatch=cfg.upcycle.moe.dispatch)
        teacher = lambda hf=hf: DecoderLM(hf, rngs=nnx.Rngs(0))  # noqa: E731 (Rngs traced)
        student = lambda teacher=teacher: keep_layers(teacher(), range(cfg.student_layers))  # noqa: E731
        out += [abstract_run(teacher, cfg.sft, batch(cfg.sft.batch_size),
                             label=f"teacher=hf:{name}: SFT MoE teacher (config.json only)"),
                abstract_run(student, cfg.sft, batch(cfg.sft.batch_size),
                             label=f"teacher=hf:{name}: SFT student (config.json only, "
                                   f"{cfg.student_layers} blocks)")]
        for method in (m for m in cfg.methods if m != "sar"):
            kd = cfg.kd.replace(method=method, eos_id=tok.eos_id, pad_id=tok.pad_id or 0)
            out.append(abstract_run(
                lambda kd=kd, teacher=teacher, student=student: distill_pair(student(),
                                                                            teacher(), kd),
                cfg.distill, batch(cfg.distill.batch_size), loss_fn=distill_loss_fn(kd),
                label=f"teacher=hf:{name}: {LABELS[method]} (config.json only)"))
    return out


STUDY = Study(
    "moe_kd", make_config, run, claims=claims, checkpoint_runs=checkpoint_runs,
    smoke=("n_train=64", "n_val=8", "n_test=8", "seeds=1", "eval_seeds=1"),
    paper_scale=PAPER_SCALE,
    derived_keys=(("sft.seed", "seed + i for teacher draw i"),
                  ("distill.seed", "seed + 100 (s + 1) for distillation seed s"),
                  ("kd.method", "each of methods, dense_teacher_methods and the sweeps'"),
                  ("kd.divergence", "each method's own: forward KL for KD, reverse KL on "
                                    "student samples for the others"),
                  ("kd.teacher_k", "each method's: the MoE teacher's trained k for KD and "
                                   "GKD, all experts for ALL and SAR, N-1 for KA; teacher_ks "
                                   "sweeps KD's"),
                  ("kd.eos_id", "the tokenizer's eos id"),
                  ("kd.pad_id", "the tokenizer's pad id")),
)


if __name__ == "__main__":
    raise SystemExit(STUDY.main())
