#!/usr/bin/env bash
# README's main-job command: set up, then train a tiny GPT on 2 ranks (CPU gloo, or GPUs).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
PYTHON="${PYTHON:-python3}"
bash tools/setup_env.sh
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
  examples/quick_start_ddp.py "$@"
