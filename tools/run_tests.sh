#!/usr/bin/env bash
# Sets up the environment and runs the unit tests (what CI runs). Extra args go to pytest.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
source tools/setup_env.sh  # sets PYTHON
# Two test processes (pytest-xdist), each test file in one of them: a process waits on its own
# ranks' collectives and on the programs it starts, which leaves a core idle a third of the time
# in a single process on two cores. Pass `-n N` to change the count (`-n 0`: one process).
exec "$PYTHON" -m pytest tests/unit_tests -q -n 2 --dist loadfile "$@"
