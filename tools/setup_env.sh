#!/usr/bin/env bash
# Installs the package (editable) and the test dependencies, on a machine that has only Python.
#
# Where: $PYTHON if set; else the active virtual environment; else the repository's own `.venv`,
# created here with --system-site-packages so that a torch already installed (a CUDA build, say)
# is reused instead of downloaded again. torch is installed only when it is not importable.
# Nothing is installed when the environment already holds this checkout with the current
# setup.py's requirements (a stamp file in the environment records the last install).
#
# Usage: `source tools/setup_env.sh` (exports PYTHON for the caller; the caller's shell options
# are left as they are) or `bash tools/setup_env.sh`. Fails (status 1) if an install fails.
_setup_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
  else
    if [[ ! -x "$_setup_repo_root/.venv/bin/python" ]]; then
      echo "[setup] creating $_setup_repo_root/.venv"
      python3 -m venv --system-site-packages "$_setup_repo_root/.venv"
    fi
    PYTHON="$_setup_repo_root/.venv/bin/python"
  fi
fi
export PYTHON

# In a subshell: its strict options do not reach a shell that sources this file.
(
  set -euo pipefail
  repo_root="$_setup_repo_root"
  # The stamp names this checkout and the requirements it was installed with.
  read -r stamp_file stamp_value < <("$PYTHON" - "$repo_root" <<'EOF'
import hashlib, os, sys
with open(os.path.join(sys.argv[1], "setup.py"), "rb") as setup_py:
    digest = hashlib.sha256(setup_py.read()).hexdigest()
print(os.path.join(sys.prefix, ".megatron-fsdp-gpt-setup"), f"{sys.argv[1]}:{digest}")
EOF
  )
  # Prints torch's version; fails unless torch imports and `megatron` is this checkout's.
  check_imports() {
    "$PYTHON" - "$repo_root" <<'EOF'
import os, sys
import megatron, torch
print(f"[setup] torch {torch.__version__}, cuda={torch.cuda.is_available()}")
sys.exit(os.path.dirname(os.path.dirname(megatron.__file__)) != sys.argv[1])
EOF
  }

  if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_value" ]] &&
    check_imports 2>/dev/null; then
    echo "[setup] $PYTHON already holds this checkout and its requirements: nothing installed"
  else
    if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
      echo "[setup] torch not importable: installing it"
      # A pinned CPU build is cached on the project's CI machines; elsewhere any torch>=2.6.
      "$PYTHON" -m pip install -q "torch==2.13.0" || "$PYTHON" -m pip install -q "torch>=2.6"
    fi
    echo "[setup] installing the package (editable) and its test dependencies into $PYTHON"
    "$PYTHON" -m pip install -q -e "${repo_root}[test]"
    check_imports
    echo "$stamp_value" >"$stamp_file" 2>/dev/null || true
  fi
)
