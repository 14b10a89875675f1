"""The controlled image pair of the DAREx studies: a functional 2-layer RMSNorm MLP
pre-trained on MNIST-5k (task A), to be fine-tuned on the sklearn 8x8 digits upsampled to
28x28 (task B: the same 10 classes under a domain shift, like the paper's CIFAR-10 -> SVHN).

``f(x) = W_o N(relu(W_1 N(x) + b_1)) + b_o`` with ``N`` an RMSNorm with a learnable scale.
The parameters are a plain dict (``norm_in``, ``w1``, ``b1``, ``norm_h``, ``wo``, ``bo``), so
the delta operations of :mod:`moejax.delta` apply to them directly; training goes through
:func:`moejax.train.loop.train_params`.

    tasks = load_tasks(seed)                      # {(task, split): (x [N, 784], y [N])}
    pre = pretrain_mlp(tasks, d_hidden, tcfg)     # theta_P
    fin = finetune_mlp(pre, tasks, tcfg)          # theta_F on task B

The pre-trained MLP is the cached substrate ``mlp_mnist5k`` (:class:`MLPSubstrateConfig`,
:class:`MLPClassifier`: the same parameters in an nnx module, ``.params()`` gives the dict),
so the DAREx studies that start from it train it once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import Config, config
from moejax.data.batches import ClassificationBatches
from moejax.data.builders_images import load_digits_arrays, load_mnist5k_arrays
from moejax.delta.lora import lora_apply, lora_init
from moejax.evaluate import ClassifierEvaluator, classifier_loss_fn
from moejax.nn import axes as ax
from moejax.train.hparams import TrainConfig, adam_linear_config, require_read
from moejax.train.loop import train, train_params

__all__ = ["load_tasks", "init_mlp", "mlp", "mlp_loss", "accuracy_fn", "pretrain_mlp",
           "finetune_mlp", "finetune_mlp_lora", "MLPSubstrateConfig", "MLPClassifier",
           "mlp_substrate_config", "make_mlp", "train_mlp_substrate"]


def _upsample_digits(images_N88: np.ndarray) -> np.ndarray:
    """sklearn 8x8 digits (0..16) -> 28x28 in [0, 1]: 3x nearest upsampling + 2-pixel border."""
    x = np.kron(images_N88.astype(np.float32) / 16.0, np.ones((3, 3), np.float32))
    return np.pad(x, ((0, 0), (2, 2), (2, 2)))


def load_tasks(seed: int = 0) -> dict:
    """``{(task, split): (x [N, 784] float32 in [0, 1], y [N] int32)}``: task ``"A"`` =
    MNIST-5k, task ``"B"`` = sklearn digits upsampled to 28x28; each split 80/10/10 by a
    permutation drawn from ``seed``."""

    out = {}
    for task, (images, labels) in (("A", load_mnist5k_arrays()), ("B", load_digits_arrays())):
        x = (images.astype(np.float32) / 255.0 if task == "A" else _upsample_digits(images))
        x = x.reshape(len(x), -1)
        order = np.random.default_rng(1234 + seed).permutation(len(x))
        n_tr, n_va = int(0.8 * len(x)), int(0.9 * len(x))
        parts = {"train": order[:n_tr], "validation": order[n_tr:n_va], "test": order[n_va:]}
        for split, idx in parts.items():
            out[task, split] = (jnp.asarray(x[idx]), jnp.asarray(labels[idx].astype(np.int32)))
    return out


MLP_AXES = {"norm_in": (ax.NORM,), "w1": (ax.FEATURES, ax.MLP), "b1": (ax.MLP,),
            "norm_h": (ax.NORM,), "wo": (ax.MLP, ax.CLASSES), "bo": (ax.CLASSES,)}


def init_mlp(key: jax.Array, d_in: int, d_hidden: int, n_classes: int = 10) -> dict:
    """He-initialised weights, zero biases, unit RMSNorm scales."""
    k1, k2 = jax.random.split(key)
    return {
        "norm_in": jnp.ones((d_in,)), "w1": jax.random.normal(k1, (d_in, d_hidden)) * d_in**-0.5,
        "b1": jnp.zeros((d_hidden,)), "norm_h": jnp.ones((d_hidden,)),
        "wo": jax.random.normal(k2, (d_hidden, n_classes)) * d_hidden**-0.5,
        "bo": jnp.zeros((n_classes,)),
    }


def _rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def mlp(params: dict, x_BI: jax.Array) -> jax.Array:
    """Logits ``[B, L]`` of the MLP."""
    h = jax.nn.relu(_rms(x_BI, params["norm_in"]) @ params["w1"] + params["b1"])
    return _rms(h, params["norm_h"]) @ params["wo"] + params["bo"]


def mlp_loss(params, batch, key=None, train=True):
    """Mean cross-entropy of :func:`mlp` on ``batch["inputs"]`` / ``batch["labels"]``."""
    logp = jax.nn.log_softmax(mlp(params, batch["inputs"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][:, None], 1))


def accuracy_fn(data):
    """``params -> accuracy`` of the MLP on ``data = (x, y)``."""
    ev = ClassifierEvaluator(*data).bind_fn(mlp)
    return lambda params: ev(params)["accuracy"]


def _source(data, batch_size: int, seed: int) -> ClassificationBatches:
    return ClassificationBatches(np.asarray(data[0]), np.asarray(data[1]), batch_size=batch_size,
                                 seed=seed, num_classes=10)


def pretrain_mlp(tasks: dict, d_hidden: int, tcfg: TrainConfig, desc: str = "pretrain MNIST"):
    """``theta_P``: the MLP initialised from ``tcfg.seed`` and trained on task A."""
    p0 = init_mlp(jax.random.key(tcfg.seed), tasks["A", "train"][0].shape[1], d_hidden)
    params, _ = train_params(p0, _source(tasks["A", "train"], tcfg.batch_size, tcfg.seed),
                             tcfg, mlp_loss, desc=desc)
    return params


def finetune_mlp_lora(pre: dict, tasks: dict, tcfg: TrainConfig, rank: int,
                      desc: str = "LoRA finetune digits"):
    """LoRA factors (rank ``rank``, on ``w1`` and ``wo``; ``pre`` frozen) trained on task B
    with ``tcfg``: the model is ``lora_apply(pre, lora)``."""

    mask = {k: k in ("w1", "wo") for k in pre}
    lora0 = lora_init(jax.random.key(tcfg.seed), pre, mask, rank)

    def loss(lora, batch, key=None, train=True):
        return mlp_loss(lora_apply(pre, lora), batch, key, train)

    lora, _ = train_params(lora0, _source(tasks["B", "train"], tcfg.batch_size, tcfg.seed + 1),
                           tcfg, loss, desc=desc)
    return lora


def finetune_mlp(pre: dict, tasks: dict, tcfg: TrainConfig, desc: str = "finetune digits"):
    """``theta_F``: ``pre`` fine-tuned on task B with ``tcfg`` (its optimizer: Adam, AdamR...)."""
    params, _ = train_params(pre, _source(tasks["B", "train"], tcfg.batch_size, tcfg.seed + 1),
                             tcfg, mlp_loss, desc=desc)
    return params


# ------------------------------------------------------------------------- the substrate


@config
class MLPSubstrateConfig(Config):
    """The MLP pre-trained on MNIST-5k (task A): hidden width, the seed of the 80/10/10 split
    of both tasks, and the DAREx recipe's training (its seed: initialisation, batch order)."""

    d_hidden: int = 256
    split_seed: int = 0
    train: TrainConfig = adam_linear_config(400, 1e-3, batch_size=128, warmup=20)

    def validate(self) -> None:
        require_read(self, "train", "the MLP's pre-training", run_dir=True)
        self._require(self.d_hidden > 0, f"d_hidden={self.d_hidden} must be > 0")


def mlp_substrate_config(preset: str) -> MLPSubstrateConfig:
    if preset == "quick":
        return MLPSubstrateConfig()
    return MLPSubstrateConfig(d_hidden=1024,
                              train=adam_linear_config(3000, 1e-3, batch_size=128, warmup=20))


class MLPClassifier(nnx.Module):
    """:func:`mlp` with its parameters as ``nnx.Param`` s: ``logits, {} = m(x_BI)``."""

    def __init__(self, d_in: int, d_hidden: int, n_classes: int = 10, *, seed: int = 0):
        for k, v in init_mlp(jax.random.key(seed), d_in, d_hidden, n_classes).items():
            setattr(self, k, ax.param(v, *MLP_AXES[k]))

    def params(self) -> dict:
        """The plain parameter dict :func:`mlp` and the delta operations take."""
        return {k: getattr(self, k)[...] for k in ("norm_in", "w1", "b1", "norm_h", "wo", "bo")}

    def __call__(self, x_BI, *, train: bool = False, key=None):
        return mlp(self.params(), x_BI), {}


def make_mlp(cfg: MLPSubstrateConfig) -> MLPClassifier:
    return MLPClassifier(784, cfg.d_hidden, seed=cfg.train.seed)


def train_mlp_substrate(cfg: MLPSubstrateConfig, run_dir: str, deps: dict,
                        progress: bool = False):
    """``theta_P``: :func:`make_mlp` trained on task A through the training loop."""
    tasks = load_tasks(cfg.split_seed)
    model = make_mlp(cfg)
    train(model, _source(tasks["A", "train"], cfg.train.batch_size, cfg.train.seed), cfg.train,
          run_dir=run_dir, loss_fn=classifier_loss_fn, config=cfg, progress=progress,
          desc="pretrain MNIST")
    p = model.params()
    return model, {"val_accuracy": accuracy_fn(tasks["A", "validation"])(p),
                   "test_accuracy": accuracy_fn(tasks["A", "test"])(p),
                   "train_examples": int(tasks["A", "train"][1].shape[0])}
