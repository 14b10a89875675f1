#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter for the virtualenv, or exit 1 with one line
# saying what to install. Tried in order: $PYTHON, python3.13 / python3.12 / python3 on PATH,
# then pyenv's installed 3.12+ versions (pyenv shims of a version that is not active are
# skipped: they fail to run).
set -uo pipefail

ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

if [[ -n "${PYTHON:-}" ]]; then
  if ok "$PYTHON"; then command -v "$PYTHON"; exit 0; fi
  echo "error: PYTHON=$PYTHON is not a Python >= 3.12; unset it or point it at one" >&2
  exit 1
fi
for cand in python3.12 python3.13 python3; do
  if command -v "$cand" >/dev/null && ok "$cand"; then
    "$cand" -c 'import sys; print(sys.executable)'; exit 0
  fi
done
if command -v pyenv >/dev/null; then
  root="$(pyenv root)"
  for dir in $(ls -d "$root"/versions/3.* 2>/dev/null | sort -V); do
    for exe in "$dir"/bin/python3.12 "$dir"/bin/python3.13 "$dir"/bin/python3; do
      if [[ -x "$exe" ]] && ok "$exe"; then echo "$exe"; exit 0; fi
    done
  done
fi
echo "error: moejax needs Python >= 3.12 (jax 0.12) and none was found; install python3.12 (e.g. 'apt-get install python3.12-venv' or 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
