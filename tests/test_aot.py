"""Ahead-of-time proof: the training runs a recipe starts are captured at their real shapes
(without running a step when asked), and each captured step is exported for cuda and tpu
with the platform's kernels, its size and memory read from XLA; so are the decode loops
(sampling, speculative decoding with chunk-sparse verification, generation's token step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import experiments.lm_demo as study
from experiments.benchmarks import dispatch as bench
from experiments.ders import upcycling
from experiments.full_smoke import _aot, _aot_rows, _parse, _proven_rows, _shapes, main
from experiments.kd import moe_kd
from moejax.bench.decode_timing import blockffn_path
from moejax.capture import CapturedDecode, CapturedStep, capture_steps
from moejax.config import Config, ConfigError, config
from moejax.config_overrides import apply_overrides
from moejax.harness.results import RunDir
from moejax.harness.study import Study
from moejax.io.hf_moe import load_hf_moe
from moejax.nn.blockffn import BlockFFNConfig
from moejax.nn.decoder import DecoderConfig, DecoderLM
from moejax.nn.ffn import DenseFFNConfig
from moejax.nn.generate import generate
from moejax.nn.moe import MoEConfig
from moejax.nn.moe_lm import MoELMConfig
from moejax.nn.sample import sample
from moejax.nn.speculative import chunk_sparse_target, speculative_generate
from moejax.train.aot import H100_BF16_FLOPS, UTILISATION, abstract_run, prove_decode, prove_step
from moejax.train.hparams import TrainConfig
from moejax.train.loop import train
from moejax.train.run_lock import RunLock
from moejax.train.step import lm_loss_fn
from tests.toy_models import ToySource


def _model():
    cfg = MoELMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      moe=MoEConfig(n_experts=4, top_k=2, d_expert=32))  # dispatch="auto"
    return DecoderLM(cfg.decoder_config(), rngs=nnx.Rngs(0))


def _params(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def test_capture_records_every_run_at_its_shapes_and_cuts_what_runs():
    model = _model()
    before = _params(model)
    cfg = TrainConfig(steps=3, batch_size=4, lr=1e-2)
    with capture_steps(steps=0) as captured:
        history = train(model, ToySource(batch_size=4), cfg, desc="first")
        train(model, ToySource(batch_size=2), cfg.replace(batch_size=2), desc="second")
    assert [c.label for c in captured] == ["first", "second"] and len(history) == 0
    assert jax.tree.leaves(captured[0].batch)[0].shape[0] == 4
    assert jax.tree.leaves(captured[1].batch)[0].shape[0] == 2
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(captured[0].state))
    jax.tree.map(np.testing.assert_array_equal, _params(model), before)  # nothing trained
    with capture_steps(steps=2, rows=1) as captured:  # recorded at 4 rows, run on 1
        history = train(model, ToySource(batch_size=4), cfg)
    assert len(captured) == 1 and captured[0].cfg.steps == 3 and len(history) == 2
    assert jax.tree.leaves(captured[0].batch)[0].shape[0] == 4
    assert history[0]["tokens_per_s"] > 0
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), _params(model), before)
    assert max(jax.tree.leaves(moved)) > 0  # trained
    with capture_steps(steps=0):
        pass
    assert len(train(model, ToySource(batch_size=4), cfg)) == 3  # outside: a plain run
    with pytest.raises(ValueError, match="rows=0"):
        with capture_steps(rows=0):
            pass


@pytest.mark.slow
def test_prove_step_exports_for_both_platforms_and_reads_the_size():
    model = _model()
    with capture_steps(steps=0) as captured:
        train(model, ToySource(batch_size=4), TrainConfig(steps=500, batch_size=4))
    row = prove_step(captured[0])
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_params(model)))
    assert row["params"] == n and row["steps"] == 500 and row["batch"] == "4x6"
    assert row["weights_GB"] == pytest.approx(4 * n / 1e9)
    assert row["opt_state_GB"] >= 2 * row["weights_GB"]  # AdamW's two moments
    # 2 MoE layers x up / down (+ gate) x forward, dX, dW on the platform's kernel
    assert int(row["cuda_kernels"]) >= 12 and int(row["tpu_kernels"]) >= 12, row
    # the experts' matmuls are counted (traced in jnp for the count), nothing left uncounted:
    # at least 6 FLOPs per parameter a token reaches (every expert weight: k / E of tokens)
    tokens = 4 * 6
    assert row["uncounted_calls"] == 0
    assert 6 * n * tokens * 2 / 4 < row["flops_per_step"] < 6 * n * tokens * 1.5
    assert row["peak_GB"] >= row["weights_GB"] + row["opt_state_GB"]
    assert row["fits_H100_80GB"] is True
    assert row["gpu_hours"] == pytest.approx(
        row["flops_per_step"] * 500 / (UTILISATION * H100_BF16_FLOPS) / 3600)


@pytest.mark.slow
def test_gradient_accumulation_does_not_change_the_step_flops():
    """XLA counts the micro-batch loop's body once; the proof counts the whole step (a dense
    model: no per-micro-batch expert padding; 384 tokens a step, so the optimizer's FLOPs,
    counted once per micro-batch, stay within the tolerance)."""
    cfg = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                        ffn_slots=(DenseFFNConfig(d_hidden=64, activation="swiglu"),) * 2,
                        max_seq_len=64)
    rows = []
    for accum in (1, 4):
        with capture_steps(steps=0) as captured:
            train(DecoderLM(cfg, rngs=nnx.Rngs(0)), ToySource(batch_size=64),
                  TrainConfig(steps=10, batch_size=64, grad_accum=accum))
        rows.append(prove_step(captured[0]))
    assert rows[1]["flops_per_step"] == pytest.approx(rows[0]["flops_per_step"], rel=0.05)
    assert rows[1]["gpu_hours"] == pytest.approx(rows[0]["gpu_hours"], rel=0.05)


@pytest.mark.slow
def test_a_full_preset_is_proven_at_reduced_depth(tmp_path, monkeypatch):
    """lm_demo's full preset (one layer instead of 8, 2 rows instead of 64; everything else
    full) runs as a smoke run to its end while its training step and its decode step are
    captured at their real shapes and exported for both platforms."""
    monkeypatch.setenv("MOEJAX_SUBSTRATE_DIR", str(tmp_path / "subs"))
    full = study.make_config("full")
    result = _aot(study.STUDY, tmp_path / "run", ["model.n_layers=1", "train.batch_size=2"])
    assert result["ok"] and not result["error"], result  # the recipe ran to its end
    (row,) = [r for r in result["rows"] if "flops_per_step" in r]
    (dec,) = [r for r in result["rows"] if "flops_per_call" in r]  # its greedy completion
    # the decode's lean weights: each block's attention RMSNorm scale folded into w_qkv
    assert dec["run"] == "generate (one token)"
    assert row["params"] - dec["params"] == full.model.d_model * 1  # one layer
    assert int(dec["cuda_kernels"]) >= 2 and dec["fits_H100_80GB"] is True  # up and down
    assert row["batch"] == f"2x{full.seq_len}" and row["steps"] == full.train.steps
    # dispatch "auto": the grouped-matmul kernels of up and down, forward, dX and dW
    assert int(row["cuda_kernels"]) >= 6 and int(row["tpu_kernels"]) >= 6, row
    # >= 6 FLOPs per parameter a token reaches (experts: top_k / n_experts of the tokens)
    moe = full.model.moe
    tokens = 2 * full.seq_len
    assert (6 * row["params"] * tokens * moe.top_k / moe.n_experts < row["flops_per_step"]
            < 6 * row["params"] * tokens * 1.5), row
    assert row["fits_H100_80GB"] is True and row["gpu_hours"] > 0


def _lm(slot, layers=2):
    cfg = DecoderConfig(vocab_size=12, d_model=16, n_layers=layers, n_heads=2,
                        ffn_slots=(slot,) * layers, max_seq_len=64)
    return DecoderLM(cfg, rngs=nnx.Rngs(layers))


@pytest.mark.slow
def test_decode_loops_are_captured_as_called_and_proven_with_their_kernels():
    target = _lm(BlockFFNConfig(n_experts=8, d_expert=8))
    draft = _lm(DenseFFNConfig(d_hidden=16, activation="swiglu"), layers=1)
    prompt = jnp.ones((1, 5), jnp.int32)
    spec_target = chunk_sparse_target(target, 4)
    expected = speculative_generate(spec_target, draft, prompt, 8, draft_len=3).tokens_BS
    with capture_steps() as captured:
        got = speculative_generate(spec_target, draft, prompt, 8, draft_len=3).tokens_BS
        sample(target, jnp.ones((2, 5), jnp.int32), jnp.array([5, 3]), 6, key=jax.random.key(0))
        generate(target, prompt, 4)
    np.testing.assert_array_equal(got, expected)  # a captured decode still runs as usual
    assert not any(isinstance(c, CapturedStep) for c in captured)
    assert [c.label for c in captured] == ["speculative n=3", "sample", "generate (one token)"]
    assert all(isinstance(c, CapturedDecode) for c in captured)
    spec, samp, gen = (prove_decode(c) for c in captured)
    n_target = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_params(target)))
    n_draft = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_params(draft)))
    assert spec["params"] == n_target + n_draft and samp["params"] == n_target
    assert (spec["batch"], spec["new_tokens"]) == ("1x5", 8)
    assert (samp["batch"], samp["new_tokens"]) == ("2x5", 6) and gen["batch"] == "1"
    # chunk-sparse verification of one exact chunk: TPU's decode kernels in both BlockFFN
    # layers; a float32 chunk on a GPU is the dense product (moejax.kernels.chunk_union.pallas)
    # layers; a float32 chunk on a GPU is the dense product, so cuda's kernels are the flash
    # attention's (moejax.kernels.flash_attention), one per layer a decode call site runs: target
    # prefill and verification (2 x 2), draft prefill and step (2 x 1); sample's prefill and
    # step (2 x 2); generate's one-token step (2)
    assert int(spec["tpu_kernels"]) >= 2 and spec["cuda_kernels"] == "6", spec
    assert samp["cuda_kernels"] == "4" and gen["cuda_kernels"] == "2", (samp, gen)
    # generate's step takes the lean weights, made before it: each block's attention and
    # BlockFFN norm scales folded into the products (2 blocks x 2 norms of d 16)
    assert gen["params"] == n_target - 2 * 2 * 16
    assert all(r["fits_H100_80GB"] and r["peak_GB"] >= r["weights_GB"] > 0
               for r in (spec, samp, gen))


def test_a_recipe_without_training_or_decoding_is_proven_as_such(tmp_path, monkeypatch):
    """A benchmark that neither trains nor decodes: its recipe runs to its end and the table
    says there was nothing to prove (not an error)."""
    @config
    class Nothing(Config):
        seed: int = 0

    study = Study("nothing", lambda preset: Nothing(), lambda c, r: {})
    monkeypatch.setenv("MOEJAX_SUBSTRATE_DIR", str(tmp_path / "subs"))
    result = _aot(study, tmp_path / "run")
    assert result == {"ok": True, "error": "", "rows": []}
    (row,) = _aot_rows("bench_kernels", result, 1.0, 0.1)
    assert row["run"] == "(none)" and row["result"].startswith("OK: the recipe ran to its end")


def test_a_studys_own_keys_reach_only_that_study_and_are_checked_before_it_runs():
    """``<study>.<key>=<value>`` (e.g. proving only some of a study's arms again) goes to that
    study's run after the cuts and into the depth column; a bad key or value, or a study not
    being run, stops the command before anything starts."""
    names, _, _, mode, overrides, _ = _parse(
        ["mode=aot", "only=ders_upcycling,moee", "ders_upcycling.sm_rates=(0.999,0.9999)"])
    assert names == ["ders_upcycling", "moee"] and mode == "aot"
    assert overrides == {"ders_upcycling": ["sm_rates=(0.999,0.9999)"]}
    (row,) = _aot_rows("ders_upcycling", {"rows": []}, 1.0, 0.1, overrides["ders_upcycling"])
    assert row["depth"] == "sm_rates=(0.999,0.9999)"
    assert _aot_rows("ders_upcycling", {"rows": []}, 1.0, 0.1)[0]["depth"] == "full"
    for bad, match in [(["only=moee", "ders_upcycling.sm_rates=(0.9,)"], "only="),
                       (["only=ders_upcycling", "ders_upcycling.colour=red"], "colour"),
                       (["only=ders_upcycling", "ders_upcycling.sm_rates=abc"], "float"),
                       (["nostudy.x=1"], "bad argument"),
                       (["preset=tiny"], "expected full or quick"),
                       (["devices=two"], "count of CPU devices"),
                       (["mode=aot", "devices=2"], "for mode=smoke"),
                       (["out="], "out= is empty"),  # not the default directory, silently
                       (["only=moee,moee"], "names moee twice"),
                       (["only=moee,"], "holds an empty name")]:
        with pytest.raises(ConfigError, match=match):
            _parse(bad)


def test_an_unusable_out_stops_the_command_in_one_line(tmp_path, capsys):
    """out= naming a file, or a run directory another full_smoke holds, exits 2 with the
    reason before any study starts (not a traceback)."""
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert main([f"out={a_file}", "only=moee"]) == 2
    assert capsys.readouterr().err.startswith(f"error: out={a_file}: {a_file} is a file")
    held = RunLock(tmp_path / "busy").acquire()
    try:
        assert main([f"out={tmp_path / 'busy'}", "only=moee"]) == 2
        assert capsys.readouterr().err.startswith("error: ")
    finally:
        held.release()
    assert a_file.read_text() == "x" and not (tmp_path / "busy" / "summary.md").exists()


@pytest.mark.slow
def test_each_run_is_proven_as_it_starts_and_kept_when_the_recipe_stops(tmp_path, monkeypatch):
    """The report holds a run's proof before the recipe goes on (a study killed later by its
    timeout keeps it); a second run of the same program adds its steps to that row."""
    import json

    @config
    class Toy(Config):
        seed: int = 0

    report = tmp_path / "toy.aot.json"
    seen = []

    def run(cfg, run_dir):
        model = _model()
        train(model, ToySource(batch_size=4), TrainConfig(steps=7, batch_size=4), desc="a")
        seen.append(json.loads(report.read_text()))  # proven before the recipe goes on
        train(model, ToySource(batch_size=4), TrainConfig(steps=5, batch_size=4), desc="b")
        raise RuntimeError("out of time")

    study = Study("toy", lambda preset: Toy(), run)
    monkeypatch.setenv("MOEJAX_SUBSTRATE_DIR", str(tmp_path / "subs"))
    result = _aot(study, tmp_path / "run", report=report)
    ((first,),) = [s["rows"] for s in seen]
    assert first["run"] == "a" and first["steps"] == 7 and int(first["cuda_kernels"]) >= 12
    assert not result["ok"] and result["error"] == "RuntimeError: out of time"
    (row,) = result["rows"]
    assert row["run"] == "a, b" and row["runs"] == 2 and row["steps"] == 12
    assert row["gpu_hours"] == pytest.approx(first["gpu_hours"] * 12 / 7)
    rows = _proven_rows("toy", result)
    assert rows[-1]["result"] == "stopped after 1 captured runs: RuntimeError: out of time"


def test_runs_of_one_loss_are_one_program_and_other_losses_are_others():
    """Distillation methods train the same student at the same shapes, yet are different
    programs (ALL's all-expert teacher, KA's passes): grouped by loss, not by shapes only;
    equal losses (one method's seeds) stay one program."""
    def other_loss(model, batch, key):
        return lm_loss_fn(model, batch, key)

    cfg = TrainConfig(steps=3, batch_size=4)
    with capture_steps(steps=0) as captured:
        for loss in (lm_loss_fn, other_loss, lm_loss_fn):
            train(_model(), ToySource(batch_size=4), cfg, loss_fn=loss)
    keys = [_shapes(c) for c in captured]
    assert keys[0] == keys[2] != keys[1]


def test_decode_calls_group_by_model_structure_not_only_by_shapes():
    """A dense and a chunk-sparse path of one model decode at the same shapes, yet are two
    programs (different kernels): they are proven apart; repeats of one are proven once."""
    target = _lm(BlockFFNConfig(n_experts=8, d_expert=8))
    with capture_steps() as captured:
        for m in (blockffn_path(target, "dense"), blockffn_path(target, "auto", 1),
                  blockffn_path(target, "dense")):
            sample(m, jnp.ones((1, 5), jnp.int32), jnp.array([5]), 4, key=jax.random.key(0))
    keys = [_shapes(c) for c in captured]
    assert keys[0] == keys[2] != keys[1]


@pytest.mark.slow
def test_a_benchmarks_own_train_steps_are_captured_one_program_per_dispatch_path(tmp_path):
    """bench_dispatch times its steps outside the training loop: each path's step is recorded
    at its real shapes, and paths of equal shapes stay apart (different kernels)."""
    cfg = apply_overrides(bench.make_config("quick"), [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.moe.n_experts=4", "model.moe.d_expert=32", "batch_size=2", "seq_len=16",
        "warmup=1", "steps=1", "paths=(capacity,gmm)", "block_tokens=64", "block_d=16",
        "block_f=32", "block_repeats=1", "block_paths=(capacity,)", "delta_tree=none",
        "block_retain_memory=false"])

    run = RunDir.create(tmp_path / "b", cfg, name="bench_dispatch")
    with capture_steps() as captured:
        bench.run(cfg, run)
    run.close()
    steps = [c for c in captured if isinstance(c, CapturedStep)]
    # gmm is a GPU kernel: not timed on a CPU, yet recorded for the proof
    assert [c.program for c in steps] == ["capacity", "gmm"]
    assert jax.tree.leaves(steps[0].batch)[0].shape == (2, 16)
    assert _shapes(steps[0]) != _shapes(steps[1])
    row = prove_step(steps[1], platforms=("cuda",))
    assert int(row["cuda_kernels"]) >= 6 and row["flops_per_step"] > 0, row


@pytest.mark.slow
def test_the_grouped_kernel_paths_are_counted_as_the_work_their_kernels_do():
    """tokamax and gmm lowered for a CPU are a dense fallback and an interpret loop; the
    proof counts them as the grouped expert matmuls, so every dropless kernel path gets the
    same FLOPs and a peak that is not the dense fallback's."""
    rows = {}
    for path in ("grouped", "tokamax", "gmm"):
        cfg = MoELMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                          moe=MoEConfig(n_experts=8, top_k=2, d_expert=32, dispatch=path))
        with capture_steps(steps=0) as captured:
            train(DecoderLM(cfg.decoder_config(), rngs=nnx.Rngs(0)), ToySource(batch_size=8),
                  TrainConfig(steps=10, batch_size=8))
        rows[path] = prove_step(captured[0], platforms=("cuda",))
    for path in ("tokamax", "gmm"):
        assert rows[path]["flops_per_step"] == pytest.approx(rows["grouped"]["flops_per_step"])
        assert rows[path]["peak_GB"] == pytest.approx(rows["grouped"]["peak_GB"], rel=0.05)
    assert int(rows["gmm"]["cuda_kernels"]) >= 6  # the export still holds the kernels


def test_an_abstract_run_is_the_step_the_training_loop_captures():
    """A model built from its config alone (no weights) gives the captured step of the real
    run: the same shapes and program, and the same proven size."""
    cfg = TrainConfig(steps=7, batch_size=4, lr=1e-2)
    with capture_steps(steps=0) as captured:
        train(_model(), ToySource(batch_size=4), cfg, desc="real")
    ghost = abstract_run(_model, cfg, ToySource(batch_size=4).batch(0), label="ghost")
    real = captured[0]
    same = lambda a, b: jax.tree.map(lambda x, y: (x.shape, x.dtype) == (y.shape, y.dtype), a, b)
    assert all(jax.tree.leaves(same(real.state, ghost.state)))
    assert all(jax.tree.leaves(same(real.batch, ghost.batch)))
    assert ghost.program == real.program and ghost.cfg == real.cfg
    a, b = prove_step(real, platforms=()), prove_step(ghost, platforms=())
    assert {k: a[k] for k in ("params", "flops_per_step", "peak_GB", "batch")} == {
        k: b[k] for k in ("params", "flops_per_step", "peak_GB", "batch")}


def _tiny_checkpoints(monkeypatch, *modules):
    """The named real checkpoints replaced by the tiny fixtures' config.json (same families)."""
    import json
    from pathlib import Path

    d = Path(__file__).parent / "fixtures" / "hf_moe"
    tiny = {f"tiny-{f}": json.loads((d / f / "config.json").read_text())
            for f in ("olmoe", "qwen2_moe")}
    for m in modules:
        monkeypatch.setattr(m, "CHECKPOINTS", tiny)
    return d


@pytest.mark.slow
def test_real_checkpoints_are_proven_from_their_config_alone(tmp_path, monkeypatch):
    """``make full-aot`` proves each study's runs on the named checkpoints from their
    config.json alone, beside the recipe's own: the parameters are the imported model's, and
    moe_kd proves the teacher's and student's SFT and every method but SAR's distillation."""
    d = _tiny_checkpoints(monkeypatch, upcycling, moe_kd)
    n = {f: _count(load_hf_moe(d / f)) for f in ("olmoe", "qwen2_moe")}
    cfg = upcycling.make_config("quick").replace(
        substrate=upcycling.SubstrateConfig(seq_len=16), train=TrainConfig(steps=5, batch_size=2))
    runs = upcycling.checkpoint_runs(cfg)
    assert [r.label for r in runs] == [
        f"baseline=hf:tiny-{f} fine-tuned alike (config.json only)" for f in n]
    rows = [prove_step(r, platforms=()) for r in runs]
    assert [r["params"] for r in rows] == list(n.values())
    assert all(r["batch"] == "2x16" and r["steps"] == 5 for r in rows)

    kd = moe_kd.make_config("quick").replace(prompt_len=8, response_len=8, methods=(
        "kd", "sar"), dense_teacher_methods=(), teacher_ks=(), lr_sweep=(), router_lr_sweep=())
    kd_runs = moe_kd.checkpoint_runs(kd)
    assert [r.label.split(": ", 1)[1] for r in kd_runs] == [
        "SFT MoE teacher (config.json only)",
        f"SFT student (config.json only, {kd.student_layers} blocks)",
        "KD (config.json only)"] * 2
    student, distil = (prove_step(r, platforms=()) for r in kd_runs[1:3])
    # the teacher is frozen inside the distillation: the student's parameters are trained
    assert distil["params"] == student["params"] < n["olmoe"]
    assert distil["flops_per_step"] > student["flops_per_step"]  # + the teacher's forward

    @config
    class Nothing(Config):
        seed: int = 0

    study = Study("nothing", lambda preset: Nothing(), lambda c, r: {},
                  checkpoint_runs=lambda c: runs[:1])
    monkeypatch.setenv("MOEJAX_SUBSTRATE_DIR", str(tmp_path / "subs"))
    result = _aot(study, tmp_path / "run")
    assert result["ok"], result
    (row,) = _aot_rows("bench_kernels", result, 1.0, 0.1)  # a name for the depth column
    assert row["run"] == runs[0].label and row["parameters"] and row["result"] == "OK"
    assert row["cuda kernels"] != "" and row["fits one H100 80GB"] == "yes"


def _count(model):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
