#!/usr/bin/env bash
# The wheels a CUDA machine without a package registry needs beside its own jax, flax, optax,
# orbax, chex and torch: tokamax with what importing it pulls in, and tensorflow-datasets (the
# studies' data layer) with what building and reading its array_record datasets needs
# (array-record, dm-tree and theirs), for CPython 3.12 on x86-64 Linux; floor/ holds
# flax, optax, chex and orbax-checkpoint for an image whose own are outside pyproject.toml's
# ranges (scripts/unmet_deps.py). These versions ran the GPU checks on an H200 with jax
# 0.11.2. Run it where pip reaches a registry, carry DIR to the GPU machine, then:
# WHEELHOUSE=DIR scripts/gpu_check.sh OUT_DIR
# Usage: scripts/gpu_wheelhouse.sh DIR
set -euo pipefail
dir=${1:?usage: scripts/gpu_wheelhouse.sh DIR}
py=${PYTHON:-python3}
mkdir -p "$dir/floor"
get() {  # binary wheels for the target, no dependencies (each one is listed)
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$@"
}
get "$dir" tokamax==0.0.17 xprof==2.24.2 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 fire==0.7.1 termcolor==3.3.0 protobuf==7.36.2 \
  tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0 toml==0.10.2 \
  array-record==0.8.6 dm-tree==0.1.10 wrapt==2.5.2 attrs==26.1.0
"$py" -m pip wheel -q --no-deps -w "$dir" promise==2.3  # an sdist only: built here
get "$dir/floor" flax==0.12.12 optax==0.2.8 chex==0.1.92 orbax-checkpoint==0.12.8
du -sh "$dir"
