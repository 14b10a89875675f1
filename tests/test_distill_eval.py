"""ROUGE-L against hand-computed cases, the generation evaluator on a model that can only say
one thing, the layer-dropping and dtype surgery, the router statistics, and the held-out
KL and perplexity of a student against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax import extras
from moejax.data.packing import prompt_response_rows
from moejax.distill.routing_modes import RoutingMode, with_routing
from moejax.evaluate_generation import (
    GenerationEvaluator,
    ResponseScorer,
    gate_mass_by_layer,
    real_tokens,
    response_kl,
    rouge_l,
    router_kl_by_layer,
)
from moejax.extras import LATE_BAR_S
from moejax.nn.decoder import DecoderConfig, DecoderLM, keep_layers, with_dtype
from moejax.nn.ders_moe import DeRSFrozen, DeRSIndex
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.moe import MoEConfig
from moejax.nn.surgery import build_from_pure
from moejax.upcycle import UpcycleConfig, upcycle_model
from tests.bars import Bars


def test_rouge_l_hand_cases():
    # LCS "the cat on the mat" = 5 words; P = 5/5, R = 5/6 -> F = 2PR/(P+R) = 10/11
    got = rouge_l(["the cat on the mat", "Hello, World!", "a b c", ""],
                  ["the cat sat on the mat", "hello world", "x y z", "something"])
    np.testing.assert_allclose(got, [10 / 11, 1.0, 0.0, 0.0], rtol=1e-9)
    # LCS is in order: "b a" vs "a b" shares one word -> P = R = 1/2
    np.testing.assert_allclose(rouge_l(["b a"], ["a b"]), [0.5])
    # words are Porter-stemmed as in MiniLLM's evaluation ("cats"/"cat", "running"/"runs"
    # -> "cat", "run"); stem=False compares them as written
    np.testing.assert_allclose(rouge_l(["cats running"], ["the cat runs"]), [0.8])
    np.testing.assert_allclose(rouge_l(["cats running"], ["the cat runs"], stem=False), [0.0])
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        rouge_l(["a", "b"], ["a"])


def _lm(moe=False, n_layers=3, seed=0):
    slot = (MoEConfig(n_experts=4, top_k=2, d_expert=8, router="noisy", dispatch="dense")
            if moe else DenseFFNConfig(d_hidden=16, activation="swiglu"))
    return DecoderLM(DecoderConfig(vocab_size=12, d_model=16, n_layers=n_layers, n_heads=2,
                                   n_kv_heads=1, max_seq_len=32, ffn_slots=(slot,) * n_layers),
                     rngs=nnx.Rngs(seed))


def test_keep_layers_is_the_shallower_network():
    lm = _lm()
    x = jnp.asarray(np.random.default_rng(0).integers(0, 12, (2, 7)))
    same = keep_layers(lm, range(3))
    np.testing.assert_allclose(np.asarray(same(x)[0]), np.asarray(lm(x)[0]), rtol=1e-6)
    sub = keep_layers(lm, [0, 2])
    h = lm._embed(x)
    for i in (0, 2):
        h, _ = lm.blocks[i](h)
    np.testing.assert_allclose(np.asarray(sub(x)[0]), np.asarray(lm._head(h)), rtol=1e-5,
                               atol=1e-6)
    assert sub.cfg.n_layers == 2
    sub.embed[...] = sub.embed[...] * 0  # a copy: the original keeps its own
    assert float(jnp.abs(lm.embed[...]).sum()) > 0
    for bad in ([3], [], [1.7], [True]):  # 1.7 kept layer 1
        with pytest.raises(ValueError, match="integer indices in \\[0, 3\\)"):
            keep_layers(lm, bad)
    assert keep_layers(lm, np.array([2])).cfg.n_layers == 1  # numpy integers are indices


@pytest.mark.parametrize("moe", [False, True])
def test_with_dtype_is_the_same_network_in_bfloat16(moe):
    lm = _lm(moe=moe)
    x = jnp.asarray(np.random.default_rng(1).integers(0, 12, (2, 7)))
    half = with_dtype(lm, "bfloat16")
    assert {str(a.dtype) for a in jax.tree.leaves(nnx.state(half, nnx.Param))} == {"bfloat16"}
    assert half._embed(x).dtype == jnp.bfloat16  # it computes in bfloat16 (logits: float32)
    logits, want = half(x)[0], lm(x)[0]
    # bfloat16's 8 bits of mantissa (a routed layer may also pick another expert at a tie)
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(want), atol=0.1 * scale)
    assert float(jnp.mean(jnp.abs(logits - want))) < 0.02 * scale
    back = with_dtype(half, "float32")  # the original is untouched; a round trip rounds once
    assert {str(a.dtype) for a in jax.tree.leaves(nnx.state(lm, nnx.Param))} == {"float32"}
    np.testing.assert_array_equal(np.asarray(back.embed[...]),
                                  np.asarray(lm.embed[...].astype(jnp.bfloat16), np.float32))
    with pytest.raises(ValueError, match="dtype='float16'"):
        with_dtype(lm, "float16")


def test_layer_and_dtype_surgery_carry_every_variable_not_only_the_parameters():
    """A DeRS-SM model with a frozen shared weight holds buffers that are not nnx.Param (the
    SM indices, the frozen weight): keep_layers and with_dtype copy them (the model they
    build computes as its source did; before, those variables held no value and the first
    call failed), and build_from_pure refuses a dict that leaves a variable unset."""
    rule = UpcycleConfig(blocks="all", expert_form="sm", sm_rate=0.9, freeze_shared=True)
    lm = upcycle_model(_lm(), rule, jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(2).integers(0, 12, (2, 7)))
    for new in (keep_layers(lm, range(3)), with_dtype(lm, "float32")):
        np.testing.assert_array_equal(np.asarray(new(x)[0]), np.asarray(lm(x)[0]))
        for kind in (DeRSIndex, DeRSFrozen):
            for a, b in zip(jax.tree.leaves(nnx.state(new, kind)),
                            jax.tree.leaves(nnx.state(lm, kind)), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    half = with_dtype(lm, "bfloat16")
    assert {str(a.dtype) for a in jax.tree.leaves(nnx.state(half, DeRSFrozen))} == {"bfloat16"}
    with pytest.raises(ValueError, match=r"build_from_pure: no value for \['blocks'\]\[0\]"
                                         r"\['ffn'\]\['base'\]"):
        build_from_pure(lambda: DecoderLM(lm.cfg, rngs=nnx.Rngs(0)),
                        nnx.to_pure_dict(nnx.state(lm, nnx.Param)))


def test_generation_evaluator_matches_sampling_then_rouge():
    """Greedy: every seed gives the same responses (std 0) and the score is ROUGE-L of the
    decoded greedy continuation of each row's own prompt against its reference; sampled:
    seeds differ."""
    lm = _lm(n_layers=1)
    decode = lambda ids: " ".join(f"w{int(t)}" for t in ids if int(t) > 2)  # noqa: E731
    batch = {"prompts": np.array([[1, 4, 2, 0], [1, 5, 6, 2]], np.int32),
             "prompt_lens": np.array([3, 4]),
             "tokens": np.array([[1, 4, 2, 7, 9, 2, 0, 0], [1, 5, 6, 2, 8, 8, 3, 2]], np.int32),
             "response_mask": np.array([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]],
                                       np.float32)}
    ev = GenerationEvaluator([batch], decode, seeds=(0, 1), temperature=0.0, eos_id=2)(lm)
    preds = []
    for row, n in zip(batch["prompts"], batch["prompt_lens"]):
        out = np.asarray(generate(lm, row[None, :n], 4, eos_id=2))[0, n:]
        stop = np.flatnonzero(out == 2)
        preds.append(decode(out[: stop[0] + 1] if stop.size else out))
    want = rouge_l(preds, ["w7 w9", "w8 w8 w3"]).mean()
    assert ev["rouge_l"] == pytest.approx(want) and ev["rouge_l_std"] == 0.0
    sampled = GenerationEvaluator([batch], decode, seeds=(0, 1, 2, 3))(lm)
    assert len(set(sampled["rouge_l_seeds"])) > 1 or sampled["rouge_l"] == 0.0
    # the spread over sampling seeds is the sample std, as every spread of the harness
    assert sampled["rouge_l_std"] == pytest.approx(np.std(sampled["rouge_l_seeds"], ddof=1))
    # each batch draws with its own key: the same prompts twice are sampled apart
    twice = GenerationEvaluator([batch, batch], decode, seeds=(0,))
    first, second = np.split(np.asarray(twice.generate(lm, 0)), 2)
    assert list(first) != list(second)
    with pytest.raises(ValueError, match="at least one sampling seed"):  # else a NaN ROUGE-L
        GenerationEvaluator([batch], decode, seeds=())


def test_a_long_sampling_shows_one_bar_over_its_seeds_and_batches(monkeypatch):
    """Sampling responses asks for one bar over every seed's batches, shown once it has run
    ``LATE_BAR_S``; each batch sampled counts one, and the bar is closed; the scores are the
    same with or without it."""
    lm = _lm(n_layers=1)
    batch = {"prompts": np.array([[1, 4, 2, 0]], np.int32), "prompt_lens": np.array([3]),
             "tokens": np.array([[1, 4, 2, 7, 9, 2]], np.int32),
             "response_mask": np.array([[0, 0, 0, 1, 1, 1]], np.float32)}
    ev = GenerationEvaluator([batch, batch], lambda ids: " ".join(map(str, ids)), seeds=(0, 1))
    scores, bars = ev(lm), Bars()
    monkeypatch.setattr(extras, "progress", bars)
    assert ev(lm) == scores
    assert [(b.kw["total"], b.kw["delay"], b.done, b.closed) for b in bars.made] == [
        (4, LATE_BAR_S, 4, True)]


def test_router_statistics():
    teacher = _lm(moe=True, n_layers=2)
    batches = [{"inputs": np.random.default_rng(i).integers(0, 12, (2, 6))} for i in range(2)]
    mass = gate_mass_by_layer(teacher, batches)
    # oracle: per token, the two largest of the layer's full gate distribution (numpy sort)
    want = np.zeros(2)
    for b in batches:
        _, aux = teacher(jnp.asarray(b["inputs"]))
        for i, la in enumerate(aux["layers"]):
            probs = np.sort(np.asarray(la["gate_probs"], np.float64).reshape(-1, 4), -1)
            want[i] += probs[:, -2:].sum(-1).mean() / len(batches)
    np.testing.assert_allclose(mass, want, rtol=1e-5)
    every = gate_mass_by_layer(with_routing(teacher, RoutingMode(mode="all")), batches)
    np.testing.assert_allclose(every, [1.0, 1.0], rtol=1e-6)
    same = router_kl_by_layer(teacher, teacher, batches)
    assert [r["mean_kl"] for r in same] == pytest.approx([0.0, 0.0], abs=1e-7)
    other = _lm(moe=True, n_layers=2, seed=3)
    diff = router_kl_by_layer(teacher, other, batches)
    assert all(r["max_kl"] >= r["mean_kl"] > 0 for r in diff)


def _softmax_np(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def test_response_kl_and_scorer_against_numpy():
    """KL(teacher || student) per response token over two batches (pooled by token count,
    not by batch), and the scorer's perplexity, against numpy on the models' logits."""
    teacher, student = _lm(moe=True, n_layers=2), _lm(n_layers=1, seed=5)
    rng = np.random.default_rng(0)
    batches = []
    for n_resp in (3, 1):  # unequal token counts: a per-batch mean would weight them wrongly
        tokens = rng.integers(3, 12, (2, 8)).astype(np.int32)
        mask = np.zeros((2, 7), np.float32)
        mask[:, 7 - n_resp:] = 1
        batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask})
    num = den = 0.0
    for b in batches:
        p = _softmax_np(np.asarray(teacher(jnp.asarray(b["inputs"]))[0], np.float64))
        q = _softmax_np(np.asarray(student(jnp.asarray(b["inputs"]))[0], np.float64))
        kl = (p * (np.log(p) - np.log(q))).sum(-1)
        num, den = num + (kl * b["mask"]).sum(), den + b["mask"].sum()
    assert response_kl(teacher, student, batches) == pytest.approx(num / den, rel=1e-4)
    assert response_kl(teacher, teacher, batches) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="no response token"):
        response_kl(teacher, student, [{**batches[0], "mask": np.zeros((2, 7), np.float32)}])

    b = batches[0]
    gen = GenerationEvaluator([{**b, "prompts": b["inputs"][:, :4],
                                "prompt_lens": np.array([4, 4]), "tokens": np.concatenate(
                                    [b["inputs"], b["targets"][:, -1:]], 1),
                                "response_mask": np.concatenate(
                                    [np.zeros((2, 1), np.float32), b["mask"]], 1)}],
                              lambda ids: " ".join(f"w{int(t)}" for t in ids), seeds=(0, 1))
    q = _softmax_np(np.asarray(student(jnp.asarray(b["inputs"]))[0], np.float64))
    nll = -np.log(np.take_along_axis(q, b["targets"][..., None], -1))[..., 0]
    sc = ResponseScorer(gen, teacher)(student)
    assert sc["ppl"] == pytest.approx(np.exp((nll * b["mask"]).sum() / b["mask"].sum()),
                                      rel=1e-4)
    assert sc["kl"] == pytest.approx(response_kl(teacher, student, gen.batches))
    assert len(sc["rouge_l_seeds"]) == 2 and "kl" not in ResponseScorer(gen)(student)


def test_router_statistics_count_real_tokens_only():
    # a prompt/response batch padded after each row's response: the statistics equal those of
    # every row run alone at its real length (the decoder is causal), the padding ignored

    rng = np.random.default_rng(0)
    rows = prompt_response_rows([rng.integers(3, 12, n) for n in (1, 4, 2)],
                                [rng.integers(3, 12, n) for n in (2, 6, 1)], 8, 8)
    batch = {**rows, "inputs": rows["tokens"][:, :-1]}
    real = real_tokens(batch)
    n_B = (rows["prompt_lens"] + rows["response_mask"].sum(-1)).astype(int)
    assert real.sum() == n_B.sum() < real.size
    a, b = _lm(moe=True, n_layers=2), _lm(moe=True, n_layers=2, seed=3)
    mass_sum, kls = np.zeros(2), [[], []]
    aux = nnx.jit(lambda m, t: m(t)[1])  # one program per row length, not one per op
    for row, n in zip(batch["inputs"], n_B):
        aux_a, aux_b = aux(a, jnp.asarray(row[None, :n])), aux(b, jnp.asarray(row[None, :n]))
        for i, (la, lb) in enumerate(zip(aux_a["layers"], aux_b["layers"])):
            pa = np.asarray(la["gate_probs"], np.float64).reshape(-1, 4)
            pb = np.asarray(lb["gate_probs"], np.float64).reshape(-1, 4)
            mass_sum[i] += np.sort(pa, -1)[:, -2:].sum()
            kls[i] += list((pa * (np.log(pa) - np.log(pb))).sum(-1))
    np.testing.assert_allclose(gate_mass_by_layer(a, [batch]), mass_sum / n_B.sum(), rtol=1e-5)
    got = router_kl_by_layer(a, b, [batch])
    np.testing.assert_allclose([r["mean_kl"] for r in got], [np.mean(k) for k in kls],
                               rtol=1e-4)
    np.testing.assert_allclose([r["max_kl"] for r in got], [np.max(k) for k in kls], rtol=1e-4)
    packed = {"inputs": batch["inputs"], "segment_ids": np.array([[1, 1, 2, 0, 0, 0, 0]] * 3)}
    np.testing.assert_array_equal(real_tokens(packed), packed["segment_ids"] > 0)
    shown = {**batch, "token_mask": np.tril(np.ones((3, 7), np.int32))}  # before prompt_lens
    np.testing.assert_array_equal(real_tokens(shown), shown["token_mask"] > 0)
    empty = {**batch, "prompt_lens": 0 * rows["prompt_lens"], "response_mask": 0 * real}
    with pytest.raises(ValueError, match="no real token"):
        gate_mass_by_layer(a, [empty])
    with pytest.raises(ValueError, match="no real token"):
        router_kl_by_layer(a, b, [empty])


def test_response_kl_does_not_depend_on_the_padding_of_a_capacity_limited_teacher():
    # the padding after each row takes no expert slot: what it holds cannot move the real
    # tokens' logits, even where the experts' capacity is short

    slot = MoEConfig(n_experts=4, top_k=2, d_expert=8, dispatch="capacity", capacity_factor=0.5)
    teacher = DecoderLM(DecoderConfig(vocab_size=12, d_model=16, n_layers=2, n_heads=2,
                                      n_kv_heads=1, max_seq_len=32, ffn_slots=(slot,) * 2),
                        rngs=nnx.Rngs(0))
    student = _lm(moe=False, seed=1)
    rng = np.random.default_rng(0)
    rows = prompt_response_rows([rng.integers(3, 12, n) for n in (1, 4, 2, 1)],
                                [rng.integers(3, 12, n) for n in (2, 6, 1, 1)], 8, 8)
    batch = {**rows, "inputs": rows["tokens"][:, :-1], "mask": rows["response_mask"][:, 1:]}
    pad = ~real_tokens(batch)
    other = {**batch, "inputs": np.where(pad, rng.integers(3, 12, pad.shape), batch["inputs"])}
    assert pad.sum() > 8
    assert response_kl(teacher, student, [other]) == pytest.approx(
        response_kl(teacher, student, [batch]), rel=1e-5)
