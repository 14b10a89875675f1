"""The public API refuses, with a ValueError naming the argument, what it would otherwise turn
into garbage: integer deltas for DARE (1/q cast to 0), non-finite drop rates, rescalings and
weights, anchors of another shape than the parameters (a silent broadcast), token ids outside
the vocabulary, non-finite temperatures and empty prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax.train.budget as budget
from experiments import lm_demo
from experiments.ders import upcycling
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.delta import dare, structural_dpp
from moejax.evaluate import LMEvaluator
from moejax.kernels.tuning import config_for, read_table
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ders_moe import check_lm_rank
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.moe import MoEConfig
from moejax.nn.speculative import speculative_generate
from moejax.optim import adamr, dare_updates
from moejax.train import LoopOptions, TrainConfig, train
from moejax.train.budget import MemoryBudgetError
from tests.toy_models import TinyMoELM, ToySource

KEY = jax.random.key(0)


def test_dare_refuses_integer_deltas_and_non_finite_rates():
    ints = {"w": jnp.arange(12, dtype=jnp.int32).reshape(3, 4)}
    with pytest.raises(ValueError, match="'w' is int32"):
        dare(KEY, ints, 0.5)
    floats = {"w": jnp.ones((3, 4))}
    for q in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="q="):
            dare(KEY, floats, 0.5, q=q)
    for p in (float("nan"), 1.0, -0.1):
        with pytest.raises(ValueError, match="p="):
            dare(KEY, floats, p)
    assert dare(KEY, {"w": floats["w"], "n": jnp.arange(3)}, 0.5,
                mask={"w": True, "n": False})["n"].dtype == jnp.int32  # deselected: kept


def test_structural_dpp_refuses_integer_deltas_and_bad_rescalings():
    """Structural DPP rescales its survivors by 1/q as DARE does: an integer delta (survivors
    truncated: 1/0.25 stored as 4, exactly and wrongly) and a q that is not a finite number
    > 0 (1/0 = inf) are refused, naming the leaf or the q."""
    ints = {"w": jnp.ones((8, 8), jnp.int32)}
    with pytest.raises(ValueError, match="structural_dpp: delta leaf 'w' is int32"):
        structural_dpp(KEY, ints, 0.5, 0.5)
    floats = {"w": jnp.ones((8, 8))}
    for q in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="structural_dpp: q="):
            structural_dpp(KEY, floats, 0.5, 0.5, q=q)
    kept = structural_dpp(KEY, {"w": floats["w"], "n": jnp.arange(3)}, 0.5, 0.5,
                          mask={"w": True, "n": False})
    assert kept["n"].dtype == jnp.int32  # deselected: kept


def test_dare_updates_refuses_integer_updates_and_non_finite_q():
    tx = dare_updates(0.5, 0)
    state = tx.init({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="int32"):
        tx.update({"w": jnp.arange(3, dtype=jnp.int32)}, state)
    for q in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="q="):
            dare_updates(0.5, 0, q=q)
    with pytest.raises(ValueError, match="p="):
        dare_updates(float("nan"), 0)


def test_adamr_refuses_broadcast_anchors_and_bad_weights():
    params = {"w": jnp.ones((3, 3))}
    for anchor in ({"w": jnp.zeros((1, 3))}, {"w": jnp.zeros(())}):
        with pytest.raises(ValueError, match="anchor leaf of shape"):
            adamr(1e-3, 0.1, anchor=anchor).init(params)
    for weight in (float("nan"), -0.1, float("inf")):
        with pytest.raises(ValueError, match="weight_decay="):
            adamr(1e-3, weight)
    # the pre-trained params where lambda goes (the second positional argument), or another
    # thing that is no number, named with where the params go; a 0-d array (as
    # optax.inject_hyperparams holds it) is a number
    for weight in (params, "0.1", [0.1], np.ones(2), None, True):
        with pytest.raises(TypeError, match="weight_decay must be a number.*anchor="):
            adamr(1e-3, weight)
    for weight in (0.1, 1, np.float32(0.1), jnp.asarray(0.1)):
        tx = adamr(1e-3, weight)
        tx.update(params, tx.init(params), params)
    adamr(1e-3, 0.1, anchor={"w": jnp.zeros((3, 3))}).init(params)  # same shapes: fine


def _lm(seed=0, vocab=16):
    ffn = DenseFFNConfig(d_hidden=16, activation="swiglu")
    cfg = DecoderConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        max_seq_len=32, ffn_slots=(ffn,))
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("decode", ["generate", "speculative"])
def test_decoding_refuses_ids_outside_the_vocabulary_bad_temperatures_and_empty_prompts(
        decode):
    target, draft = _lm(0), _lm(1)

    def run(prompt, temperature=0.0):
        if decode == "generate":
            return generate(target, prompt, 4, temperature=temperature, key=KEY)
        return speculative_generate(target, draft, prompt, 4, temperature=temperature, key=KEY)

    for bad in ([[1, 16, 2]], [[1, -1, 2]]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            run(np.asarray(bad))
    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature="):
            run(np.asarray([[1, 2]]), t)
    with pytest.raises(ValueError, match="empty prompt"):
        run(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match=r"shape \(2,\): give \[B, T\] token ids, a row per "
                                         r"prompt \(prompt\[None\] for one\)"):
        run(np.asarray([1, 2]))
    # float ids: a cast to int32 would decode [1, 2] for [1.7, 2.2], silently
    for floats in (np.asarray([[1.7, 2.2]]), jnp.asarray([[1.7, 2.2]]), [[1.7, 2.2]]):
        with pytest.raises(ValueError, match="prompt_BT of dtype float.*integer token ids"):
            run(floats)
    run(np.asarray([[1, 15]]))  # ids in range: decodes
    run([[1, 15]])  # a nested list of ints, too
    if decode == "generate":
        with pytest.raises(ValueError, match=r"eos_id=2\.5 must be an integer token id"):
            generate(target, np.asarray([[1, 2]]), 4, eos_id=2.5)
        # top_k=True sampled from the top 1 (greedy), 2.5 failed inside lax.top_k
        for top_k in (0, 17, True, 2.5, "3"):
            with pytest.raises(ValueError, match=f"top_k={top_k!r} must be an integer in "
                                                 r"\[1, vocab_size=16\]"):
                generate(target, np.asarray([[1, 2]]), 4, temperature=1.0, key=KEY,
                         top_k=top_k)
        generate(target, np.asarray([[1, 2]]), 4, temperature=1.0, key=KEY, top_k=np.int64(3))


def test_ders_lm_ranks_past_full_rank_are_refused():
    check_lm_rank(32, "up", 32, 96)  # full rank: allowed
    with pytest.raises(ValueError, match="lm_rank=1000 exceeds min"):
        check_lm_rank(1000, "up", 32, 96)
    with pytest.raises(ValueError, match="lm_rank=33 exceeds min"):  # past d_in, not d_out
        check_lm_rank(33, "up", 32, 96)
    with pytest.raises(ConfigError, match="full rank already"):
        apply_overrides(upcycling.make_config("quick"), ["lm_ranks=(1000,)"])


@pytest.mark.parametrize("entry,match", [
    ({"tm": 0, "tk": 64, "tn": 128}, "tm=0"), ({"tm": -128, "tk": 64, "tn": 128}, "tm=-128"),
    ({"tm": 100, "tk": 64, "tn": 128}, "tm=100"),
    ({"tm": 128, "tk": 64, "tn": 128, "num_stages": 0}, "num_stages=0"),
    ({"tm": 128, "tk": 64, "tn": 128, "l2_prefetch": 7}, "l2_prefetch=7"),
    ({"tm": 128, "tk": 64, "tn": 128, "num_warps": 5}, "num_warps=5"),
    ([128, 64, 128], "not an object"),
])
def test_kernel_table_entries_are_checked_when_the_table_loads(tmp_path, monkeypatch, entry,
                                                               match):
    import json

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"NVIDIA H200": {"gmm": {"bfloat16": {"k128_n128": entry}}}}))
    with pytest.raises(ValueError, match=match):
        read_table(path)
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(path))
    with pytest.raises(ValueError, match=match):
        config_for("gmm", "bfloat16", 128, 128, "NVIDIA H200")
    monkeypatch.setenv("MOEJAX_KERNEL_TABLE", str(tmp_path / "typo.json"))
    with pytest.raises(ValueError, match="no kernel table there"):
        config_for("gmm", "bfloat16", 128, 128, "NVIDIA H200")


@pytest.mark.parametrize("dispatch", ["dense", "capacity", "ragged", "host", "grouped"])
@pytest.mark.parametrize("shape", [(0, 5, 16), (2, 0, 16)])
def test_an_moe_layer_of_no_tokens_returns_an_empty_output(dispatch, shape):
    m = MoEConfig(n_experts=4, top_k=2, d_expert=8, dispatch=dispatch).build(
        16, rngs=nnx.Rngs(0))
    y, aux = m(jnp.zeros(shape))
    _, aux_one = m(jnp.ones((1, 1, 16)))
    assert y.shape == shape
    assert jax.tree.structure(aux) == jax.tree.structure(aux_one)
    assert all(float(jnp.sum(jnp.abs(a))) == 0 for a in jax.tree.leaves(aux))


def test_a_non_utf8_value_is_refused_in_one_line():
    import os

    raw = os.fsdecode(b"prompt=caf\xe9")  # argv bytes that are not UTF-8
    with pytest.raises(ConfigError, match="prompt=...: the value is not valid UTF-8"):
        apply_overrides(lm_demo.make_config("quick"), [raw])


@pytest.mark.parametrize("ep,ref", [("expert_parallel", "grouped"),
                                    ("expert_parallel_capacity", "capacity")])
def test_expert_parallel_without_an_expert_mesh_computes_on_one_device(ep, ref):
    """An evaluation of host arrays (before training shards them) or a one-device run:
    the expert-parallel dispatch computes the same products on this device."""
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    got, _ = MoEConfig(n_experts=4, top_k=2, d_expert=8, dispatch=ep).build(
        16, rngs=nnx.Rngs(0))(x)
    want, _ = MoEConfig(n_experts=4, top_k=2, d_expert=8, dispatch=ref).build(
        16, rngs=nnx.Rngs(0))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_evaluation_that_cannot_fit_is_refused_before_it_runs(monkeypatch):
    """The evaluation before training can be a run's first program: its compiled peak is
    checked against the device's memory before it runs (here the host is made 1 MB)."""
    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**6, "this host's memory"))
    tokens = np.ones((64, 33), np.int32)
    ev = LMEvaluator([{"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                       "mask": np.ones((64, 32), np.float32)}])
    with pytest.raises(MemoryBudgetError, match="the evaluation of batches of 64 x 32 tokens"):
        ev(_lm())


@pytest.mark.parametrize("option, value, what", [
    ("tx", "adam", "an optax transform"), ("loss_fn", None, "a function loss_fn"),
    ("eval_fn", 3, "a function eval_fn"), ("run_dir", 3, "a directory path"),
    ("init_from", 5, "a directory path"), ("config", {}, "a moejax Config"),
    ("keep_best", 1, "an evaluation key"), ("progress", "no", "True or False")])
def test_a_loop_option_of_the_wrong_kind_is_refused_before_any_step(tmp_path, option, value,
                                                                    what):
    # a string tx failed in the step's set-up, a number eval_fn only at the first evaluation,
    # after the training steps before it had run
    import optax

    with pytest.raises(TypeError, match=f"{option}=.*give {what}"):
        train(TinyMoELM(nnx.Rngs(0)), ToySource(), TrainConfig(steps=1, batch_size=8),
              **{option: value})
    LoopOptions(tx=optax.adam(1e-3), eval_fn=lambda m, s: {}, run_dir=tmp_path)  # the right kinds
    model = TinyMoELM(nnx.Rngs(0))
    LoopOptions(tx=nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
