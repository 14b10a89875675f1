"""The MoE-distillation study's models and data (Every Expert Matters, Sec. 4): the dense
starting point or the imported MoE, the chat pairs, and each training seed's draw of the
teachers and the SFT student that its distillation runs start from. ``cfg`` is the study's
:class:`experiments.kd.moe_kd.MoEKDConfig`."""

from __future__ import annotations

from typing import NamedTuple

import jax

from moejax.data.batches import PromptResponseBatches
from moejax.data.loader import chat_prompt_response
from moejax.data.tokenizer import ByteTokenizer
from moejax.distill.training import DistillConfig, distil
from moejax.evaluate_generation import GenerationEvaluator, ResponseScorer
from moejax.io.hf_moe import hf_checkpoint_dir, load_hf_moe
from moejax.io.hf_tokenizer import tokenizer_from_hf_dir
from moejax.io.smollm2 import load_smollm2
from moejax.nn.decoder import keep_layers
from moejax.substrates import build as build_substrate
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.upcycle import upcycle_model

__all__ = ["Draw", "Setup", "setup", "draw", "dense_start", "imported_teacher", "data", "sft",
           "distil_run", "seed_cfg"]


class Draw(NamedTuple):
    """One training seed's teachers and SFT student, and its scorer (KL to its MoE teacher)."""

    moe_teacher: object
    dense_teacher: object
    student_sft: object
    score: ResponseScorer


class Setup(NamedTuple):
    """What every distillation run of the study shares: the data, and the teacher draws (one
    per training seed, or one for all: ``MoEKDConfig.teacher_draws``). ``moe_teacher``,
    ``dense_teacher``, ``student_sft`` and ``score`` are the first seed's (the learning-rate
    sweeps')."""

    kd: DistillConfig
    draws: tuple[Draw, ...]
    train_src: object
    val: GenerationEvaluator

    def draw_index(self, seed: int) -> int:
        """Which draw training seed ``seed`` distils from."""
        return seed if len(self.draws) > 1 else 0

    def draw(self, seed: int) -> Draw:
        """The teachers and SFT student of training seed ``seed``."""
        return self.draws[self.draw_index(seed)]

    @property
    def moe_teacher(self):
        return self.draws[0].moe_teacher

    @property
    def dense_teacher(self):
        return self.draws[0].dense_teacher

    @property
    def student_sft(self):
        return self.draws[0].student_sft

    @property
    def score(self) -> ResponseScorer:
        return self.draws[0].score

    def distil(self, cfg, dcfg: DistillConfig, seed: int, desc: str, **train_kw):
        """One distillation run from seed ``seed``'s SFT student with its MoE teacher (or
        ``teacher``)."""
        d = self.draw(seed)
        teacher = train_kw.pop("teacher", d.moe_teacher)
        return distil_run(d.student_sft, teacher, dcfg, seed_cfg(cfg, seed).replace(**train_kw),
                          self.train_src, self.val, desc)


def setup(cfg) -> tuple[Setup, str]:
    """The study's data and each draw's SFT MoE teacher (upcycled or imported), dense teacher
    and student (:class:`Draw`), with a line saying where they started."""
    if cfg.teacher:  # the imported MoE is the teacher, its first blocks the student
        moe, tok, start = imported_teacher(cfg)
        start = (f"MoE teacher: {start}, fine-tuned on the pairs; the student is its first "
                 f"{cfg.student_layers} blocks with their MoE FFNs (not the paper's dense "
                 "student: the checkpoint has no dense sibling sharing its tokenizer).")
        dense = moe
    else:
        dense, tok, start = dense_start(cfg)
        start, moe = f"Teacher and student start from {start}.", None
    train_src, val, test = data(cfg, tok)
    kd = cfg.kd.replace(eos_id=tok.eos_id, pad_id=tok.pad_id or 0)
    n = cfg.teacher_draws
    draws = tuple(draw(cfg, dense, moe, train_src, test, i, n) for i in range(n))
    return Setup(kd, draws, train_src, val), start


def draw(cfg, dense, imported, train_src, test, i: int, n: int) -> Draw:
    """Draw ``i`` of ``n``: the MoE teacher (``dense`` upcycled with key ``seed + i``, or a
    copy of the ``imported`` one), the dense teacher and the student (copies of ``dense``),
    each fine-tuned with seed ``seed + i``."""
    tcfg, tag = cfg.sft.replace(seed=cfg.seed + i), f" s{i}" if n > 1 else ""
    layers = range(dense.cfg.n_layers)
    moe = (keep_layers(imported, layers) if imported is not None else
           upcycle_model(dense, cfg.upcycle, jax.random.key(cfg.seed + i)))
    student = keep_layers(dense, range(cfg.student_layers))  # copied before any SFT
    moe_teacher = sft(moe, train_src, tcfg, f"SFT MoE teacher{tag}")
    dense_teacher = (sft(keep_layers(dense, layers), train_src, tcfg, f"SFT dense teacher{tag}")
                     if cfg.dense_teacher_methods else None)
    student_sft = sft(student, train_src, tcfg, f"SFT student{tag}")
    return Draw(moe_teacher, dense_teacher, student_sft, ResponseScorer(test, moe_teacher))


def imported_teacher(cfg):
    """``(teacher, tokenizer, description)`` of ``teacher=hf:<dir>``."""
    d = hf_checkpoint_dir(cfg.teacher, "teacher")
    model = load_hf_moe(d, dispatch=cfg.upcycle.moe.dispatch)
    moe = model.cfg.ffn_slots[0]
    return model, tokenizer_from_hf_dir(d), (
        f"the imported checkpoint {d.name} ({model.cfg.n_layers} layers, {moe.n_experts} "
        f"experts, top-{moe.top_k}, {'renormalised' if moe.renormalize else 'raw'} top-k "
        "weights)")


def dense_start(cfg):
    """``(dense model, tokenizer, description)``."""
    if cfg.model == "smollm2_135m":
        model, tok = load_smollm2(max_seq_len=max(512, cfg.prompt_len + cfg.response_len))
        return model, tok, "SmolLM2-135M-Instruct"
    sub = build_substrate(cfg.model, getattr(cfg, cfg.model),
                          cache_dir=cfg.substrate_cache or None, progress=True)
    return sub.model, ByteTokenizer(), (f"substrate {cfg.model} ({sub.path.name}, "
                                        f"{sub.config.corpus} val loss "
                                        f"{sub.metrics['val_loss']:.3f} nats/token)")


def data(cfg, tok):
    """``(train_src(batch_size, seed), val, test)``: the chat pairs' training batches and the
    validation and test generation evaluators."""
    kw = dict(prompt_len=cfg.prompt_len, response_len=cfg.response_len)

    def pairs(split, n, key, **more):  # refused where the split holds fewer (batches wrap)
        src = chat_prompt_response(split, tok, limit=n, **kw, **more)
        if len(src) < n:
            raise ValueError(f"{key}={n}: the chit-chat {split} split holds {len(src)} pairs; "
                             f"lower {key}")
        return src

    def fixed(split, n, key):
        return pairs(split, n, key, batch_size=n, shuffle=False).batch(0)

    rows = pairs("train", cfg.n_train, "n_train", batch_size=1).rows
    train_src = lambda bs, seed: PromptResponseBatches(rows, batch_size=bs, seed=seed)  # noqa: E731
    gen = dict(temperature=cfg.eval_temperature, top_p=cfg.kd.top_p, eos_id=tok.eos_id,
               pad_id=tok.pad_id or 0)
    val = GenerationEvaluator([fixed("validation", cfg.n_val, "n_val")], tok.decode, seeds=(0,),
                              **gen)
    test = GenerationEvaluator([fixed("test", cfg.n_test, "n_test")], tok.decode,
                               seeds=tuple(range(cfg.eval_seeds)), **gen)
    return train_src, val, test


def sft(model, train_src, tcfg: TrainConfig, desc: str):
    """``model`` fine-tuned in place on the pairs (SFT), returned."""
    train(model, train_src(tcfg.batch_size, tcfg.seed), tcfg, desc=desc)
    return model


def distil_run(student_sft, teacher, dcfg: DistillConfig, tcfg: TrainConfig, train_src, val, desc):
    """One distillation run from the SFT student (validation-best checkpoint kept)."""
    student, pair, _ = distil(student_sft, teacher, dcfg, tcfg,
                              train_src(tcfg.batch_size, tcfg.seed), eval_fn=val,
                              keep_best="rouge_l", desc=desc)
    return student, pair


def seed_cfg(cfg, s: int) -> TrainConfig:
    """Training seed ``s``'s distillation config."""
    return cfg.distill.replace(seed=cfg.seed + 100 * (s + 1))
