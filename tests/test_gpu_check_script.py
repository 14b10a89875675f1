"""scripts/gpu_check.sh's stages call the benchmark each names with its arguments, mark a passed
stage done (packed into PACK), skip a done stage on the next run, skip a stage that BUDGET
leaves no time for and refuse an unknown stage (a stand-in python records the calls; no GPU
needed)."""

import os
import stat
import subprocess
import tarfile
from pathlib import Path

from moejax.harness.cli import parse_runner

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *stages, exit_code: int = 0, **env_vars):
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n'  # and, asked for flags, one
                    '[[ "$*" == *with_flags* ]] && echo "--xla_gpu_enable_command_buffer=+WHILE"\n'
                    f'[ -n "${{XLA_FLAGS:-}}" ] && echo "  XLA_FLAGS=$XLA_FLAGS" >> {log}\n'
                    f'[[ "$*" == -m* ]] && exit {exit_code}\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the suite's own
    env.update(PYTHON=str(fake), **env_vars)
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), str(tmp_path / "out"),
                           *stages], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    # the benchmarks (each with the XLA_FLAGS it ran under, if any), not the probes
    return proc, [c for c in lines if c.startswith(("-m ", "  XLA_FLAGS"))]


def test_stages_call_their_benchmark_and_resume(tmp_path):
    proc, calls = _run(tmp_path, "grouped_f32", "speculative")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert calls == [
        f"-m experiments.benchmarks.grouped preset=full variant=f32 out={out}/bench_grouped_f32",
        f"-m experiments.blockffn.speculative preset=full variant=short "
        f"out={out}/bench_speculative"]
    assert (out / ".done-grouped_f32").exists() and (out / ".done-speculative").exists()
    _, again = _run(tmp_path, "grouped_f32")
    assert again == calls  # done: not called again


def test_an_unknown_stage_is_refused(tmp_path):
    proc, calls = _run(tmp_path, "grouped_f64")
    assert proc.returncode != 0 and "unknown stage 'grouped_f64'" in proc.stderr
    assert calls == []


def test_a_misspelt_stage_late_in_the_list_is_refused_before_any_stage_runs(tmp_path):
    """A typo after good stages ends the command before the first of them, not after they
    have spent a lent machine's minutes; the refusal lists the stages."""
    proc, calls = _run(tmp_path, "grouped", "decoding", "speculatve_wide_nk", "full_moee")
    assert proc.returncode == 2 and "unknown stage 'speculatve_wide_nk'" in proc.stderr
    assert " speculative_wide_nk " in proc.stderr and "full_STUDY" in proc.stderr
    assert calls == [] and not (tmp_path / "out").exists()
    # every stage the loop knows passes the check (the stand-in python makes each a no-op)
    stages = ("tests decode_tests autotune grouped grouped_f32 kernels dispatch "
              "dispatch_xla_attention speculative speculative_quick speculative_wide "
              "speculative_wide_graphs speculative_wide_nk speculative_wide_fused extracted "
              "train_step full_moee").split()
    proc, _ = _run(tmp_path, *stages)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob(".done-*")) == sorted(
        f".done-{s}" for s in stages)


def test_the_autotune_stage_tunes_the_full_presets_shapes_and_budget_skips_late_stages(tmp_path):
    ckpt = tmp_path / "out" / "bench_speculative_wide" / "target" / "checkpoints" / "200"
    ckpt.mkdir(parents=True)  # a trained model from an earlier stage
    (ckpt / "state").write_text("weights")
    proc, calls = _run(tmp_path, "autotune", PACK=str(tmp_path / "gpu.tgz"),
                       ALL_PACK=str(tmp_path / "all.tgz"))
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tmp_path / "gpu.tgz") as tar:  # packed after the stage, no checkpoints
        assert "out/.done-autotune" in tar.getnames()
        # the ops' tuned files come back with it
        assert ("out/autotune/tuned/moejax/kernels/chunk_union/tuned/NVIDIA_H200.json"
                in tar.getnames())
        assert not any("checkpoints" in name for name in tar.getnames())
    with tarfile.open(tmp_path / "all.tgz") as tar:  # everything
        assert "out/bench_speculative_wide/target/checkpoints/200/state" in tar.getnames()
    assert calls == [f"-m experiments.benchmarks.autotune kernels=(decode_mgpu,gmm,tgmm) "
                     f"dtypes=(bfloat16,) "
                     f"shapes=((2048,1408),(1408,2048)) decode_shapes=((2048,256),) "
                     f"out={tmp_path}/out/autotune"]
    late = tmp_path / "late"
    late.mkdir()
    proc, calls = _run(late, "grouped", BUDGET="30")
    assert proc.returncode != 0 and calls == []
    assert "grouped: skipped" in proc.stderr and "BUDGET" in proc.stderr
    assert not (late / "out" / ".done-grouped").exists()


def test_the_quick_speculative_stage_starts_from_seeded_checkpoints(tmp_path):
    seed = tmp_path / "seed" / "bench_speculative_quick" / "target"
    seed.mkdir(parents=True)
    (seed / "ckpt.bin").write_text("trained elsewhere")
    proc, calls = _run(tmp_path, "speculative_quick", SEED=str(tmp_path / "seed"))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" / "bench_speculative_quick"
    assert calls == [f"-m experiments.blockffn.speculative preset=quick variant=bf16 "
                     f"out={out}"]
    assert (out / "target" / "ckpt.bin").read_text() == "trained elsewhere"
    proc, calls = _run(tmp_path, "speculative_wide")
    assert proc.returncode == 0, proc.stderr
    assert calls[-1] == (f"-m experiments.blockffn.speculative preset=quick variant=wide_bf16 "
                         f"out={out.parent}/bench_speculative_wide")


def test_a_full_stage_runs_that_studys_full_preset(tmp_path):
    proc, calls = _run(tmp_path, "full_lm_demo")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"-m experiments.main only=lm_demo preset=full out={tmp_path}/out/full"]
    assert (tmp_path / "out" / ".done-full_lm_demo").exists()


def test_autotune_kernels_names_what_the_autotune_stage_tunes(tmp_path):
    proc, calls = _run(tmp_path, "autotune", AUTOTUNE_KERNELS="gmm,tgmm")
    assert proc.returncode == 0, proc.stderr
    assert calls[0].startswith(
        "-m experiments.benchmarks.autotune kernels=(gmm,tgmm) dtypes=(bfloat16,)")


def test_the_kernels_stage_times_the_paths_its_targets_are_judged_on(tmp_path):
    proc, calls = _run(tmp_path, "kernels")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"-m experiments.blockffn.kernels preset=full variant=judged "
                     f"out={tmp_path}/out/bench_kernels"]


def test_the_graphs_stage_decodes_the_wide_models_again_under_command_buffer_flags(tmp_path):
    """speculative_wide_graphs: the same benchmark call as speculative_wide, from the
    checkpoints that stage trained, with each decoding loop compiled with command buffers
    (command_buffers=true: per function, no process-wide XLA_FLAGS); dispatch_xla_attention:
    bench_dispatch's full preset on XLA's attention."""
    wide = tmp_path / "out" / "bench_speculative_wide"
    for m in ("target", "self_distilled"):
        (wide / m).mkdir(parents=True)
        (wide / m / "ckpt.bin").write_text(m)
    (wide / "decode.csv").write_text("the wide stage's own table")
    proc, calls = _run(tmp_path, "speculative_wide_graphs", "dispatch_xla_attention",
                       "speculative_wide_nk", "speculative_wide_fused")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" / "bench_speculative_wide_graphs"
    nk = tmp_path / "out" / "bench_speculative_wide_nk"
    fused = tmp_path / "out" / "bench_speculative_wide_fused"
    assert calls == [f"-m experiments.blockffn.speculative preset=quick "
                     f"variant=wide_bf16_graphs out={out}",
                     f"-m experiments.benchmarks.dispatch preset=full variant=xla_attention "
                     f"out={tmp_path / 'out' / 'bench_dispatch_xla_attention'}",
                     # the products' weights transposed, from the same checkpoints
                     f"-m experiments.blockffn.speculative preset=quick "
                     f"variant=wide_bf16_nk out={nk}",
                     # and with the one-token steps' attention input fused
                     f"-m experiments.blockffn.speculative preset=quick "
                     f"variant=wide_bf16_nk_fused out={fused}"]
    for d in (out, nk, fused):
        assert sorted(p.name for p in d.iterdir()) == ["self_distilled", "target"]
        assert (d / "target" / "ckpt.bin").read_text() == "target"


def test_a_failed_autotune_is_not_marked_done(tmp_path):
    proc, calls = _run(tmp_path, "autotune", exit_code=1)
    assert proc.returncode != 0 and "stage autotune failed" in proc.stderr
    assert calls and not (tmp_path / "out" / ".done-autotune").exists()


BENCH_STAGES = ("grouped", "grouped_f32", "kernels", "dispatch", "dispatch_xla_attention",
                "speculative", "speculative_quick", "speculative_wide",
                "speculative_wide_graphs", "speculative_wide_nk", "speculative_wide_fused",
                "extracted", "train_step")


def test_every_benchmark_stage_runs_a_preset_or_a_declared_variant(tmp_path):
    """No stage overrides a config key, so each run is published in the GPU's results
    document (a run with an overridden key is a trial, listed by command only); each variant
    a stage names is declared by its benchmark, and its overrides are that config's keys."""
    import importlib

    proc, calls = _run(tmp_path, *BENCH_STAGES)
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == len(BENCH_STAGES)
    for call in calls:
        module, *args = call.split()[1:]
        keys = {a.partition("=")[0] for a in args}
        assert keys <= {"preset", "variant", "out"}, call
        study = importlib.import_module(module).STUDY
        variant = dict(a.partition("=")[::2] for a in args).get("variant")
        if variant is None:
            continue
        overrides = dict(study.all_variants)[variant]
        preset = next(a for a in args if a.startswith("preset="))
        parse_runner(study.name, study.make_config, [preset, *overrides], 1, ())  # or raises


def test_the_decoding_group_measures_the_lean_decode_step_and_the_flash_kernel(tmp_path):
    proc, calls = _run(tmp_path, "decoding")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert calls == [
        f"-m experiments.blockffn.speculative preset=quick variant=wide_bf16 "
        f"out={out}/bench_speculative_wide",
        f"-m experiments.blockffn.speculative preset=quick variant=wide_bf16_nk "
        f"out={out}/bench_speculative_wide_nk",
        f"-m experiments.blockffn.speculative preset=quick variant=wide_bf16_nk_fused "
        f"out={out}/bench_speculative_wide_fused",
        # the measurements first, their tests last (what a BUDGET leaves out is the tests)
        f"-m experiments.blockffn.speculative preset=quick variant=wide_bf16_graphs "
        f"out={out}/bench_speculative_wide_graphs",
        f"-m experiments.benchmarks.dispatch preset=full variant=train_step "
        f"out={out}/bench_train_step",
        "-m pytest -q -p no:cacheprovider -n 4 tests/test_kernels_chunk_decode_gpu.py "
        "tests/test_attention_impls.py tests/test_lean_decode.py tests/test_decode_qkv.py "
        "tests/test_decode_ffn.py tests/test_decode_route.py"]
    assert sorted(p.name for p in out.glob(".done-*")) == [
        ".done-decode_tests", ".done-speculative_wide", ".done-speculative_wide_fused",
        ".done-speculative_wide_graphs", ".done-speculative_wide_nk", ".done-train_step"]
