"""Shared helpers for the training and checkpoint tests (not a test module): a tiny MoE-shaped
LM with a sub-module ``experts`` holding stacked ``[E, d, f]`` weights (with logical axis names;
the rest is flax's own layers, unnamed, as a user's model would be), and a toy batch
source."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.nn import axes as ax

V, D, F, E, T = 16, 8, 12, 4, 6


class Experts(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = D, e: int = E):
        init = nnx.initializers.normal(0.3)  # stacked expert weights, named for sharding
        self.w_up = ax.param(init(rngs.params(), (e, d, F)), ax.EXPERTS, ax.EMBED, ax.MLP)
        self.w_down = ax.param(init(rngs.params(), (e, F, d)), ax.EXPERTS, ax.MLP, ax.EMBED)
        self.bias = ax.param(jnp.zeros((e, d)), ax.EXPERTS, ax.EMBED)

    def __call__(self, x_BTD, gates_BTE):
        h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x_BTD, self.w_up[...]))
        y = jnp.einsum("btef,efd->bted", h, self.w_down[...]) + self.bias[...]
        return jnp.einsum("bted,bte->btd", y, gates_BTE.astype(y.dtype))


class TinyMoELM(nnx.Module):
    """``model(tokens_BT, train, key, mask_BT) -> (logits_BTV, aux)``; noise on the router
    in training mode uses ``key`` (so explicit keys matter for reproducibility)."""

    def __init__(self, rngs: nnx.Rngs, noise: float = 0.1, d: int = D, n_experts: int = E):
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.router = nnx.Linear(d, n_experts, rngs=rngs)
        self.experts = Experts(rngs, d, n_experts)
        self.head = nnx.Linear(d, V, rngs=rngs)
        self.noise = noise

    def __call__(self, tokens_BT, train=False, key=None, mask_BT=None):
        x = self.norm(self.embed(tokens_BT))
        logits_e = self.router(x).astype(jnp.float32)
        if train and self.noise and key is not None:
            logits_e = logits_e + self.noise * jax.random.normal(key, logits_e.shape)
        gates = jax.nn.softmax(logits_e, axis=-1)
        x = x + self.experts(x, gates)
        aux = {"aux_loss": 0.01 * jnp.mean(jnp.sum(gates**2, -1)), "gate_max": jnp.max(gates)}
        return self.head(x), aux


class ToySource:
    """Random-access batches of random tokens (deterministic per position)."""

    def __init__(self, batch_size: int = 8, seq_len: int = T, seed: int = 0):
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def batch(self, position: int):
        rng = np.random.default_rng([self.seed, position])
        toks = rng.integers(0, V, size=(self.batch_size, self.seq_len + 1)).astype(np.int32)
        return {
            "inputs": toks[:, :-1],
            "targets": toks[:, 1:],
            "mask": np.ones((self.batch_size, self.seq_len), np.float32),
        }


def tree_max_diff(a, b) -> float:
    """Largest absolute leaf difference between two trees of the same structure."""
    f32 = lambda x: np.asarray(jax.device_get(x), np.float32)
    d = jax.tree.map(lambda x, y: float(np.max(np.abs(f32(x) - f32(y)), initial=0.0)), a, b)
    return max(jax.tree.leaves(d) + [0.0])


def tree_equal(a, b) -> bool:
    """Bitwise equality of all leaves (and equal leaf counts)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def jitted(module: nnx.Module, **static):
    """``module``'s call compiled whole, one XLA program per input shape: called eagerly, every
    op compiles on its own (about 15 ms each on a CPU, most of a small test's time).
    ``static``: keyword arguments that are Python values (``train=True``), fixed here."""
    call = nnx.jit(lambda m, *args, **kw: m(*args, **kw, **static))
    return lambda *args, **kw: call(module, *args, **kw)


@nnx.jit
def logits_of(model: nnx.Module, x):
    """``model(x)[0]`` (a model's logits) compiled whole, one XLA program per model structure and
    input shape, for tests that compare several models' outputs."""
    return model(x)[0]


# a plain-pytree model for the loop: a linear regression from zero parameters (LIN_P0)
def lin_batch(position: int) -> dict:
    """Batch ``position`` of a noiseless 5-feature linear regression (8 rows): its target is
    ``x @ [0, 1, 2, 3, 4]``."""
    rng = np.random.default_rng([3, position])
    x = rng.normal(size=(8, 5)).astype(np.float32)
    return {"x": x, "y": (x @ np.arange(5, dtype=np.float32)).astype(np.float32)}


def lin_mse(params, batch, key, train=True):
    """The squared error of :data:`LIN_P0`-shaped parameters on a :func:`lin_batch`, in the
    training loop's ``loss_fn`` form."""
    pred = batch["x"] @ params["w"] + params["b"]
    loss = jnp.mean((pred - batch["y"]) ** 2)
    return loss, {"mse": loss}


# numpy, not jax: importing this module starts no XLA backend (a multi-process test's script
# imports it before jax.distributed.initialize)
LIN_P0 = {"w": np.zeros((5,), np.float32), "b": np.zeros((), np.float32)}
