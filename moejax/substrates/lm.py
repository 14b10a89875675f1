"""Recipes of the language-model substrates (used through :mod:`moejax.substrates`).

* ``dense_lm_prose``: a small dense decoder (SwiGLU, GQA, RoPE) pre-trained from scratch on
  the prose corpus (``prose/pydoc``: the Python documentation sources), byte-level tokens.
* ``dense_lm_code``: that model fine-tuned on the code corpus (``stdlib_code``), i.e. a
  "pre-fine-tuned" dense model pair for delta studies (DeRS, DARE, ...).

Tokens are :class:`moejax.data.tokenizer.ByteTokenizer` ids (vocabulary 259: pad/bos/eos +
UTF-8 bytes); documents are joined with ``eos``. Training windows are
:class:`~moejax.data.lm_batches.WindowBatches` (random offsets, deterministic per step, so the
training loop resumes exactly). Losses are in nats per byte (``val_ppl`` = per-byte
perplexity; ``val_bpb`` = bits per byte).
"""

from __future__ import annotations

import math
from typing import Literal

from flax import nnx

from moejax.config import Config, ConfigError, config
from moejax.data.corpora import corpus_tokens
from moejax.data.lm_batches import WindowBatches
from moejax.data.tokenizer import ByteTokenizer
from moejax.evaluate import LMEvaluator
from moejax.io._common import jit_init
from moejax.nn.decoder import DecoderConfig, DecoderLM, dense_decoder_config
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train

__all__ = ["LMSubstrateConfig", "lm_config", "make_lm", "train_lm", "corpus_tokens",
           "lm_evaluator"]


@config
class LMSubstrateConfig(Config):
    """A dense byte-level decoder trained on one corpus (optionally from another substrate)."""

    corpus: Literal["prose/pydoc", "prose/kjv", "stdlib_code", "chitchat"] = "prose/pydoc"
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_hidden: int = 384
    max_seq_len: int = 1024
    seq_len: int = 128
    eval_batches: int = 8
    init_from: Literal["", "dense_lm_prose"] = ""  # "" = from scratch
    # the preset of the substrate it starts from; "<preset>_smoke": that preset as a smoke run
    init_preset: Literal["quick", "full", "quick_smoke", "full_smoke"] = "quick"
    train: TrainConfig = TrainConfig()

    def validate(self):
        self._require(self.seq_len <= self.max_seq_len,
                      f"seq_len={self.seq_len} exceeds max_seq_len={self.max_seq_len}")
        self._require(self.eval_batches >= 1, "eval_batches must be >= 1")
        try:  # the decoder this config builds must be valid too: fail at construction
            self.decoder_config()
        except ConfigError as e:
            raise ConfigError(f"LMSubstrateConfig: {e}") from None

    def decoder_config(self) -> DecoderConfig:
        return dense_decoder_config(vocab_size=ByteTokenizer.vocab_size, d_model=self.d_model,
                                    n_layers=self.n_layers, n_heads=self.n_heads,
                                    n_kv_heads=self.n_kv_heads, d_hidden=self.d_hidden,
                                    max_seq_len=self.max_seq_len)


def lm_config(name: str, preset: str) -> LMSubstrateConfig:
    """Default config of ``dense_lm_prose`` / ``dense_lm_code`` / ``dense_lm_chat`` for
    ``preset``."""
    if name == "dense_lm_chat":
        return _chat_config(preset)
    code = name == "dense_lm_code"
    if preset == "quick":  # about a CPU minute each
        model = dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_hidden=384)
        if code:
            tr = TrainConfig(steps=150, batch_size=16, lr=1e-3, warmup_steps=15,
                             schedule="cosine", eval_every=50, log_every=10, ckpt_every=50)
        else:
            tr = TrainConfig(steps=200, batch_size=16, lr=3e-3, warmup_steps=20,
                             schedule="cosine", eval_every=100, log_every=10, ckpt_every=100)
        seq, ev = 128, 8
    else:  # GPU
        model = dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_hidden=1536)
        if code:
            tr = TrainConfig(steps=1000, batch_size=64, lr=3e-4, warmup_steps=50,
                             schedule="cosine", eval_every=250, ckpt_every=250, log_every=20)
        else:
            tr = TrainConfig(steps=4000, batch_size=64, lr=1e-3, warmup_steps=200,
                             schedule="wsd", eval_every=500, ckpt_every=500, log_every=20)
        seq, ev = 512, 32
    return LMSubstrateConfig(corpus="stdlib_code" if code else "prose/pydoc", seq_len=seq,
                             eval_batches=ev, init_from="dense_lm_prose" if code else "",
                             init_preset=preset, train=tr, **model)


def _chat_config(preset: str) -> LMSubstrateConfig:
    """A decoder pre-trained on the chit-chat dialogues themselves, wider and longer-trained
    than ``dense_lm_prose``: the distillation study's teacher must clearly beat a student
    made of its first layers (quick: 3.2M parameters, 1500 steps of 32 x 128 bytes, about half
    an hour on two CPU cores, once, then cached)."""
    if preset == "quick":
        return LMSubstrateConfig(
            corpus="chitchat", d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_hidden=768,
            max_seq_len=256, seq_len=128, eval_batches=8,
            train=TrainConfig(steps=1500, batch_size=32, lr=2e-3, warmup_steps=50,
                              schedule="cosine", eval_every=500, log_every=25,
                              ckpt_every=250))
    return LMSubstrateConfig(
        corpus="chitchat", d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_hidden=1536,
        max_seq_len=1024, seq_len=512, eval_batches=32,
        train=TrainConfig(steps=8000, batch_size=64, lr=1e-3, warmup_steps=200,
                          schedule="wsd", eval_every=1000, ckpt_every=1000, log_every=20))


def make_lm(cfg: LMSubstrateConfig) -> DecoderLM:
    return jit_init(lambda: DecoderLM(cfg.decoder_config(), rngs=nnx.Rngs(cfg.train.seed)))


def lm_evaluator(cfg: LMSubstrateConfig, corpus: str | None = None) -> LMEvaluator:
    """Loss / accuracy / bits per byte on fixed validation windows of ``corpus``."""
    src = WindowBatches(corpus_tokens(corpus or cfg.corpus, "validation"),
                        batch_size=cfg.train.batch_size, seq_len=cfg.seq_len, seed=10_000)
    return LMEvaluator.from_source(src, cfg.eval_batches)


def train_lm(cfg: LMSubstrateConfig, run_dir: str, deps: dict, progress: bool = False):
    """Train (resuming from ``run_dir``) and return ``(model, metrics)``."""

    model = make_lm(cfg)
    metrics = {}
    if cfg.init_from:
        base = deps["init"].model
        if base.cfg != model.cfg:
            raise ValueError(f"substrate {cfg.init_from!r} has config {base.cfg}, but this "
                             f"fine-tune expects {model.cfg}; make the model fields agree")
        nnx.update(model, nnx.state(base, nnx.Param))
    evaluate = lm_evaluator(cfg)
    metrics["val_loss_before"] = evaluate(model)["loss"]
    if cfg.init_from:  # the same windows before and after, to measure forgetting
        eval_base = lm_evaluator(cfg, deps["init"].config.corpus)
        metrics["base_corpus_val_loss_before"] = eval_base(model)["loss"]
    src = WindowBatches(corpus_tokens(cfg.corpus, "train"), batch_size=cfg.train.batch_size,
                        seq_len=cfg.seq_len, seed=cfg.train.seed)
    train(model, src, cfg.train, run_dir=run_dir, eval_fn=evaluate, config=cfg,
          progress=progress)
    after = evaluate(model)
    metrics.update(val_loss=after["loss"], val_accuracy=after["accuracy"],
                   val_ppl=math.exp(after["loss"]), val_bpb=after["loss"] / math.log(2))
    if cfg.init_from:
        metrics["base_corpus_val_loss_after"] = eval_base(model)["loss"]
    return model, metrics
