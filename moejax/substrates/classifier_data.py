"""A trained classifier substrate with the labelled splits an extraction study reads: the
``vit_mnist5k`` ViT on MNIST-5k, or ``minilm_wordnet_pos`` (the real all-MiniLM-L6-v2
fine-tuned on WordNet gloss -> part of speech), with the teacher's logits on the training rows
precomputed for knowledge-distillation fine-tuning."""

from __future__ import annotations

from typing import Literal

import numpy as np

from moejax.data.builders_labelled import POS_NAMES
from moejax.evaluate import ClassifierEvaluator, classifier_logits
from moejax.io.hf_tokenizer import tokenizer_from_json
from moejax.io.minilm import minilm_dir
from moejax.substrates.classify import (
    WORDNET_CLASSES,
    MiniLMTaskConfig,
    ViTSubstrateConfig,
    mnist_arrays,
    wordnet_arrays,
)
from moejax.substrates.registry import build as build_substrate

__all__ = ["ClassifierData"]


class ClassifierData:
    """The substrate model, its name, the train / test arrays (``inputs``, ``labels`` and,
    for text, ``mask``), the class names, each test row's real length (``seq_lens``; ``None``
    for images) and their mean (``seq_len``), a test-set evaluator and the model's logits on
    the training rows.

    ``train_rows``: at least this many training rows are loaded (text); ``eval_rows``: test
    rows kept (0 = all)."""

    def __init__(self, model: Literal["vit", "minilm"], vit: ViTSubstrateConfig,
                 minilm: MiniLMTaskConfig, *, cache_dir: str | None = None,
                 train_rows: int = 0, eval_rows: int = 0):
        if model == "vit":
            sub = build_substrate("vit_mnist5k", vit, cache_dir=cache_dir, progress=True)
            tr, te = mnist_arrays("train"), mnist_arrays("test")
            self.train = {"inputs": tr[0], "labels": tr[1]}
            self.test = {"inputs": te[0], "labels": te[1]}
            self.n_classes, self.seq_lens = 10, None
            self.class_names = [str(i) for i in range(10)]
        else:
            sub = build_substrate("minilm_wordnet_pos", minilm, cache_dir=cache_dir,
                                  progress=True)
            tok = tokenizer_from_json(minilm_dir() / "tokenizer.json")
            lim = max(train_rows, minilm.max_train_examples)
            names = ("inputs", "labels", "mask")
            self.train = dict(zip(names, wordnet_arrays(minilm.task, "train", tok,
                                                        minilm.seq_len, lim)))
            self.test = dict(zip(names, wordnet_arrays(minilm.task, "test", tok,
                                                       minilm.seq_len, eval_rows)))
            self.n_classes = WORDNET_CLASSES[minilm.task]
            self.class_names = list(POS_NAMES)
        if eval_rows:
            self.test = {k: v[:eval_rows] for k, v in self.test.items()}
        if model != "vit":
            self.seq_lens = self.test["mask"].sum(1).astype(np.int64)
        self.model, self.substrate = sub.model, f"{sub.name} ({sub.path.name})"
        self.evaluator = ClassifierEvaluator(self.test["inputs"], self.test["labels"],
                                             self.test.get("mask"))
        self.teacher_logits = classifier_logits(self.model, self.train["inputs"],
                                                self.train.get("mask"))

    @property
    def seq_len(self) -> float | None:
        """The mean real length of a test row (``None`` for images)."""
        return None if self.seq_lens is None else float(self.seq_lens.mean())

    def record_rows(self, rows: int) -> int:
        """The training rows :meth:`record_batches` draws for ``rows`` asked."""
        return min(rows, len(self.train["labels"]))

    def record_batches(self, rows: int, seed: int, size: int = 250):
        """Batches (no labels) of ``rows`` training rows drawn without replacement (all of
        them where the split holds fewer: :meth:`record_rows`)."""
        idx = np.random.default_rng([seed, 7]).permutation(len(self.train["labels"]))[
            :self.record_rows(rows)]
        for s in range(0, len(idx), size):
            yield {k: v[idx[s:s + size]] for k, v in self.train.items() if k != "labels"}

    def eval_batches(self, size: int = 250) -> list[dict]:
        n = len(self.test["labels"])
        return [{k: v[s:s + size] for k, v in self.test.items()} for s in range(0, n, size)]
