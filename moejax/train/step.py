"""The jitted training step: forward/backward, gradient accumulation, mixed precision, update.

* :class:`TrainState` -- ``(step, params, opt_state, key, rest)``: ``params`` is the nnx State of
  the model's ``nnx.Param`` leaves (fp32 master copy), ``key`` the run's PRNG key as
  ``jax.random.key_data`` (uint32), ``rest`` every non-``Param`` variable of the model (fixed
  buffers such as DeRS index vectors; carried through the step unchanged unless the model
  replaces them: inside the traced step assign a fresh variable, ``self.v = MyVar(new)``,
  since in-place ``self.v[...] = new`` raises flax's TraceContextError there).
* ``loss_fn(model, batch, key) -> (loss, metrics)`` (or just ``loss``): scalar loss and a
  flat dict of scalar metrics, called in training mode; evaluation calls it with
  ``train=False``. :func:`lm_loss_fn` is the language-model one. With plain pytree params
  (``graphdef=None``) the first argument is the params pytree itself.
* :func:`make_train_step` -> jitted ``step(state, batch) -> (state, metrics)``.

Gradient accumulation (``cfg.grad_accum = A``): the global batch of ``B`` rows is split into
``A`` micro-batches of ``B / A`` rows (micro-batch ``i`` = rows ``i, i + A, i + 2A, ...`` so
that a batch sharded over devices keeps every micro-batch spread over all devices) and
``lax.scan`` sums their gradients; loss, metrics and gradients are the mean over
micro-batches. This equals the big-batch step whenever ``loss_fn`` is a mean over an equal
number of real tokens per micro-batch (always true with an all-ones mask).

Mixed precision (``cfg.precision = "bfloat16"``): floating params are cast to bf16 inside the
differentiated function, so the forward/backward run in bf16 while the gradients (w.r.t. the
fp32 master params), the optimizer state and the update stay fp32. A model that casts to its
own compute dtype (e.g. ``DecoderConfig.dtype``) follows that dtype; set it to ``"bfloat16"``
as well so activations are bf16 too.

Several updates per batch: a loss that declares ``updates_per_batch = M > 1`` (and a
``prepare(model, batch, key) -> batch`` run once per step before them, e.g. sampling the
responses the updates share) takes ``M`` optimizer updates on one batch per step, each with
its own key (the Knowledge Augmentation of "Every Expert Matters", Algorithm 1); the metrics
are the mean over the updates. Pass the optimizer a schedule of the step, not of the update
(:func:`per_step_schedule`).

Non-finite guard: metrics carry ``finite`` (loss and gradient norm finite). When it is false
the step returns the *input* state unchanged (no corrupt update is ever applied); the loop then
raises :class:`NonFiniteError` via :func:`check_finite`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import moejax.train.mesh as mesh_lib
from moejax.ops.losses import accuracy, cross_entropy
from moejax.train.hparams import TrainConfig

__all__ = [
    "params_loss",
    "lm_model_kwargs",
    "TrainState",
    "NonFiniteError",
    "init_train_state",
    "init_state",
    "make_train_step",
    "make_eval_step",
    "lm_loss_fn",
    "check_finite",
    "cast_floating",
    "tree_all_finite",
    "as_loss_and_metrics",
    "check_loss_fn",
    "updates_per_batch",
    "per_step_schedule",
]


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # nnx.State of nnx.Param leaves (fp32 master copy)
    opt_state: Any  # optax state mirroring params
    key: jax.Array  # uint32 PRNG key data (jax.random.key_data)
    rest: Any = None  # non-Param model variables (nnx.State)


class NonFiniteError(FloatingPointError):
    """Raised by the loop when a step produced a non-finite loss or gradient norm."""


LossFn = Callable[..., tuple[jax.Array, dict]]


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, seed: int = 0):
    """Split ``model`` and build the initial state. Returns ``(graphdef, TrainState)``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, init_state(params, rest, tx, seed)


def init_state(params, rest, tx: optax.GradientTransformation, seed: int = 0) -> TrainState:
    """Step 0 of any params pytree (``rest``: non-trainable variables or None)."""
    key = jax.random.key_data(jax.random.key(seed))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), key, rest)


def cast_floating(tree, dtype):
    """Cast the floating leaves of ``tree`` to ``dtype`` (others unchanged)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def params_loss(graphdef, rest, loss_fn: Callable) -> Callable:
    """A model loss ``loss_fn(model, batch, key, train)`` as a loss of the parameters only,
    ``(params, batch, key=None, train=True)``, for :func:`moejax.train.train_params` (the
    model is ``nnx.merge(graphdef, params, rest)``)."""

    def loss(params, batch, key=None, train: bool = True):
        return loss_fn(nnx.merge(graphdef, params, rest), batch, key, train=train)

    return loss


def lm_model_kwargs(batch) -> dict:
    """What an LM batch shows the model besides its ``inputs`` (:func:`lm_loss_fn`'s rule):
    ``mask_BT`` (the real tokens: ``segment_ids > 0``, else ``token_mask > 0``, else None),
    ``segment_ids_BT`` and ``positions_BT`` where the batch has them; never the loss
    ``mask``."""
    seg, real = batch.get("segment_ids"), batch.get("token_mask")
    kw = {"mask_BT": None if real is None else real > 0}
    if seg is not None:
        kw.update(mask_BT=seg > 0, segment_ids_BT=seg)
    if batch.get("positions") is not None:
        kw["positions_BT"] = batch["positions"]
    return kw


def lm_loss_fn(model, batch, key, train: bool = True):
    """Next-token cross-entropy on ``batch["targets"]`` (masked by ``batch["mask"]``) plus
    the model's ``aux["aux_loss"]``. Metrics: ``ce``, ``aux_loss``, ``accuracy`` and every
    other scalar float entry of ``aux`` (prefixed ``aux/``).

    ``batch["mask"]`` selects the positions the loss counts (e.g. only the response of a
    prompt/response row) and is never shown to the model: the model's ``mask_BT`` (the real
    tokens, keys of attention and the tokens MoE slots route) is ``segment_ids > 0`` for packed
    batches, else ``batch["token_mask"]`` when present, else None (every token real). Packed
    batches: ``batch["segment_ids"]`` / ``batch["positions"]``, when present, are passed as
    ``segment_ids_BT`` / ``positions_BT`` (attention stays within each document, RoPE restarts
    per document, slots see the document boundaries)."""
    missing = [k for k in ("inputs", "targets") if not hasattr(batch, "get") or k not in batch]
    if missing:
        found = sorted(batch) if hasattr(batch, "keys") else type(batch).__name__
        raise ValueError(
            f"lm_loss_fn (the default loss) needs batch keys 'inputs' and 'targets' ('mask', "
            f"'token_mask', 'segment_ids' and 'positions' optional); the batch has {found}. "
            "Fix: give the batches those keys, or pass your own loss_fn=")
    mask = batch.get("mask")
    logits, aux = model(batch["inputs"], train=train, key=key, **lm_model_kwargs(batch))
    ce = cross_entropy(logits, batch["targets"], mask)
    aux_loss = jnp.asarray(aux.get("aux_loss", 0.0), jnp.float32)
    metrics = {"ce": ce, "aux_loss": aux_loss, "accuracy": accuracy(logits, batch["targets"], mask)}
    for name, v in aux.items():
        if (
            name != "aux_loss"
            and hasattr(v, "ndim")
            and v.ndim == 0
            and jnp.issubdtype(v.dtype, jnp.floating)
        ):
            metrics[f"aux/{name}"] = v.astype(jnp.float32)
    return ce + aux_loss, metrics


def check_loss_fn(loss_fn) -> None:
    """Refuse, before anything runs, a loss that cannot be called as the step calls it:
    ``loss_fn(model_or_params, batch, key)``, naming the signature it has."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): its call will tell
        return
    try:
        sig.bind(None, None, None)
    except TypeError:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise TypeError(f"loss_fn {name}{sig} cannot be called as loss_fn(model_or_params, "
                        "batch, key); add the key argument (and train=True, which evaluation "
                        "sets to False), even if unused") from None


def as_loss_and_metrics(out) -> tuple[jax.Array, dict]:
    """A loss function may return ``loss`` or ``(loss, metrics)``; normalise to the pair. A
    loss or metric that is not a scalar is refused naming it, while the step is traced (before
    any step runs), not when its row is logged."""
    loss, metrics = (out[0], dict(out[1] or {})) if isinstance(out, tuple) else (out, {})
    shapes = {k: jnp.shape(v) for k, v in {**metrics, "loss": loss}.items()}
    bad = {k: shape for k, shape in shapes.items() if shape != ()}
    if bad:
        raise ValueError(
            f"loss_fn returned {', '.join(f'{k} of shape {s}' for k, s in bad.items())}: the "
            "loss and each metric must be one number per step. Fix: reduce them (jnp.mean, "
            "jnp.sum) inside loss_fn")
    return loss, metrics


def _loss_and_grad(graphdef, loss_fn, compute_dtype):
    """``value_and_grad`` of the objective. ``graphdef=None``: ``params`` is a plain pytree and
    ``loss_fn(params, batch, key)``; otherwise ``loss_fn(nnx.merge(graphdef, params, rest),
    batch, key)`` and the model's non-Param variables come back as the new ``rest``."""

    def objective(params, rest, batch, key):
        p = params if compute_dtype is None else cast_floating(params, compute_dtype)
        if graphdef is None:
            loss, metrics = as_loss_and_metrics(loss_fn(p, batch, key))
            new_rest = rest
        else:
            # new Variables, owned by this trace: a model may update its own state in the
            # loss (nnx.Dropout's Rngs count, nnx.BatchNorm's statistics)
            model = nnx.merge(graphdef, p, rest, copy=True)
            loss, metrics = as_loss_and_metrics(loss_fn(model, batch, key))
            _, _, new_rest = nnx.split(model, nnx.Param, ...)
            new_rest = jax.tree.map(lambda n, o: n.astype(o.dtype), new_rest, rest)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items() if k != "loss"}
        return jnp.asarray(loss, jnp.float32), (metrics, new_rest)

    return jax.value_and_grad(objective, has_aux=True)


def _split_micro(batch, n):
    def split(x):
        if x.shape[0] % n:
            raise ValueError(
                f"batch dim {x.shape[0]} is not divisible by grad_accum={n}; choose "
                "batch_size as a multiple of grad_accum"
            )
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def injected_lr(opt_state):
    """The ``learning_rate`` an ``optax.inject_hyperparams`` state holds after an update (the
    one that update used), if there is exactly one."""
    found = []

    def visit(x):
        hp = getattr(x, "hyperparams", None)
        if isinstance(hp, dict) and "learning_rate" in hp:
            found.append(hp["learning_rate"])
        return x

    jax.tree.map(visit, opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    return found[0] if len(found) == 1 else None


def updates_per_batch(loss_fn) -> int:
    """How many optimizer updates ``loss_fn`` takes on each batch (its ``updates_per_batch``
    attribute; 1 without one)."""
    m = getattr(loss_fn, "updates_per_batch", 1)
    if int(m) != m or m < 1:
        raise ValueError(f"{type(loss_fn).__name__}.updates_per_batch={m} must be an int >= 1")
    return int(m)


def per_step_schedule(schedule, updates: int):
    """``schedule`` of the loop's step for an optimizer that counts ``updates`` updates per
    step: every update of step ``k`` gets ``schedule(k)``."""
    if updates == 1:
        return schedule
    return lambda count: schedule(count // updates)


def make_step_fn(
    graphdef, loss_fn: LossFn, tx, cfg: TrainConfig, schedule=None, batch_sharding=None
):
    """The un-jitted ``step(state, batch) -> (state, metrics)`` (see :func:`make_train_step`)."""
    compute_dtype = jnp.bfloat16 if cfg.precision == "bfloat16" else None
    grad_fn = _loss_and_grad(graphdef, loss_fn, compute_dtype)
    n_micro = cfg.grad_accum
    n_updates = updates_per_batch(loss_fn)
    prepare = getattr(loss_fn, "prepare", None)
    # the loss goes to the transform as optax's extra argument ``value`` (read by
    # optax.contrib.reduce_on_plateau and the like; ignored by the others)
    extra_args_tx = optax.with_extra_args_support(tx)

    def gradients(params, rest0, batch, step_key):
        if n_micro == 1:
            (loss, (metrics, rest)), grads = grad_fn(params, rest0, batch, step_key)
            return loss, metrics, rest, grads
        micro = _split_micro(batch, n_micro)
        first = jax.tree.map(lambda x: x[0], micro)
        out_shape = jax.eval_shape(grad_fn, params, rest0, first, step_key)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
        (l0, (m0, _)), g0 = zeros

        def body(carry, xs):
            g_sum, l_sum, m_sum, rest = carry
            mb, i = xs
            if batch_sharding is not None:
                mb = jax.lax.with_sharding_constraint(mb, batch_sharding)
            (loss_i, (m, rest)), g = grad_fn(params, rest, mb, jax.random.fold_in(step_key, i))
            add = lambda a, b: a + b
            return (
                jax.tree.map(add, g_sum, g),
                l_sum + loss_i,
                jax.tree.map(add, m_sum, m),
                rest,
            ), None

        (g, loss, metrics, rest), _ = jax.lax.scan(
            body, (g0, l0, m0, rest0), (micro, jnp.arange(n_micro))
        )
        inv = 1.0 / n_micro
        return (loss * inv, jax.tree.map(lambda x: x * inv, metrics), rest,
                jax.tree.map(lambda x: x * inv, g))

    def update(params, opt_state, rest, batch, key):
        loss, metrics, rest, grads = gradients(params, rest, batch, key)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = extra_args_tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state, rest, dict(
            metrics, loss=loss, grad_norm=grad_norm, finite=finite)

    def step(state: TrainState, batch):
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        params, opt_state, rest = state.params, state.opt_state, state.rest
        if n_updates == 1:
            params, opt_state, rest, out = update(params, opt_state, rest, batch, step_key)
        else:  # one batch (prepared once), n_updates updates, each with its own key
            if prepare is not None:
                prep_key, step_key = jax.random.split(step_key)
                model = params if graphdef is None else nnx.merge(graphdef, params, rest)
                batch = jax.lax.stop_gradient(prepare(model, batch, prep_key))
            # a loop, not n_updates copies of the update: the program (and its compile time)
            # stays the size of one update whatever the count
            def one(carry, m):
                *carry, o = update(*carry, batch, jax.random.fold_in(step_key, m))
                return tuple(carry), o

            (params, opt_state, rest), outs = jax.lax.scan(
                one, (params, opt_state, rest), jnp.arange(n_updates))
            out = {k: jnp.all(v) if k == "finite" else jnp.mean(v, axis=0)
                   for k, v in outs.items()}
        new = TrainState(state.step + 1, params, opt_state, jax.random.key_data(key), rest)
        new = jax.tree.map(lambda n, o: jnp.where(out["finite"], n, o), new, state)
        lr = schedule(state.step) if schedule is not None else injected_lr(opt_state)
        if lr is not None:
            out["lr"] = jnp.asarray(lr, jnp.float32)
        return new, out

    return step


def make_train_step(
    graphdef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    cfg: TrainConfig,
    *,
    schedule=None,
    mesh=None,
    donate: bool = False,
):
    """Jitted ``step(state, batch) -> (state, metrics)`` (``graphdef=None``: plain pytree
    params, see :func:`_loss_and_grad`).

    ``tx.update`` gets the step's loss as optax's extra argument ``value=`` (a transform that
    reads it, such as ``optax.contrib.reduce_on_plateau``, composes; others ignore it).
    Metrics: ``loss``, ``grad_norm`` (before clipping), ``finite``, ``lr`` (from ``schedule``,
    else from an ``optax.inject_hyperparams`` state) and the loss_fn's metrics. With ``mesh``
    the step is jitted with explicit in/out shardings from :mod:`moejax.train.mesh` (state:
    expert params over ``"expert"``, the rest replicated; batch: dim 0 over
    ``("data", "expert")``; a mesh of explicit axes runs with them automatic,
    :func:`moejax.train.mesh.loop_mesh`); the shardings are built from the first state passed
    in.
    ``donate=True`` donates the input state's buffers.
    """
    if mesh is None:
        fn = make_step_fn(graphdef, loss_fn, tx, cfg, schedule)
        return jax.jit(fn, donate_argnums=(0,) if donate else ())

    mesh = mesh_lib.loop_mesh(mesh)
    b_sh = mesh_lib.batch_sharding(mesh)
    fn = make_step_fn(graphdef, loss_fn, tx, cfg, schedule, batch_sharding=b_sh)
    cache: dict = {}

    def jitted_for(state):
        treedef = jax.tree.structure(state)
        if treedef not in cache:
            s_sh = mesh_lib.tree_shardings(state, mesh, cfg.fsdp)
            cache[treedef] = jax.jit(
                fn,
                in_shardings=(s_sh, b_sh),
                out_shardings=(s_sh, mesh_lib.replicated(mesh)),
                donate_argnums=(0,) if donate else (),
            )
        return cache[treedef]

    # the mesh is set while tracing so MoE layers see it (expert-parallel dispatch)
    def step(state, batch):
        with jax.set_mesh(mesh):
            return jitted_for(state)(state, batch)

    def lower(state, batch):
        with jax.set_mesh(mesh):
            return jitted_for(state).lower(state, batch)

    step.lower = lower
    step.jitted = jitted_for  # the jitted function for a state (call it under the mesh)
    return step


def make_eval_step(graphdef, loss_fn: LossFn, precision: str = "float32"):
    """Jitted ``eval_step(params, rest, batch, key) -> metrics`` (``train=False``)."""

    def ev(params, rest, batch, key):
        if precision == "bfloat16":
            params = cast_floating(params, jnp.bfloat16)
        model = params if graphdef is None else nnx.merge(graphdef, params, rest)
        loss, metrics = as_loss_and_metrics(loss_fn(model, batch, key, train=False))
        out = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        out["loss"] = jnp.asarray(loss, jnp.float32)
        return out

    return jax.jit(ev)


def check_finite(metrics: dict, step: int, data_position: int) -> None:
    """Raise :class:`NonFiniteError` when ``metrics["finite"]`` is false (host-side)."""
    if bool(metrics["finite"]):
        return
    loss, gnorm = float(metrics["loss"]), float(metrics["grad_norm"])
    what = []
    if not jnp.isfinite(loss):
        what.append(f"loss={loss}")
    if not jnp.isfinite(gnorm):
        what.append(f"grad_norm={gnorm}")
    raise NonFiniteError(
        f"non-finite {' and '.join(what) or 'values'} at step {step} (the update was NOT "
        f"applied and nothing was saved). Try: a lower lr, enabling grad_clip (e.g. "
        f"train.grad_clip=1.0), precision=float32, and check the batch at data position "
        f"{data_position} (source.batch({data_position}))."
    )


@jax.jit
def tree_all_finite(tree) -> jax.Array:
    """One fused reduction: True when every floating leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
