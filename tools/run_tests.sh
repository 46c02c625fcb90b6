#!/usr/bin/env bash
# Sets up the environment and runs the unit tests (what CI runs). Extra args go to pytest.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
source tools/setup_env.sh  # sets PYTHON
exec "$PYTHON" -m pytest tests/unit_tests -q "$@"
