"""The evaluators every study uses.

* :class:`LMEvaluator`: language-model loss (nats/token), next-token accuracy and bits per
  byte on fixed held-out batches; XLA's compiled memory analysis of the evaluation step (the
  inference peak). One compilation per model structure and batch shape (and per layout of
  the model's arrays over several devices: arrays on one device share one layout).
* :class:`ClassifierEvaluator`: loss, accuracy and Matthews correlation (multi-class MCC) of a
  classifier over every row of a split, in fixed-shape batches (one compilation).
* :class:`SparsityEvaluator`: validation cross-entropy / perplexity of a sparsely activated
  LM plus the streaming activation-sparsity metrics of :mod:`moejax.ops.sparsity_metrics`
  (TLS, CLS_L, reuse, per-token allocation), mean over layers and per layer.
* :func:`matthews_corrcoef`: the multi-class MCC (Gorodkin 2004) from labels.

The evaluators of generated responses and of MoE routers live in
:mod:`moejax.evaluate_generation`.

The evaluators take an ``nnx.Module`` or, for functional code, a params pytree after
``bind(graphdef, rest)``. An evaluation that runs long (a full preset's held-out split on a
slow device) shows a bar of its batches (:func:`moejax.extras.late_progress`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import check_count, is_real
from moejax.extras import late_progress
from moejax.ops.distill_losses import forward_kl
from moejax.ops.losses import accuracy, cross_entropy
from moejax.ops.sparsity_metrics import CHUNK_LENS, SparsityAccumulator
from moejax.train.budget import check_program_fits
from moejax.train.loop import compiled_memory
from moejax.train.step import lm_loss_fn, lm_model_kwargs, make_eval_step

__all__ = ["LMEvaluator", "ClassifierEvaluator", "SparsityEvaluator", "matthews_corrcoef",
           "classifier_loss_fn", "router_active_sets", "classifier_kd_loss_fn",
           "classifier_logits", "outputs_on", "scored_tokens", "token_mean"]


def classifier_loss_fn(model, batch, key=None, train: bool = True):
    """Cross-entropy of ``model(inputs[, mask_BT])`` logits on ``batch["labels"]`` plus the
    model's ``aux_loss``; metrics ``ce``, ``aux_loss``, ``accuracy``."""
    kw = {"mask_BT": batch["mask"] > 0} if "mask" in batch else {}
    logits, aux = model(batch["inputs"], train=train, key=key, **kw)
    ce = cross_entropy(logits, batch["labels"])
    aux_loss = jnp.asarray(aux.get("aux_loss", 0.0), jnp.float32)
    return ce + aux_loss, {"ce": ce, "aux_loss": aux_loss,
                           "accuracy": accuracy(logits, batch["labels"])}


def classifier_kd_loss_fn(*, alpha: float = 0.5, temperature: float = 1.0) -> Callable:
    """Knowledge distillation of a classifier from a teacher's logits stored in the batch
    (``batch["teacher_logits"]``, e.g. an :class:`~moejax.data.batches.ArrayBatches` column):
    ``alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, labels)`` plus
    the model's ``aux_loss`` (Hinton et al. 2015). Metrics ``kd``, ``ce``, ``accuracy``."""
    if not 0.0 <= alpha <= 1.0 or temperature <= 0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] and temperature={temperature} > 0")

    def loss_fn(model, batch, key=None, train: bool = True):
        kw = {"mask_BT": batch["mask"] > 0} if "mask" in batch else {}
        logits, aux = model(batch["inputs"], train=train, key=key, **kw)
        t = temperature
        ones = jnp.ones(logits.shape[:1], jnp.float32)
        kd = forward_kl(batch["teacher_logits"] / t, logits / t, ones) * t * t
        ce = cross_entropy(logits, batch["labels"])
        aux_loss = jnp.asarray(aux.get("aux_loss", 0.0), jnp.float32)
        return alpha * kd + (1.0 - alpha) * ce + aux_loss, {
            "kd": kd, "ce": ce, "accuracy": accuracy(logits, batch["labels"])}

    return loss_fn


def outputs_on(graphdef, rest, inputs, mask=None) -> Callable:
    """``params -> logits`` of ``nnx.merge(graphdef, params, rest)`` on ONE fixed batch
    (``mask``: real tokens), jitted: the last-layer outputs that DAREx's q_e search and the
    output-change curves compare."""
    inputs = jnp.asarray(inputs)
    kw = {} if mask is None else {"mask_BT": jnp.asarray(mask) > 0}

    @jax.jit
    def fn(params):
        return nnx.merge(graphdef, params, rest)(inputs, train=False, **kw)[0]

    return fn


def classifier_logits(model, inputs, mask=None, *, batch_size: int = 256) -> np.ndarray:
    """``model``'s logits ``[N, L]`` for every row of ``inputs`` (``mask``: real tokens), in
    fixed-size batches (one compilation; the last batch is padded and cut)."""
    check_count("classifier_logits: batch_size", batch_size, 1)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fn(state, x, m):
        kw = {} if m is None else {"mask_BT": m > 0}
        return nnx.merge(graphdef, state)(x, **kw)[0]

    n, out = len(inputs), []
    for s in range(0, n, batch_size):
        idx = np.arange(s, s + batch_size) % n
        m = None if mask is None else jnp.asarray(mask[idx])
        out.append(np.asarray(fn(state, jnp.asarray(inputs[idx]), m))[: n - s])
    return np.concatenate(out)


def _bar(batches):
    """``batches`` counted by the bar of an evaluation that runs long."""
    return late_progress(batches, desc="evaluating", unit="batch")


class _Bound:
    """``evaluator.bind(graphdef, rest)``: the evaluator as a function of params only."""

    def __init__(self, evaluator, graphdef, rest):
        self.evaluator, self.graphdef, self.rest = evaluator, graphdef, rest

    def __call__(self, params) -> dict:
        return self.evaluator._evaluate(self.graphdef, *_on_one_device(params, self.rest))


class Evaluator:
    def bind(self, graphdef, rest) -> _Bound:
        return _Bound(self, graphdef, rest)

    def __call__(self, model: nnx.Module, step: int | None = None) -> dict:
        """Metrics of ``model`` (``step`` is accepted so this can be a loop ``eval_fn``)."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return self._evaluate(graphdef, *_on_one_device(params, rest))


def _on_one_device(*trees) -> tuple:
    """``trees`` with their arrays committed to their device where all of them live on one
    and the same device, else as they are. A program is compiled for where its arrays are:
    a model's arrays that a training loop placed on a one-device mesh and those made outside
    it (a fresh model, experts added after training) would each compile the evaluation again
    though they sit on the same device. Nothing is copied."""
    arrays = [x for x in jax.tree.leaves(trees) if isinstance(x, jax.Array)]
    devices = {d for x in arrays for d in x.sharding.device_set}
    if len(devices) != 1:
        return trees
    one = jax.sharding.make_single_device_sharding(devices.pop())
    return jax.tree.map(lambda x: jax.device_put(x, one) if isinstance(x, jax.Array) else x,
                        trees)


class LMEvaluator(Evaluator):
    """Mean ``loss`` (cross-entropy, nats/token), ``accuracy`` and ``bpb`` (bits per byte) over
    the scored tokens (``mask`` > 0, else every target) of fixed batches.
    ``bytes_per_token``: UTF-8 bytes per token of the corpus (1 for byte-level tokens);
    ``bpb = loss / ln 2 / bytes_per_token``."""

    def __init__(self, batches: Sequence[dict], *, bytes_per_token: float = 1.0,
                 loss_fn: Callable = lm_loss_fn):
        if not batches:
            raise ValueError("LMEvaluator needs at least one batch")
        if not (is_real(bytes_per_token)
                and math.isfinite(bytes_per_token) and bytes_per_token > 0):
            raise ValueError(f"LMEvaluator: bytes_per_token={bytes_per_token!r}; give the "
                             "corpus's UTF-8 bytes per token, a finite number > 0 (1 for bytes)")
        self.batches, self.bytes_per_token, self.loss_fn = list(batches), bytes_per_token, loss_fn
        self._scored = scored_tokens(self.batches)
        self._fns: dict = {}

    @classmethod
    def from_source(cls, source, n_batches: int, **kw) -> LMEvaluator:
        """The first ``n_batches`` batches of a batch source (a held-out split)."""
        return cls([source.batch(i) for i in range(n_batches)], **kw)

    def _compiled(self, where: tuple, params, rest, batch: dict):
        """The evaluation step compiled for this model and where its arrays live (``where``:
        :meth:`_where`; a model trained on a mesh is evaluated on that mesh: a step compiled
        for one layout refuses arrays of another) and for ``batch``'s shapes (a held-out
        split's last, smaller batch gets its own compilation)."""
        graphdef = where[0]
        key = (*where, _shapes(batch))
        fn = self._fns.get(key)
        if fn is None:
            step = make_eval_step(graphdef, self.loss_fn)
            fn = step.lower(params, rest, batch, jax.random.key(0)).compile()
            b = np.shape(batch["inputs"])
            check_program_fits(  # before it first runs: an evaluation can be the first program
                compiled_memory(fn)["peak_bytes"], jax.devices()[0],
                f"the evaluation of batches of {' x '.join(map(str, b))} tokens",
                "evaluate smaller batches (the run's batch_size or sequence length), or run "
                "on a machine with more memory")
            self._fns[key] = fn
        return fn

    @staticmethod
    def _where(graphdef, params, rest) -> tuple:
        """The model's structure and its arrays' layout: read once per evaluation."""
        return graphdef, _layout(params), _layout(rest)

    def _evaluate(self, graphdef, params, rest) -> dict:
        key = jax.random.key(0)  # evaluation is deterministic (train=False draws nothing)
        where, outs = self._where(graphdef, params, rest), []
        for b in _bar(self.batches):
            outs.append(self._compiled(where, params, rest, b)(params, rest, b, key))
            if len(outs) > 1:  # the bar counts finished batches; the next one is queued
                jax.block_until_ready(outs[-2])
        ms = jax.device_get(outs)
        loss = token_mean([m["ce"] for m in ms], self._scored)
        return {"loss": loss, "accuracy": token_mean([m["accuracy"] for m in ms], self._scored),
                "bpb": loss / math.log(2) / self.bytes_per_token}

    def memory(self, model: nnx.Module) -> dict:
        """``{"peak_bytes", "argument_bytes"}`` of the compiled evaluation step (one batch; of
        the batch shape with the largest peak where the batches differ in shape)."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = _on_one_device(params, rest)
        where, shapes = self._where(graphdef, params, rest), {_shapes(b): b for b in self.batches}
        return max((compiled_memory(self._compiled(where, params, rest, b))
                    for b in shapes.values()), key=lambda m: m["peak_bytes"])


def scored_tokens(batches: Sequence[dict]) -> np.ndarray:
    """How many tokens each batch scores: its ``mask`` > 0, else every target."""
    return np.asarray([float(np.sum(np.asarray(b["mask"]) > 0)) if "mask" in b
                       else float(np.size(b["targets"])) for b in batches])


def token_mean(batch_means: Sequence[float], scored: np.ndarray) -> float:
    """The mean over every scored token from each batch's mean and its scored-token count
    (:func:`scored_tokens`), not the mean of the batch means."""
    return float(np.dot(np.asarray(batch_means, np.float64), scored) / max(scored.sum(), 1.0))


def _shapes(batch: dict) -> tuple:
    """A batch's array shapes and dtypes by key, hashable."""
    return tuple((k, np.shape(v), str(np.asarray(v).dtype if not hasattr(v, "dtype")
                                      else v.dtype)) for k, v in sorted(batch.items()))


def _layout(tree) -> tuple:
    """The shardings of a tree's arrays (``None`` for host arrays), hashable."""
    return tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(tree))


def matthews_corrcoef(y_true, y_pred, n_classes: int | None = None) -> float:
    """Multi-class Matthews correlation from the confusion matrix ``C``:
    ``(c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2)(s^2 - sum_k t_k^2))`` with ``c`` the
    correct count, ``s`` the total, ``t_k``/``p_k`` true/predicted counts of class ``k``;
    0 when a denominator factor is 0 (one class only). Binary: the usual MCC."""
    y_true, y_pred = _class_ids("y_true", y_true), _class_ids("y_pred", y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"matthews_corrcoef: y_true of shape {y_true.shape} and y_pred of shape "
                         f"{y_pred.shape}; give one prediction per label")
    k = int(n_classes or max(y_true.max(initial=0), y_pred.max(initial=0)) + 1)
    if max(y_true.max(initial=0), y_pred.max(initial=0)) >= k:
        raise ValueError(f"matthews_corrcoef: a class id of {max(y_true.max(), y_pred.max())} "
                         f"for n_classes={n_classes}")
    conf = np.zeros((k, k), np.float64)
    np.add.at(conf, (y_true, y_pred), 1.0)
    t, p = conf.sum(1), conf.sum(0)
    c, s = np.trace(conf), conf.sum()
    den = math.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - p @ t) / den) if den > 0 else 0.0


def _class_ids(name: str, y) -> np.ndarray:
    """``y`` as a 1-D int64 array of class ids, refused where it is not one (a float label
    would be truncated, a negative one counted as the last class, ``[N, 1]`` broadcast)."""
    y = np.asarray(y)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.dtype == bool):
        raise ValueError(f"{name} of shape {y.shape} and dtype {y.dtype}; give a 1-D array of "
                         "integer class ids")
    if y.size and y.min() < 0:
        raise ValueError(f"{name} holds the negative class id {y.min()}")
    return y.astype(np.int64)


@jax.jit
def _batch_stats(logits, labels, valid):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[:, None], 1)[:, 0]
    return jnp.sum(nll * valid), jnp.argmax(logp, -1)


class ClassifierEvaluator(Evaluator):
    """``loss``, ``accuracy`` and ``mcc`` over every row of ``inputs``/``labels`` (``mask``:
    token mask of text inputs). Batches of ``batch_size`` rows; the last one is padded by
    repeating its last row and the padding ignored, so there is one compilation."""

    def __init__(self, inputs, labels, mask=None, *, batch_size: int = 1024,
                 n_classes: int | None = None):
        self.inputs, self.labels = np.asarray(inputs), _class_ids("labels", labels)
        self.mask = None if mask is None else np.asarray(mask)
        if len(self.inputs) != len(self.labels) or not len(self.labels):
            raise ValueError(f"ClassifierEvaluator: {len(self.inputs)} rows of inputs for "
                             f"{len(self.labels)} labels; give one label per row")
        if self.mask is not None and self.mask.shape != self.inputs.shape:
            raise ValueError(f"ClassifierEvaluator: a mask of shape {self.mask.shape} for inputs "
                             f"of shape {self.inputs.shape}; give one entry per token")
        if n_classes is not None and self.labels.max() >= n_classes:
            raise ValueError(f"ClassifierEvaluator: a label of {self.labels.max()} for "
                             f"n_classes={n_classes}")
        check_count("ClassifierEvaluator: batch_size", batch_size, 1)
        self.n_classes, self.batch_size = n_classes, min(batch_size, len(self.labels))
        self._fns: dict = {}

    def _fn(self, graphdef):
        """Jitted batch statistics; ``graphdef`` may also be a plain ``apply(params, inputs)``
        function (a functional model, see :meth:`bind_fn`)."""
        fn = self._fns.get(graphdef)
        if fn is None:
            @jax.jit
            def fn(params, rest, inputs, mask, labels, valid):
                if callable(graphdef) and not isinstance(graphdef, nnx.GraphDef):
                    logits = graphdef(params, inputs)
                else:
                    kw = {} if mask is None else {"mask_BT": mask > 0}
                    logits, _ = nnx.merge(graphdef, params, rest)(inputs, train=False, **kw)
                return _batch_stats(logits, labels, valid)

            self._fns[graphdef] = fn
        return fn

    def bind_fn(self, apply_fn: Callable) -> _Bound:
        """The evaluator as a function of params for a functional model
        ``apply_fn(params, inputs) -> logits``."""
        return _Bound(self, apply_fn, None)

    def _evaluate(self, graphdef, params, rest) -> dict:
        fn, n, bs = self._fn(graphdef), len(self.labels), self.batch_size
        nll, preds = 0.0, []
        for s in _bar(range(0, n, bs)):
            idx = np.minimum(np.arange(s, s + bs), n - 1)
            valid = (np.arange(s, s + bs) < n).astype(np.float32)
            m = None if self.mask is None else self.mask[idx]
            total, pred = fn(params, rest, self.inputs[idx], m, self.labels[idx], valid)
            nll += float(total)
            preds.append(np.asarray(pred)[: n - s])
        pred = np.concatenate(preds)
        return {"loss": nll / n, "accuracy": float((pred == self.labels).mean()),
                "mcc": matthews_corrcoef(self.labels, pred, self.n_classes)}


def router_active_sets(layer_aux: dict, n_experts: int = 0, n_always_on: int = 0):
    """``(active_BTE bool or None, a_BTE or None)`` of one FFN layer's aux: ReLU-routed layers
    report ``active_BTE`` (and activations ``a_BTE``); top-k layers report ``expert_ids``
    ``[B, T, K]`` over ``n_experts`` routed experts, to which ``n_always_on`` shared experts
    are prepended as always active; a dense FFN reports neither (``(None, None)``)."""
    if "active_BTE" in layer_aux:
        return layer_aux["active_BTE"], layer_aux.get("a_BTE")
    if "expert_ids" in layer_aux:
        if n_experts < 1:
            raise ValueError(
                f"a top-k layer's expert ids need its expert count (n_experts={n_experts}); "
                "pass active_fn=functools.partial(router_active_sets, n_experts=E, "
                "n_always_on=S) to SparsityEvaluator")
        ids_BTK = layer_aux["expert_ids"]
        routed_BTE = jax.nn.one_hot(ids_BTK, n_experts, dtype=jnp.int32).sum(-2) > 0
        if n_always_on:
            on_BTE = jnp.ones(routed_BTE.shape[:2] + (n_always_on,), bool)
            routed_BTE = jnp.concatenate([on_BTE, routed_BTE], -1)
        return routed_BTE, None
    return None, None


class SparsityEvaluator(Evaluator):
    """``val_ce`` / ``val_ppl`` over fixed LM batches and the activation-sparsity metrics of
    every routed layer (:class:`~moejax.ops.sparsity_metrics.SparsityAccumulator`): mean over
    layers at the top level, per layer under ``"layers"``, and the per-token-id expert
    ``"allocation"``. ``active_fn(layer_aux) -> (active_BTE, a_BTE)`` reads a layer's aux
    (default :func:`router_active_sets`; pass a ``functools.partial`` of it for top-k layers)."""

    def __init__(self, batches: Sequence[dict], *, chunk_lens=CHUNK_LENS,
                 active_fn: Callable = router_active_sets):
        if not batches:
            raise ValueError("SparsityEvaluator needs at least one batch")
        SparsityAccumulator(chunk_lens)  # its chunk lengths checked before any evaluation
        self.batches, self.chunk_lens, self.active_fn = list(batches), chunk_lens, active_fn
        self._fns: dict = {}

    def _fn(self, graphdef):
        fn = self._fns.get(graphdef)
        if fn is None:
            active_fn = self.active_fn

            @jax.jit
            def fn(params, rest, batch):
                m = nnx.merge(graphdef, params, rest)
                logits, aux = m(batch["inputs"], train=False, **lm_model_kwargs(batch))
                ce = cross_entropy(logits, batch["targets"], batch["mask"])
                return ce, [active_fn(la) for la in aux["layers"]]

            self._fns[graphdef] = fn
        return fn

    def _evaluate(self, graphdef, params, rest) -> dict:
        fn = self._fn(graphdef)
        acc = SparsityAccumulator(self.chunk_lens)
        ces = []
        for b in _bar(self.batches):
            ce, layers = jax.device_get(fn(params, rest, b))
            ces.append(float(ce))
            for i, (act, a) in enumerate(layers):
                if act is not None:
                    acc.update(i, act, mask_BT=b["mask"] > 0, a_BTE=a, tokens_BT=b["inputs"])
        ce = token_mean(ces, scored_tokens(self.batches))
        out = {"val_ce": ce, "val_ppl": math.exp(ce)}
        res = acc.result()
        out.update(res["mean"])
        out["layers"] = res["layers"]
        out["allocation"] = acc.allocation()
        return out
