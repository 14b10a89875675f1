"""Controlled DAREx study (paper App. B analog): a 2-layer MLP with RMSNorm.

``f(x) = W_o N(relu(W_1 N(x) + b_1)) + b_o`` (N = RMSNorm with a learnable scale) is pre-trained
on MNIST-5k and fine-tuned on the sklearn 8x8 digits upsampled to 28x28 (same 10 classes, a
domain shift like the paper's CIFAR-10 -> SVHN) three ways: no
regularisation (Adam), AdamR-L2 and AdamR-L1 (decay anchored at the pre-trained weights). The
delta of the two weight matrices is then pruned with DARE, DAREx-q (q_v: validation accuracy;
q_e: last-layer output change on one batch), magnitude and WANDA at
p in {0.5, 0.7, 0.9, 0.95, 0.99}; the table reports test accuracy on the sklearn digits.

    python -m experiments.darex_controlled                  # quick (CPU, < 1 min)
    python -m experiments.darex_controlled preset=full      # wider MLP, longer training
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax import delta as dl
from moejax.config import Config, config
from moejax.delta import MethodName, PruneContext, delta_stats, matmul_input_stats, run_methods
from moejax.evaluate import ClassifierEvaluator
from moejax.experiment import main
from moejax.results import RunDir
from moejax.train import adam_linear_config, train_params

NAME = "darex_controlled"


@config
class ControlledConfig(Config):
    """MLP width, training lengths, AdamR strengths and the pruning grid."""

    d_hidden: int = 256
    pretrain_steps: int = 400
    finetune_steps: int = 300
    batch_size: int = 128
    lr: float = 1e-3
    l2_weight: float = 0.1  # AdamR-L2 lambda
    l1_weight: float = 0.001  # AdamR-L1 lambda
    ps: tuple[float, ...] = (0.5, 0.7, 0.9, 0.95, 0.99)
    methods: tuple[MethodName, ...] = ("DARE", "DAREx-q (q_v)", "DAREx-q (q_e)", "magnitude",
                                       "WANDA")
    q_num: int = 20
    seed: int = 0

    def validate(self):
        self._require(self.d_hidden > 0, f"d_hidden={self.d_hidden} must be > 0")
        self._require(all(0 <= p < 1 for p in self.ps), f"ps={self.ps} must lie in [0, 1)")


def make_config(preset: str) -> ControlledConfig:
    if preset == "quick":
        return ControlledConfig()
    return ControlledConfig(d_hidden=1024, pretrain_steps=3000, finetune_steps=2000)


# ------------------------------------------------------------------------------ data and model


def _upsample_digits(images_N88: np.ndarray) -> np.ndarray:
    """sklearn 8x8 digits (0..16) -> 28x28 in [0, 1]: 3x nearest upsampling + 2-pixel border."""
    x = np.kron(images_N88.astype(np.float32) / 16.0, np.ones((3, 3), np.float32))
    return np.pad(x, ((0, 0), (2, 2), (2, 2)))


def load_tasks(seed: int = 0) -> dict:
    """Task A = MNIST-5k (pre-training), task B = sklearn digits upsampled to 28x28
    (fine-tuning); each split 80/10/10 by a fixed permutation. Same 10 classes."""
    from moejax.data.builders_images import load_digits_arrays, load_mnist5k_arrays

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


def mlp(params: dict, x_BD: jax.Array) -> jax.Array:
    h = jax.nn.relu(_rms(x_BD, params["norm_in"]) @ params["w1"] + params["b1"])
    return _rms(h, params["norm_h"]) @ params["wo"] + params["bo"]


def xent(params, batch, key=None, train=True):
    x, y = batch
    logits = mlp(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def accuracy_of(data):
    """``params -> accuracy`` of the functional MLP on ``data = (x, y)``."""
    ev = ClassifierEvaluator(*data).bind_fn(mlp)
    return lambda params: ev(params)["accuracy"]


def batches(data, batch_size: int, seed: int):
    x, y = data
    n = x.shape[0]

    def at(i):
        idx = np.random.default_rng([seed, i]).integers(0, n, batch_size)
        return x[idx], y[idx]

    return at


def pretrain_and_finetune(cfg: ControlledConfig, tasks: dict, regs=("none", "l2", "l1")):
    """``(theta_P, {reg: theta_F})`` for the requested fine-tuning regularisers."""
    key = jax.random.key(cfg.seed)
    p0 = init_mlp(key, tasks["A", "train"][0].shape[1], cfg.d_hidden)
    tcfg = adam_linear_config(cfg.pretrain_steps, cfg.lr, batch_size=cfg.batch_size, warmup=20,
                              seed=cfg.seed)
    pre, _ = train_params(p0, batches(tasks["A", "train"], cfg.batch_size, cfg.seed), tcfg, xent,
                          desc="pretrain MNIST")
    opts = {"none": ("adam", 0.0), "l2": ("adamr_l2", cfg.l2_weight),
            "l1": ("adamr_l1", cfg.l1_weight)}
    tuned = {}
    for reg in regs:
        tuned[reg], _ = train_params(
            pre, batches(tasks["B", "train"], cfg.batch_size, cfg.seed + 1),
            adam_linear_config(cfg.finetune_steps, cfg.lr, batch_size=cfg.batch_size,
                               optimizer=opts[reg][0], weight=opts[reg][1], warmup=20,
                               seed=cfg.seed), xent,
            desc=f"finetune digits ({reg})")
    return pre, tuned


REG_NAMES = {"none": "no reg (Adam)", "l2": "AdamR-L2", "l1": "AdamR-L1"}


def run(cfg: ControlledConfig, run: RunDir) -> dict:
    tasks = load_tasks(cfg.seed)
    pre, tuned = pretrain_and_finetune(cfg, tasks)
    test_b, val_b = tasks["B", "test"], tasks["B", "validation"]
    calib_x = tasks["B", "train"][0][:256]
    acc_test, acc_val = accuracy_of(test_b), accuracy_of(val_b)
    acc_test_a = accuracy_of(tasks["A", "test"])
    rows, base_rows = [], []
    for reg, fin in tuned.items():
        D = dl.delta(pre, fin)
        mask = dl.select_leaves(D, include=r"^(w1|wo)$")
        ctx = PruneContext(
            pretrained=pre, delta=D, mask=mask, key=jax.random.key(cfg.seed + 7),
            val_metric=acc_val,
            test_metric=acc_test,
            outputs_fn=lambda prm: mlp(prm, calib_x),
            x_stats=matmul_input_stats(lambda prm: mlp(prm, calib_x), fin), q_num=cfg.q_num)
        base_rows.append({"fine-tuning": REG_NAMES[reg], "test acc digits": acc_test(fin),
                          "pre-trained acc digits": acc_test(pre),
                          "pre-trained acc MNIST": acc_test_a(pre),
                          **delta_stats(D, mask)})
        for r in run_methods(ctx, cfg.methods, cfg.ps, desc=f"prune ({reg})"):
            rows.append({"fine-tuning": REG_NAMES[reg], **r})
    run.note(f"Pruned: the matrices w1 [784, {cfg.d_hidden}] and wo [{cfg.d_hidden}, 10]; biases "
             "and RMSNorm scales keep their full delta. q_v is chosen on the digits validation "
             f"split ({val_b[1].shape[0]} images); test = {test_b[1].shape[0]} images. "
             "DAREx-q uses the same drop mask as DARE (same key), only the rescaling differs.")
    run.table("finetuned", base_rows, title="Fine-tuned MLPs (unpruned), sklearn digits")
    # wide table: one row per (fine-tuning, method), one column per p
    wide = []
    for reg in tuned:
        for m in cfg.methods:
            row = {"fine-tuning": REG_NAMES[reg], "method": m}
            for r in rows:
                if r["fine-tuning"] == REG_NAMES[reg] and r["method"] == m:
                    row[f"p={r['p']}"] = r["metric"]
            wide.append(row)
    run.table("accuracy", wide, title="Test accuracy (sklearn digits) after delta pruning")
    run.table("detail", rows, title="Every (fine-tuning, method, p) with the chosen q")
    for reg in tuned:
        series = {m: (list(cfg.ps), [r["metric"] for r in rows
                                     if r["method"] == m and r["fine-tuning"] == REG_NAMES[reg]])
                  for m in cfg.methods}
        run.line_plot(f"acc_vs_p_{reg}", series, xlabel="drop rate p", ylabel="test accuracy",
                      title=f"MLP, fine-tuned with {REG_NAMES[reg]}", markers=True)
    pick = lambda reg, m, p: next(r["metric"] for r in rows if r["fine-tuning"] == REG_NAMES[reg]
                                  and r["method"] == m and r["p"] == p)
    p_hi = max(cfg.ps)
    out = {"unpruned_none": base_rows[0]["test acc digits"]}
    if "DARE" in cfg.methods:
        out.update({f"dare_{reg}_p{p_hi}": pick(reg, "DARE", p_hi) for reg in tuned})
    if "DAREx-q (q_v)" in cfg.methods:
        out[f"darex_qv_none_p{p_hi}"] = pick("none", "DAREx-q (q_v)", p_hi)
    out["headline"] = (
        f"MLP MNIST -> sklearn digits, unpruned {out['unpruned_none']:.3f}; at p={p_hi}: "
        + ", ".join(f"{k}={v:.3f}" for k, v in out.items() if k.startswith("dar")))
    return out


if __name__ == "__main__":
    raise SystemExit(main(NAME, make_config, run))
