#!/usr/bin/env bash
# jax's CUDA plugin, the version of the jaxlib $PYTHON imports, in a folder of its own
# (<virtualenv>/gpu-compiler-<version>; idempotent, quick when done): what compiles a program
# for a GPU on a host without one (moejax.bench.gpu_program). No CUDA library comes with it:
# it is never asked to run anything. A process that compiles for the GPU puts the folder on
# its path.
#
# Usage: scripts/install_gpu_compiler.sh   (PYTHON defaults to .venv/bin/python, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# moejax.bench.gpu_program.compiler_path(), read without starting jax
version="$("$PYTHON" -c 'from importlib.metadata import version; print(version("jaxlib"))')"
dest="$("$PYTHON" -c 'import sys; print(sys.prefix)')/gpu-compiler-$version"
if [[ -d "$dest/jax_cuda12_plugin-$version.dist-info" && -d "$dest/jax_cuda12_pjrt-$version.dist-info" ]]; then
  exit 0
fi
rm -rf "$dest"
if ! "$PYTHON" -m pip install -q --no-deps --target "$dest" \
    "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version"; then
  rm -rf "$dest"
  echo "install_gpu_compiler.sh: jax's CUDA plugin $version (jax-cuda12-plugin," \
    "jax-cuda12-pjrt) could not be installed; the plugin must match jaxlib exactly, so" \
    "install a jaxlib it is published for (scripts/dev_constraints.txt pins the one" \
    "\`make setup\` installs)" >&2
  exit 1
fi
