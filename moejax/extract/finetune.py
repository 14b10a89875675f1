"""Evaluating and fine-tuning an extracted model: accuracy, MACs and parameters measured on
the test rows, and knowledge distillation from the unmodified model (its logits precomputed)
through the training loop."""

from __future__ import annotations

import numpy as np

from moejax.data.batches import ArrayBatches
from moejax.evaluate import classifier_kd_loss_fn
from moejax.extract.layer_surgery import copy_model
from moejax.extract.macs import model_macs, param_counts
from moejax.extract.pipeline import routing_stats
from moejax.substrates.classifier_data import ClassifierData
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train

__all__ = ["evaluate_extracted", "kd_finetune", "load_cv"]


def evaluate_extracted(data: ClassifierData, model, name: str, dense: dict) -> dict:
    """Accuracy, MACs per example and parameters of ``model`` (active neurons measured on the
    test rows), their change against ``dense`` (``{"MACs", "params"}``; empty: none), and
    the per-layer routing statistics under ``"_stats"``."""
    stats = routing_stats(model, data.eval_batches(), n_classes=data.n_classes)
    macs = model_macs(model, data.seq_lens, {i: s["active_neurons"] for i, s in stats.items()})
    params = param_counts(model)["params"]
    row = {"model": name, "accuracy": data.evaluator(model)["accuracy"],
           "MACs": macs["total"], "params": params}
    if dense:
        row["MACs_change_%"] = 100 * (macs["total"] / dense["MACs"] - 1)
        row["params_change_%"] = 100 * (params / dense["params"] - 1)
    row["_stats"] = stats
    return row


def kd_finetune(data: ClassifierData, model, cfg: TrainConfig, *, alpha: float,
                temperature: float, seed: int):
    """A copy of ``model`` fine-tuned with ``alpha`` KL(teacher || model) at ``temperature``
    + ``1 - alpha`` cross-entropy, the teacher being the unmodified substrate."""
    model = copy_model(model)
    arrays = dict(data.train, teacher_logits=data.teacher_logits)
    src = ArrayBatches(arrays, batch_size=cfg.batch_size, seed=seed)
    train(model, src, cfg.replace(seed=seed), progress=True, desc="KD fine-tune",
          loss_fn=classifier_kd_loss_fn(alpha=alpha, temperature=temperature))
    return model


def load_cv(stats: dict) -> float:
    """Mean over layers of the coefficient of variation of the expert loads."""
    return float(np.mean([np.std(s["load"]) / np.mean(s["load"]) for s in stats.values()]))
