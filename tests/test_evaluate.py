"""The shared evaluators: MCC against the binary formula and its invariants, the classifier
evaluator against a direct computation (padding of the last batch ignored), bits per byte,
and the pytree counters."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax import extras
from moejax.evaluate import (
    ClassifierEvaluator,
    LMEvaluator,
    SparsityEvaluator,
    classifier_logits,
    classifier_loss_fn,
    matthews_corrcoef,
    outputs_on,
)
from moejax.extras import LATE_BAR_S
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.encoder import SequenceClassifier, bert_encoder_config
from moejax.nn.ffn import DenseFFNConfig
from moejax.pytree import count_bytes, count_params
from moejax.train import params_loss
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from tests.bars import Bars
from tests.toy_models import TinyMoELM, ToySource


def test_mcc_binary_formula_and_invariants():
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    tp = np.sum((y == 1) & (p == 1)); tn = np.sum((y == 0) & (p == 0))  # noqa: E702
    fp = np.sum((y == 0) & (p == 1)); fn = np.sum((y == 1) & (p == 0))  # noqa: E702
    want = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert abs(matthews_corrcoef(y, p) - want) < 1e-12
    y3 = rng.integers(0, 3, 100)
    assert matthews_corrcoef(y3, y3) == 1.0
    assert matthews_corrcoef(y3, np.zeros_like(y3)) == 0.0  # constant prediction
    perm = np.array([2, 0, 1])  # relabelling both sides leaves MCC unchanged
    q3 = rng.integers(0, 3, 100)
    assert abs(matthews_corrcoef(perm[y3], perm[q3]) - matthews_corrcoef(y3, q3)) < 1e-12


def test_classifier_evaluator_matches_direct_computation_with_padding():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(37, 5)).astype(np.float32)
    y = rng.integers(0, 4, 37)
    params = {"w": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)}
    apply = lambda p, inputs: inputs @ p["w"]  # noqa: E731
    got = ClassifierEvaluator(x, y, batch_size=16).bind_fn(apply)(params)
    logp = jax.nn.log_softmax(x @ np.asarray(params["w"]))
    np.testing.assert_allclose(got["loss"], -np.mean(logp[np.arange(37), y]), rtol=1e-5)
    pred = np.asarray(logp).argmax(-1)
    assert got["accuracy"] == np.mean(pred == y)
    assert got["mcc"] == matthews_corrcoef(y, pred, 4)
    for bad in (0, -1, 2.5):  # 0 failed at the evaluation in range(), 2.5 in numpy
        with pytest.raises(ValueError, match="batch_size"):
            ClassifierEvaluator(x, y, batch_size=bad)
        with pytest.raises(ValueError, match="batch_size"):
            classifier_logits(None, x, batch_size=bad)


def test_labels_and_predictions_that_are_not_one_class_id_a_row_are_refused():
    """One prediction broadcast over every label, or a negative label counted as the last
    class, gave a Matthews correlation of something else, silently; rows of inputs beyond the
    labels were left out of the evaluation."""
    y = np.array([0, 1, 2, 1])
    with pytest.raises(ValueError, match=r"y_true of shape \(4,\) and y_pred of shape \(1,\)"):
        matthews_corrcoef(y, np.array([1]))
    with pytest.raises(ValueError, match="y_true holds the negative class id -1"):
        matthews_corrcoef(np.array([0, 1, -1, 1]), y)
    with pytest.raises(ValueError, match="a class id of 2 for n_classes=2"):
        matthews_corrcoef(y, y, 2)
    x = np.zeros((4, 3), np.float32)
    for labels, match in ((y[:, None], r"labels of shape \(4, 1\)"),
                          (y.astype(np.float32), "dtype float32"),
                          (y[:3], "4 rows of inputs for 3 labels")):
        with pytest.raises(ValueError, match=match):
            ClassifierEvaluator(x, labels)
    with pytest.raises(ValueError, match=r"a mask of shape \(4, 1\) for inputs of shape "
                       r"\(4, 3\)"):
        ClassifierEvaluator(x.astype(np.int32), y, np.ones((4, 1)))
    with pytest.raises(ValueError, match="a label of 2 for n_classes=2"):
        ClassifierEvaluator(x, y, n_classes=2)
    assert matthews_corrcoef(y, y) == 1.0 and matthews_corrcoef(y > 0, y > 0) == 1.0


def test_lm_evaluator_bits_per_byte_and_counters():
    model = TinyMoELM(nnx.Rngs(0))
    ev = LMEvaluator.from_source(ToySource(batch_size=4), 2, bytes_per_token=2.0)
    out = ev(model)
    assert out["bpb"] == out["loss"] / math.log(2) / 2.0 and out["loss"] > 0
    mem = ev.memory(model)
    assert mem["peak_bytes"] >= mem["argument_bytes"] > 0
    params = nnx.state(model, nnx.Param)
    n = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    assert count_params(model) == count_params(params) == n
    assert count_bytes({"a": np.zeros((3, 2), np.float32), "b": np.zeros(5, np.int8)}) == 29


def test_a_model_trained_on_one_device_is_evaluated_by_the_step_compiled_before_training():
    """The training loop places the arrays on its one-device mesh; a fresh model's are
    uncommitted. Both sit on the same device: one compiled evaluation serves both, and a
    model only partly placed (new weights beside trained ones) too."""
    model = TinyMoELM(nnx.Rngs(0))
    ev = LMEvaluator.from_source(ToySource(batch_size=4), 2)
    before = ev(model)["loss"]
    train(model, ToySource(batch_size=4), TrainConfig(steps=1, batch_size=4, lr=1e-2))
    assert isinstance(model.head.kernel[...].sharding, jax.sharding.NamedSharding)
    assert ev(model)["loss"] != before  # trained
    model.head.kernel = nnx.Param(jnp.asarray(np.asarray(model.head.kernel[...])))
    ev(model)
    ev.bind(*nnx.split(model, nnx.Param, ...)[::2])(nnx.state(model, nnx.Param))
    assert len(ev._fns) == 1, list(ev._fns)


def test_outputs_on_and_params_loss_see_the_params_they_are_given():
    cfg = bert_encoder_config(vocab_size=11, d_model=8, n_layers=1, n_heads=2, d_hidden=16)
    model = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 11, (4, 6)))
    mask = jnp.asarray(np.arange(6)[None] < np.array([6, 3, 1, 4])[:, None])
    f = outputs_on(graphdef, rest, toks, mask)
    np.testing.assert_allclose(np.asarray(f(params)),
                               np.asarray(model(toks, mask_BT=mask)[0]), rtol=1e-6)
    zeroed = jax.tree.map(jnp.zeros_like, params)
    assert not np.allclose(np.asarray(f(zeroed)), np.asarray(f(params)))  # not a constant
    batch = {"inputs": toks, "labels": jnp.asarray([0, 1, 2, 1]), "mask": mask}
    loss, metrics = params_loss(graphdef, rest, classifier_loss_fn)(params, batch)
    ref, _ = classifier_loss_fn(model, batch)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    assert set(metrics) >= {"ce", "accuracy"}


def test_a_long_evaluation_shows_a_bar_of_its_batches_and_a_quick_one_none(monkeypatch, capsys):
    """The bar appears once an evaluation has run ``LATE_BAR_S`` (here set to 0: every
    evaluation is long) and counts its batches; the values are the same either way."""
    model = TinyMoELM(nnx.Rngs(0))
    ev = LMEvaluator.from_source(ToySource(batch_size=4), 3)
    quiet = ev(model)
    assert "evaluating" not in capsys.readouterr().err
    monkeypatch.setattr(extras, "LATE_BAR_S", 0.0)
    assert ev(model) == quiet
    err = capsys.readouterr().err
    assert "evaluating" in err and "/3 [" in err


def test_every_evaluator_counts_its_batches_on_one_late_bar(monkeypatch):
    bars = Bars()
    monkeypatch.setattr(extras, "progress", bars)
    LMEvaluator.from_source(ToySource(batch_size=4), 3)(TinyMoELM(nnx.Rngs(0)))
    x = np.random.default_rng(0).integers(0, 16, (5, 6))
    lm = DecoderLM(DecoderConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1,
                                 max_seq_len=16, ffn_slots=(DenseFFNConfig(12, "swiglu"),)),
                   rngs=nnx.Rngs(0))
    SparsityEvaluator([{"inputs": x[:, :-1], "targets": x[:, 1:],
                        "mask": np.ones((5, 5), np.float32)}] * 2)(lm)
    ClassifierEvaluator(x, np.arange(5) % 2, batch_size=2).bind_fn(
        lambda params, inputs: jnp.zeros(inputs.shape[:1] + (2,)))(None)
    assert [(b.kw["desc"], b.kw["delay"], b.kw["leave"], b.done, b.closed)
            for b in bars.made] == [("evaluating", LATE_BAR_S, False, n, True) for n in (3, 2, 3)]
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # a second process draws no bar
    assert extras.late_progress(range(2)).kw["disable"] and not bars.made[0].kw["disable"]


def test_lm_evaluator_is_the_mean_over_scored_tokens_across_batches():
    # batches scoring different numbers of tokens: the loss and accuracy are the means over
    # every scored token, not the mean of the batch means; the last batch is smaller (a
    # held-out split's remainder), which the evaluation step, compiled for the first batch's
    # shape, refused with XLA's "Argument types differ" error

    model = DecoderLM(DecoderConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2,
                                    n_kv_heads=1, max_seq_len=16,
                                    ffn_slots=(DenseFFNConfig(12, "swiglu"),)), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batches = []
    for n_scored, rows, width in ((3, 2, 13), (17, 2, 13), (4, 1, 8)):
        tok = rng.integers(0, 16, (rows, width))
        mask = np.zeros((rows, width - 1), np.float32)
        mask.reshape(-1)[rng.permutation(mask.size)[:n_scored]] = 1.0
        batches.append({"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": mask})
    got = LMEvaluator(batches)(model)
    nll, hits, count = 0.0, 0.0, 0.0
    forward = nnx.jit(lambda m, x: m(x, train=False)[0])  # per shape one program
    for b in batches:
        logits = forward(model, jnp.asarray(b["inputs"]))
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)
        tok_nll = -np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]
        nll += (tok_nll * b["mask"]).sum()
        hits += ((logp.argmax(-1) == b["targets"]) * b["mask"]).sum()
        count += b["mask"].sum()
    np.testing.assert_allclose(got["loss"], nll / count, rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], hits / count, rtol=1e-6)
    np.testing.assert_allclose(SparsityEvaluator(batches)(model)["val_ce"], nll / count,
                               rtol=1e-5)
    for bad in (0, -1.5, float("nan"), None):  # 0 failed after the evaluation, -1.5 gave bpb < 0
        with pytest.raises(ValueError, match="bytes_per_token"):
            LMEvaluator(batches, bytes_per_token=bad)


def test_classifier_logits_are_the_models_own_per_row_with_its_mask():
    """Every row's logits as the model gives them with its token mask (padding left out of
    the pooling), in fixed batches whose last one is padded and cut."""
    cfg = bert_encoder_config(vocab_size=20, d_model=8, n_layers=1, n_heads=2, d_hidden=16,
                              max_position=8, pooling="mean")
    model = SequenceClassifier(cfg, 3, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    toks = rng.integers(1, 20, (5, 6)).astype(np.int32)
    mask = (np.arange(6)[None] < np.array([6, 2, 4, 3, 5])[:, None]).astype(np.int32)
    got = classifier_logits(model, toks, mask, batch_size=2)
    want = model(jnp.asarray(toks), mask_BT=jnp.asarray(mask) > 0)[0]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
