#!/usr/bin/env bash
# The GPU checks with whatever python has jax with CUDA (PYTHON, default python3): no virtual
# environment, nothing downloaded. WHEELHOUSE=DIR (scripts/gpu_wheelhouse.sh) installs the
# wheels there into a folder of their own first (its floor/ ones only where the image's
# flax, optax, chex or orbax-checkpoint is missing or outside pyproject.toml's range:
# scripts/unmet_deps.py). Stages (default: all):
#   tests        the kernel, dispatch and layer tests with the kernels compiled for the GPU,
#                and the timers' (the device loop runs a call in every iteration there too)
#                (f32 dots at full precision, so the oracles' f32 tolerances apply; the CPU
#                platform beside the GPU for the cases that run a kernel interpreted)
#   decode_tests the chunk-union decode kernel's compiled tests, the attention kernels, the
#                lean decode step and its fused attention and FFN inputs against their oracles,
#                compiled for the GPU (as tests)
#   autotune     python -m experiments.benchmarks.autotune for the decode kernel and the bf16
#                grouped products at the full presets' shapes: each configuration checked against an
#                oracle, the fastest written to moejax/kernels/<op>/tuned/<device kind>.json
#                (copied to OUT_DIR/autotune/tuned/, so they come back with the stage)
#                (AUTOTUNE_KERNELS=gmm_mgpu,tgmm_mgpu: only those kernels;
#                AUTOTUNE_SHAPES="(2048,1408),": only those grouped shapes (K, N);
#                AUTOTUNE_DECODE_SHAPES="(2048,256),": the decode kernel's (D, F))
#   grouped | grouped_f32 | kernels | dispatch | speculative | extracted
#                that benchmark's full preset -> $OUT_DIR/<bench>/ (tables name the device;
#                grouped_f32: bench_grouped's variant f32, float32 where tokamax does not apply;
#                kernels: the paths and union sizes the decode and Pallas targets are judged on,
#                its variant judged, the decode kernel profiled);
#                speculative times 4 prompts of 128 new tokens at draft lengths 2 and 4 (its
#                variant short; the full preset's 16 x 256 at 2, 4, 6 decode a 2.0B-parameter
#                target for longer than one command may run) and keeps its trained target and draft as
#                checkpoints and each decoding it timed (measured_<target>.json), so a stage
#                stopped by STAGE_LIMIT resumes without training or timing anything again
#   speculative_quick | speculative_wide
#                bench_speculative's quick models (the trained target grown to 104M
#                parameters; _wide: the wide ones, width 256, on the decode kernel's blocks,
#                the grown target's decodings only) decoded in bfloat16 at draft length 4
#                (fewer decodes to compile): its variants bf16 and wide_bf16
#   speculative_wide_graphs
#                speculative_wide again (from its trained checkpoints when that stage ran),
#                each decoding loop compiled with XLA's command buffers (CUDA graphs) also
#                taking while loops and conditionals (command_buffers=true: per function,
#                where this XLA has the options; the command_buffers column says which ran):
#                a decoding's whole loop launched as one graph, against the stage above,
#                whose loop the host steps (its variant wide_bf16_graphs)
#   speculative_wide_nk
#                speculative_wide again (from its trained checkpoints when that stage ran),
#                the lean decode step's product weights transposed (decode_layout=nk: each
#                one-row product a row reduction, not a column reduction), against the
#                modules' layout of speculative_wide (its variant wide_bf16_nk)
#   speculative_wide_fused
#                speculative_wide_nk again (from speculative_wide's checkpoints when that
#                stage ran), each step's attention input and each one-token step's FFN
#                input as one kernel each (decode_fused=true: moejax.kernels.decode_qkv and
#                decode_ffn), against speculative_wide_nk (its variant wide_bf16_nk_fused)
#   dispatch_xla_attention
#                bench_dispatch's full preset with XLA's attention (its variant
#                xla_attention), against the dispatch stage's, which trains on tokamax's
#                flash kernel
#   train_step   bench_dispatch's full-preset train step alone, on one path (gmm), timed on
#                the flash kernel and on XLA's attention in one run (its variant train_step)
#   decoding     stands for speculative_wide speculative_wide_nk speculative_wide_fused
#                speculative_wide_graphs train_step decode_tests: the lean decode step's and
#                the flash kernel's measurements first (on an H200 speculative_wide took
#                255 s, 189 s of it decoding, which the nk, fused and graphs stages repeat
#                from its checkpoints;
#                train_step 61 s), their kernels' tests last;
#                with BUDGET=570 the tests may be left to a second command (the stages done
#                are skipped there)
#   full_STUDY   that study's full preset (python -m experiments.main only=STUDY
#                preset=full) -> $OUT_DIR/full/; its training checkpoints let a stage stopped
#                by STAGE_LIMIT resume where it stopped. Data comes from MOEJAX_DATA_DIR (a
#                copy of ~/.cache/moejax/tfds carried with the tree: the machine builds none)
# Every stage's run is its benchmark's preset, or its preset with one of the variants the
# benchmark declares, so python -m experiments.results_doc machine=gpu publishes each in
# docs/results_gpu.md (a run with a key overridden is a trial, listed by command only).
# SEED=DIR: a stage's output folder starts as a copy of DIR/<its folder> (e.g. the trained
#   target/ and draft/ checkpoints of a run of the same configuration made on a CPU), so a
#   lent machine's minutes go to the measurements; the checkpoints are verified when restored
#   (speculative_wide's: python -m experiments.blockffn.speculative variant=wide_bf16
#   n_prompts=1 max_new_tokens=8 out=DIR/bench_speculative_wide on a CPU trains them).
# Each stage runs under STAGE_LIMIT seconds (default 570, inside a 10-minute command limit)
# and leaves OUT_DIR/.done-<stage> when it passes; running the script again skips those
# stages (REDO=1 runs them again), so an interrupted check resumes where it stopped.
# BUDGET=s bounds the stages together: each gets at most what is left of it (less 10 s), and
# a stage with under 40 s left is skipped, so one command of a lent machine ends in time and
# the stages it reached are done.
# PACK=FILE.tgz writes OUT_DIR packed into FILE after every stage (a machine that is given
# back keeps nothing else): the results, without the trained models' checkpoints and profiler
# traces, so the archive stays small enough to come back; ALL_PACK=FILE.tgz packs everything
# (the checkpoints, to SEED a later check), beside it.
# Usage: [WHEELHOUSE=DIR] [STAGE_LIMIT=s] [BUDGET=s] [PACK=f.tgz] [ALL_PACK=f.tgz] [SEED=DIR]
#        [REDO=1]
#        [AUTOTUNE_KERNELS=k1,k2] [AUTOTUNE_SHAPES="(k,n),..."]
#        [AUTOTUNE_DECODE_SHAPES="(d,f),..."]
#        scripts/gpu_check.sh OUT_DIR [stage ...]
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [stage ...]}
shift
stages=${*:-tests autotune grouped grouped_f32 kernels dispatch speculative_quick extracted}
stages=${stages//decoding/speculative_wide speculative_wide_nk speculative_wide_fused speculative_wide_graphs train_step decode_tests}
# every stage name checked before anything runs: a misspelt one late in the list would
# otherwise end the command after the stages before it had spent a lent machine's minutes
known=" tests decode_tests autotune grouped grouped_f32 kernels dispatch dispatch_xla_attention \
speculative speculative_quick speculative_wide speculative_wide_graphs speculative_wide_nk \
speculative_wide_fused extracted train_step "
for stage in $stages; do
  [[ "$known" == *" $stage "* || "$stage" == full_?* ]] || {
    echo "gpu_check: unknown stage '$stage'; stages:$known""decoding full_STUDY" >&2; exit 2; }
done
py=${PYTHON:-python3}
site=
if [ -n "${WHEELHOUSE:-}" ]; then
  site=$(mktemp -d /tmp/moejax-site.XXXX)
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$WHEELHOUSE"/*.whl || { echo "gpu_check: installing $WHEELHOUSE failed" >&2; exit 1; }
  # the image's flax, optax, chex and orbax-checkpoint outside pyproject.toml's ranges
  old=$("$py" scripts/unmet_deps.py flax optax chex orbax_checkpoint) || exit 1
  for name in $old; do
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      "$WHEELHOUSE"/floor/"$name"-*.whl || exit 1
  done
fi
export PYTHONPATH=${site:+$site:}$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$out"
"$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null ||
  { echo "gpu_check: jax sees no GPU here" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
"$py" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, jax.devices())"
status=0
end=$(( $(date +%s) + ${BUDGET:-100000} ))
for stage in $stages; do
  if [ -f "$out/.done-$stage" ] && [ -z "${REDO:-}" ]; then
    echo "== $stage: passed before ($out/.done-$stage), skipped"; continue
  fi
  limit=${STAGE_LIMIT:-570}
  left=$(( end - $(date +%s) ))
  if [ "$left" -lt 40 ]; then
    echo "== $stage: skipped, ${left} s of BUDGET left" >&2; status=1; continue
  fi
  [ "$limit" -gt $(( left - 10 )) ] && limit=$(( left - 10 ))
  echo "== $stage (at most ${limit} s)"
  case $stage in
    tests)
      JAX_PLATFORMS=cuda,cpu JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$limit" \
        "$py" -m pytest -q \
        -p no:cacheprovider -n 4 \
        tests/test_kernels_gmm.py tests/test_ragged_dot.py tests/test_kernels_pair_matmul.py \
        tests/test_kernels_chunk_union.py tests/test_kernels_chunk_decode_gpu.py \
        tests/test_kernels_pairs_gpu.py tests/test_kernels_gmm_mgpu.py \
        tests/test_dispatch.py tests/test_blockffn.py tests/test_speculative.py \
        tests/test_moe_layer.py tests/test_bench_utils.py 2>&1 | tee "$out/tests.log" |
        grep -E "^(FAILED|ERROR)|passed|failed" ;;
    decode_tests)
      JAX_PLATFORMS=cuda,cpu JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$limit" \
        "$py" -m pytest -q -p no:cacheprovider -n 4 tests/test_kernels_chunk_decode_gpu.py \
        tests/test_attention_impls.py tests/test_lean_decode.py tests/test_decode_qkv.py \
        tests/test_decode_ffn.py tests/test_decode_route.py 2>&1 |
        tee "$out/decode_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" ;;
    autotune)
      timeout "$limit" "$py" -m experiments.benchmarks.autotune \
        "kernels=(${AUTOTUNE_KERNELS:-decode_mgpu,gmm,tgmm})" \
        "dtypes=(bfloat16,)" "shapes=(${AUTOTUNE_SHAPES:-(2048,1408),(1408,2048)})" \
        "decode_shapes=(${AUTOTUNE_DECODE_SHAPES:-(2048,256),})" \
        out="$out/autotune" 2>&1 | tee "$out/autotune.log" | grep -v "it/s" | tail -12
      st=${PIPESTATUS[0]}
      # the ops' tuned files come back with the stage's output (for the checkout)
      mkdir -p "$out/autotune/tuned" && cp --parents moejax/kernels/*/tuned/*.json \
        "$out/autotune/tuned/" 2>/dev/null
      (exit "$st") ;;
    grouped|grouped_f32|kernels|dispatch|dispatch_xla_attention|speculative|\
    speculative_quick|speculative_wide|speculative_wide_graphs|speculative_wide_nk|\
    speculative_wide_fused|extracted|train_step)
      args=(preset=full)
      flags=${XLA_FLAGS:-}
      bench=${stage%_f32}
      bench=${bench%_graphs}
      bench=${bench%_nk}
      bench=${bench%_fused}
      bench=${bench%_quick}
      bench=${bench%_wide}
      bench=${bench%_xla_attention}
      [ "$bench" = train_step ] && bench=dispatch
      case $stage in  # the benchmark's declared variant this stage runs
        grouped_f32) args+=(variant=f32) ;;
        dispatch_xla_attention) args+=(variant=xla_attention) ;;
        train_step) args+=(variant=train_step) ;;
        kernels) args+=(variant=judged) ;;
        speculative) args+=(variant=short) ;;
        speculative_quick) args=(preset=quick variant=bf16) ;;
        speculative_wide) args=(preset=quick variant=wide_bf16) ;;
        speculative_wide_graphs) args=(preset=quick variant=wide_bf16_graphs) ;;
        speculative_wide_nk) args=(preset=quick variant=wide_bf16_nk) ;;
        speculative_wide_fused) args=(preset=quick variant=wide_bf16_nk_fused) ;;
      esac
      if [ "$stage" != speculative_wide ] && [ "${stage#speculative_wide}" != "$stage" ]; then
        for m in target draft distilled self_distilled; do
          [ -d "$out/bench_speculative_wide/$m" ] && mkdir -p "$out/bench_$stage" &&
            cp -rn "$out/bench_speculative_wide/$m" "$out/bench_$stage/"
        done
      fi
      if [ -n "${SEED:-}" ] && [ -d "$SEED/bench_$stage" ]; then
        mkdir -p "$out/bench_$stage" && cp -rn "$SEED/bench_$stage/." "$out/bench_$stage/"
        # its checkpoints and measurements are reused; its record is not this run's
        rm -f "$out/bench_$stage/run.json"
      fi
      case $bench in  # the benchmark's module: with its paper, or the MoE FFN op's
        kernels|speculative) module=experiments.blockffn.$bench ;;
        extracted) module=experiments.extraction.bench ;;
        *) module=experiments.benchmarks.$bench ;;
      esac
      XLA_FLAGS=$flags timeout "$limit" "$py" -m "$module" "${args[@]}" \
        out="$out/bench_$stage" 2>&1 | tee "$out/bench_$stage.log" | grep -v "it/s" | tail -25 ;;
    full_*)
      timeout "$limit" "$py" -m experiments.main only="${stage#full_}" preset=full \
        out="$out/full" 2>&1 | tee "$out/$stage.log" | grep -v "it/s" | tail -25 ;;
    *) echo "gpu_check: unknown stage '$stage'" >&2; exit 2 ;;
  esac
  if [ "${PIPESTATUS[0]}" = 0 ]; then
    touch "$out/.done-$stage"
  else
    echo "gpu_check: stage $stage failed or ran past ${limit} s" >&2; status=1
  fi
  # OUT_DIR packed after every stage, so what a killed command reached is there
  [ -n "${PACK:-}" ] && tar czf "$PACK" --exclude=checkpoints --exclude='*.xplane.pb' \
    --exclude='*.trace.json.gz' -C "$(dirname "$out")" "$(basename "$out")"
  [ -n "${ALL_PACK:-}" ] && tar czf "$ALL_PACK" -C "$(dirname "$out")" "$(basename "$out")"
done
exit $status
