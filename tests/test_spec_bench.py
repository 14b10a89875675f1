"""moejax.bench.decode_timing: the grown target predicts exactly what the small one does, its
extra routers reach the asked TLS, and the decode timing reports what it ran; the benchmark
study runs tiny and checks speculative against autoregressive output (its claims:
test_spec_claims.py)."""

import csv
import re

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.blockffn import speculative as spec_study
from experiments.blockffn import speculative_decodings
from moejax.bench import decode_timing as bench_decode
from moejax.bench.decode_timing import blockffn_path, decode_timing, expert_routes, grow_blockffn_lm
from moejax.bench.profile import KernelTrace
from moejax.config import ConfigError
from moejax.config_overrides import apply_overrides
from moejax.harness.experiment import run_experiment
from moejax.kernels.targets import lowering_target
from moejax.nn import sample, speculative
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.sample import sampler
from moejax.nn.speculative import speculative_decoder
from moejax.pytree import count_params
from moejax.train import budget


def _small(seed=0):
    slot = BlockFFNConfig(n_experts=4, d_expert=8)
    cfg = DecoderConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, ffn_slots=(slot,) * 2,
                        max_seq_len=64, init_std=1.0)
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


def test_grown_model_predicts_like_the_small_one_at_the_asked_sparsity():
    small = _small()
    toks = jax.random.randint(jax.random.key(1), (4, 24), 0, 32)
    big = grow_blockffn_lm(small, extra_layers=3, n_experts=16, d_expert=32,
                           key=jax.random.key(2), target_tls=0.8, calib_tokens=toks)
    assert count_params(big) > 2 * count_params(small)
    np.testing.assert_allclose(np.asarray(big(toks)[0]), np.asarray(small(toks)[0]),
                               rtol=1e-5, atol=1e-5)
    _, aux = big(toks)
    tls = [float(la["tls"]) for la in aux["layers"][2:]]
    assert all(abs(t - 0.8) < 0.02 for t in tls), tls
    with pytest.raises(ValueError, match="calib_tokens"):
        grow_blockffn_lm(small, extra_layers=1, n_experts=8, d_expert=8,
                         key=jax.random.key(0), target_tls=0.5)
    sparse = blockffn_path(big, "chunk_union", 4)
    np.testing.assert_allclose(np.asarray(sparse(toks)[0]), np.asarray(big(toks)[0]),
                               rtol=1e-5, atol=1e-5)


def test_decode_timing_autoregressive_and_speculative_agree():
    small = _small()
    prompts = jax.random.randint(jax.random.key(3), (2, 5), 0, 32)
    ar = decode_timing(small, prompts, 9)
    sp = decode_timing(small, prompts, 9, draft=small, draft_len=3)
    assert ar["tokens"].shape == (2, 14) and ar["tokens_per_s"] > 0
    np.testing.assert_array_equal(sp["tokens"], ar["tokens"])
    assert sp["mean_accepted_length"] == pytest.approx(4.0)  # the draft is the target
    np.testing.assert_array_equal(ar["tokens"][:, :5], np.asarray(prompts))


@pytest.mark.parametrize("spec", [False, True])
def test_decode_timing_checks_its_loop_against_memory_before_it_runs(spec, monkeypatch):
    """The decoding loop is compiled and XLA's estimate compared with the device's memory
    before any call: with the host made 10 kB, MemoryBudgetError names the loop and the fix,
    and the model is never called."""
    small = _small()
    prompts = jax.random.randint(jax.random.key(3), (2, 5), 0, 32)
    ran = []
    for mod, name in ((sample, "_sample"), (speculative, "_speculate")):
        jitted = getattr(mod, name)
        monkeypatch.setattr(mod, name, type("Spy", (), {
            "lower": staticmethod(jitted.lower),
            "__call__": staticmethod(lambda *a, f=jitted, **k: ran.append(1) or f(*a, **k))})())
    monkeypatch.setattr(budget, "available_bytes", lambda device: (10**4, "this host's memory"))
    what = "speculative" if spec else "autoregressive"
    with pytest.raises(budget.MemoryBudgetError,
                       match=f"the {what} decoding loop needs about .* Fix: fewer layers"):
        decode_timing(small, prompts, 9, draft=small if spec else None, fix="fewer layers")
    assert ran == []
    monkeypatch.undo()
    assert decode_timing(small, prompts, 9, draft=small if spec else None)["tokens_per_s"] > 0


def test_a_sampler_and_a_decoder_lower_without_running():
    """``draw.lower`` / ``decode.lower``: the jitted loops for those arguments, not run; the
    compiled loop returns what the call returns."""
    small = _small()
    prompts = jax.random.randint(jax.random.key(3), (1, 5), 0, 32)
    lens = np.full((1,), 5, np.int32)
    draw = sampler(small, 6, temperature=0.0)
    decode = speculative_decoder(small, small, 6, draft_len=2)
    assert "while" in draw.lower(prompts, lens, key=jax.random.key(0)).as_text()
    assert "while" in decode.lower(prompts).as_text()
    with pytest.raises(ValueError, match="prompt lengths"):
        draw.lower(prompts, np.full((1,), 9, np.int32), key=jax.random.key(0))


def test_decode_timing_profiles_kernels_per_token(monkeypatch):
    """On a CPU the trace has no device: None. With a device trace of 90 kernels busy 2 ms for
    9 tokens: 10 kernels a token, 2 ms over the measured time of one prompt, and each
    kernel's time per token."""
    small = _small()
    prompts = jax.random.randint(jax.random.key(3), (2, 5), 0, 32)
    if jax.default_backend() == "cpu":
        r = decode_timing(small, prompts, 9, profile=True)
        assert r["kernels_per_token"] is None and r["device_busy"] is None
    monkeypatch.setattr(bench_decode, "trace_kernels", lambda run: KernelTrace(
        90, 2e-3, {"gemm": 1.8e-3, "copy": 0.2e-3}))
    r = decode_timing(small, prompts, 9, draft=small, draft_len=3, profile=True)
    assert r["kernels_per_token"] == pytest.approx(10.0)
    assert r["device_busy"] == pytest.approx(2e-3 / (r["seconds"] / 2))
    assert r["kernels"] == pytest.approx({"gemm": 2e-4, "copy": 2e-4 / 9})


def _bench(argv, **kw):
    """The speculative-decoding bench run as its study (``run_experiment``'s keywords)."""
    return run_experiment(spec_study.STUDY.name, spec_study.make_config, spec_study.run, argv,
                          **kw)


TINY = ["target.d_model=16", "target.n_layers=2", "target.n_experts=4", "target.d_expert=8",
            "draft.d_model=16", "train.steps=4", "train.warmup_steps=1", "train.log_every=2",
            "draft_lens=(2,)", "n_prompts=1", "prompt_len=8", "max_new_tokens=6",
            "grow.extra_layers=1", "grow.n_experts=8", "grow.d_expert=8",
            "drafts.distil.prompts=4", "drafts.distil.prompt_len=8",
            "drafts.distil.response_len=6", "drafts.distil.train.steps=2",
            "drafts.distil.train.warmup_steps=1", "drafts.distil.train.batch_size=4"]


@pytest.mark.slow
def test_bench_speculative_tiny(tmp_path, monkeypatch):
    """The whole bench on tiny models; with a device trace (stubbed: a CPU trace has none)
    each decoding's row gets its kernels per token, token_kernels_<target> its longest
    kernels, and programs/ its compiled decoding loop."""
    monkeypatch.setattr(speculative_decodings, "sees_device", lambda: True)
    read, fused_ops = [], speculative_decodings.fused_ops
    monkeypatch.setattr(speculative_decodings, "fused_ops",
                        lambda text: read.append(text) or fused_ops(text))
    monkeypatch.setattr(bench_decode, "trace_kernels", lambda run: KernelTrace(
        12, 3e-4, {"gemm": 2e-4, "fusion_3": 0.6e-4, "fusion_1": 0.4e-4},
        {"gemm": 6, "fusion_3": 4, "fusion_1": 2}))
    summary, run = _bench(TINY, claims=spec_study.claims, out=tmp_path / "b")
    rows = list(csv.DictReader(open(run.path / "decode.csv")))
    assert {r["model"] for r in rows} == {"trained", "grown"}
    assert [(r["mode"], r["draft"]) for r in rows[:6]] == [
        ("AR dense", ""), ("AR token-sparse", ""), ("spec dense", "independent"),
        ("spec chunk-sparse", "independent"), ("spec chunk-sparse", "distilled"),
        ("spec chunk-sparse", "self (1 layer)")]
    assert rows[6]["draft"] == "self (1 layer) distilled"
    assert all(r["same_tokens_as_AR"] == "True" for r in rows)
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    each = list(csv.DictReader(open(run.path / "decode_prompts.csv")))
    n_prompts = spec_study.make_config("quick").n_prompts if not any(
        a.startswith("n_prompts=") for a in TINY) else int(next(
            a for a in TINY if a.startswith("n_prompts="))[10:])
    assert len(each) == len(rows) * n_prompts and all(float(r["seconds"]) > 0 for r in each)
    assert [r["expert_path"] for r in rows[:4]] == ["dense", "jnp loop", "dense", "jnp loop"]
    # the sparse path's gain is over the dense verification of the same draft only: the other
    # drafts verify chunk-sparse only, so theirs is blank (not their acceptance over another's)
    assert float(rows[3]["sparse_gain"]) == pytest.approx(
        float(rows[3]["tokens_per_s"]) / float(rows[2]["tokens_per_s"]), rel=1e-3)
    assert rows[4]["sparse_gain"] == "" and float(rows[4]["gain_bound"]) > 1
    assert float(rows[1]["sparse_gain"]) == pytest.approx(
        float(rows[1]["tokens_per_s"]) / float(rows[0]["tokens_per_s"]), rel=1e-3)
    assert all(float(r["kernels_per_token"]) == pytest.approx(2.0) for r in rows)  # 12 / 6
    top = list(csv.DictReader(open(run.path / "token_kernels_grown.csv")))
    assert [(t["mode"], t["kernel"]) for t in top[:4]] == [
        ("AR dense", "gemm"), ("AR dense", "fusion_3"), ("AR dense", "fusion_1"),
        ("AR token-sparse", "gemm")]
    kinds = list(csv.DictReader(open(run.path / "kernel_kinds_grown.csv")))
    assert [(k["mode"], k["kind"], float(k["kernels"])) for k in kinds[:2]] == [
        ("AR dense", "gemm", 1.0), ("AR dense", "fusion", 1.0)]  # launches per token: 6 / 6
    assert float(kinds[1]["ms"]) == pytest.approx(1e-4 / 6 * 1e3)
    assert float(top[0]["ms"]) == pytest.approx(2e-4 / 6 * 1e3)
    assert float(top[0]["share"]) == pytest.approx(2 / 3)
    # each traced decoding's compiled loop is kept, and names what each kernel fuses
    programs = run.path / "programs"
    assert len(list(programs.glob("*.hlo"))) == len(rows)
    ar = (programs / "grown_ar_dense_0.hlo").read_text()
    assert ar.startswith("HloModule") and " while(" in ar
    assert (programs / "trained_spec_chunk_sparse_self_1_layer_distilled_2.hlo").exists()
    assert all("fuses" in t for t in top)
    # the fuses column reads the programs kept, one per decoding
    assert sorted(read) == sorted(p.read_text() for p in programs.glob("*.hlo"))
    assert (run.path / "tokens_per_s_grown.png").exists()
    assert "speculative + chunk-sparse" in (run.path / "summary.md").read_text()
    # the tiny models are far below 100M parameters: the serving claims are not judged
    got = list(csv.DictReader(open(run.path / "claims.csv")))
    assert len(got) == 2 and all(c["verdict"] == "not measured" and "100M" in c["evidence"]
                                 for c in got)
    with pytest.raises(ConfigError, match="self_layers"):  # the whole trained target: no
        spec_study.make_config("quick").replace(drafts=spec_study.DraftsConfig(self_layers=2))


@pytest.mark.slow
def test_a_stopped_bench_keeps_its_rows_and_resumes_without_training(tmp_path, monkeypatch):
    """A run cut short (a GPU command's time limit) leaves every decoding timed before it;
    the same command again restores the trained target and draft and the distilled draft
    from their checkpoints (no training step, the same validation perplexity), times only
    the decodings still missing, and finishes the table; a run that replaces it
    (``overwrite=true``) times every decoding again. It decodes
    in bfloat16 (the trained float32 models' bfloat16 copies): every row names the dtype and
    the share of its new tokens before the first difference from AR dense (1 for AR dense
    itself)."""
    args = [*(a for a in TINY if not a.startswith("grow.")),  # no growth: no grow.* read
            "grow.extra_layers=0", "drafts.distilled=true", "drafts.self_layers=0",
            "drafts.self_distilled=false", "decode_dtype=bfloat16"]
    calls, real = [], speculative_decodings.decode_timing

    def stop_at_the_fourth(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise TimeoutError("the command's time limit")
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(speculative_decodings, "decode_timing", stop_at_the_fourth)
        with pytest.raises(TimeoutError):
            _bench(args, out=tmp_path / "b")
    rows = list(csv.DictReader(open(tmp_path / "b" / "decode.csv")))
    assert [r["mode"] for r in rows] == ["AR dense", "AR token-sparse", "spec dense"]
    first = (tmp_path / "b" / "target" / "metrics.csv").read_text()
    assert (tmp_path / "b" / "distilled" / "checkpoints").is_dir()
    steps, timed = [], []
    monkeypatch.setattr("moejax.train.loop._Run._step", lambda self, step: steps.append(step))
    monkeypatch.setattr(speculative_decodings, "decode_timing",
                        lambda *a, **k: timed.append(k) or real(*a, **k))
    _bench(args, out=tmp_path / "b")
    assert steps == []  # nothing trained again
    assert [k["draft"] is not None for k in timed] == [True, True]  # the two never timed
    assert (tmp_path / "b" / "target" / "metrics.csv").read_text() == first
    assert "3 of 5 decodings were timed by an earlier command" in (
        tmp_path / "b" / "summary.md").read_text()
    kept = list(csv.DictReader(open(tmp_path / "b" / "decode.csv")))
    assert [r["tokens_per_s"] for r in kept[:3]] == [r["tokens_per_s"] for r in rows]
    rows = list(csv.DictReader(open(tmp_path / "b" / "decode.csv")))
    assert [(r["mode"], r["draft"]) for r in rows] == [
        ("AR dense", ""), ("AR token-sparse", ""), ("spec dense", "independent"),
        ("spec chunk-sparse", "independent"), ("spec chunk-sparse", "distilled")]
    assert {r["decode_dtype"] for r in rows} == {"bfloat16"}
    assert float(rows[0]["tokens_matching_AR"]) == 1.0
    assert all(0.0 <= float(r["tokens_matching_AR"]) <= 1.0 for r in rows)
    assert "decoded in bfloat16" in (tmp_path / "b" / "summary.md").read_text()
    timed.clear()  # the finished run replaced: its measurements go with it, not reused
    _bench([*args, "overwrite=true"], out=tmp_path / "b")
    assert len(timed) == 5 and steps == []
    assert "decodings were timed by an earlier" not in (tmp_path / "b" / "summary.md").read_text()


def test_expert_routes_say_what_each_layer_decodes_with():
    """On this CPU the jnp loop; lowered for an H100, a bf16 chunk goes to the Mosaic GPU
    decode kernel in the layers whose widths its blocks divide (model width 128, expert width
    64) and to the dense product in the others (expert width 8); float32 never takes it."""
    small = DecoderLM(DecoderConfig(
        vocab_size=32, d_model=128, n_layers=1, n_heads=2, max_seq_len=64,
        ffn_slots=(BlockFFNConfig(n_experts=4, d_expert=8),)), rngs=nnx.Rngs(0))
    big = grow_blockffn_lm(small, extra_layers=2, n_experts=8, d_expert=64,
                           key=jax.random.key(0))
    assert expert_routes(big, 5, "bfloat16") == "jnp loop"
    with lowering_target("cuda"):
        assert expert_routes(big, 5, "bfloat16") == (
            "dense product, non-members weighted 0 in 1 layers; "
            "decode kernel (Mosaic GPU) in 2 layers")
        assert expert_routes(big, 1, "float32") == "dense product, non-members weighted 0"
    with lowering_target("tpu"):
        assert expert_routes(big, 1, "float32") == "decode kernel (TPU)"
    with pytest.raises(ValueError, match="no BlockFFN layer"):
        expert_routes(DecoderLM(DecoderConfig(
            vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8,
            ffn_slots=(DenseFFNConfig(32, "gelu"),)), rngs=nnx.Rngs(0)), 1, "float32")


def test_the_bench_can_time_the_grown_target_alone(tmp_path):
    """decode_trained=false: only the grown target's decodings are timed (a GPU's minutes go
    to the >= 100M-parameter claim); with no grown target that would decode nothing and is
    refused before any training. A draft of a sparse architecture decodes (a BlockFFN draft
    trains wrapped in its schedule, and decodes as its decoder), and the summary names it (not
    "dense") and the target's BlockFFN settings that differ from the paper's."""
    args = [*(a for a in TINY if not a.startswith("drafts.distil.")),  # no distilled draft
            "decode_trained=false", "drafts.distilled=false", "drafts.self_layers=0",
            "drafts.self_distilled=false", "draft.arch=blockffn"]
    _, run = _bench(args, out=tmp_path / "b")
    rows = list(csv.DictReader(open(run.path / "decode.csv")))
    assert {r["model"] for r in rows} == {"grown"}
    assert [r["mode"] for r in rows] == ["AR dense", "AR token-sparse", "spec dense",
                                         "spec chunk-sparse"]
    text = (run.path / "summary.md").read_text()
    assert "draft: a BlockFFN LM (" in text and "draft: a dense LM" not in text
    assert "BlockFFN here differs from the paper's in AL's sharpness alpha 10.0" in text
    no_growth = [a for a in args if not a.startswith("grow.")]
    with pytest.raises(ConfigError, match="decode_trained=false needs grow.extra_layers"):
        _bench([*no_growth, "grow.extra_layers=0"], out=tmp_path / "bad")
    assert not (tmp_path / "bad" / "target").exists()


@pytest.mark.parametrize("bad,words", [
    ("prompt_len=65", "prompt_len=65 exceeds seq_len=64"),
    ("drafts.distil.prompt_len=65", "drafts.distil.prompt_len=65 exceeds seq_len=64"),
])
def test_prompts_longer_than_the_windows_are_refused_before_training(bad, words):
    """The decoded prompts are the heads of seq_len-token validation windows, the drafts'
    training prompts of training windows: longer ones are refused, not decoded shorter (the
    note naming the asked length) or refused by the distillation after the target has
    trained."""
    with pytest.raises(ConfigError, match=re.escape(words)):
        apply_overrides(spec_study.make_config("quick"), [bad])


def test_every_asked_prompt_is_decoded_past_the_ppl_batches():
    """More prompts than the PPL's two validation batches hold come from the validation
    windows after them (33 of batches of 16: a third batch); the PPL's batches and the
    prompts in them stay as they were."""
    cfg = apply_overrides(spec_study.make_config("quick"), ["n_prompts=33", "prompt_len=64"])
    _, val, prompts = spec_study._sources(cfg, cfg.train)
    assert len(val) == spec_study.EVAL_BATCHES and prompts.shape == (33, 64)
    np.testing.assert_array_equal(prompts[:32], np.concatenate([b["inputs"] for b in val]))
    _, val2, prompts2 = spec_study._sources(cfg.replace(n_prompts=8), cfg.train)
    np.testing.assert_array_equal(prompts2, prompts[:8])
    for a, b in zip(val, val2, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
