#!/usr/bin/env bash
# Installs what the project needs into the current Python, on a machine that has only Python.
# torch is installed only when it is not importable already (a CUDA build already present is
# kept). Usage: source tools/setup_env.sh  (sets PYTHON), or bash tools/setup_env.sh.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] torch not importable: installing it"
  # A pinned CPU build is cached on the project's CI machines; elsewhere take any torch>=2.6.
  "$PYTHON" -m pip install -q "torch==2.13.0" || "$PYTHON" -m pip install -q "torch>=2.6"
fi
"$PYTHON" -m pip install -q -e "${repo_root}[test]"
"$PYTHON" -c "import torch, megatron
print(f'[setup] torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
