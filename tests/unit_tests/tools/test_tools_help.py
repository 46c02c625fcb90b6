"""Every script in `tools/` answers `--help` with its usage (the benchmarks' support code lives in
the `tools/benchmark_lib/` package, which is not run)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit_tests.program_launcher import run_program

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted(path.name for path in (REPO / "tools").glob("*.py"))

_RUN_EACH_WITH_HELP = """
import contextlib, io, json, runpy, sys
results = {}
sys.path.insert(0, "tools")  # as `python tools/<script>.py` puts it first
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        code = None
    except SystemExit as exit:
        code = exit.code
    results[script] = [code, out.getvalue()]
print(json.dumps(results))
"""
"""Runs each script given as `__main__` with `--help` in one process (torch is imported once);
prints {script: [exit code (None: it returned), its stdout]}."""


def test_every_tool_script_answers_help():
    done = run_program(
        code=_RUN_EACH_WITH_HELP,
        args=[f"tools/{name}" for name in SCRIPTS],
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(SCRIPTS) > 10
    for script, (code, out) in results.items():
        assert code == 0 and out.startswith("usage: "), (script, code, out[:200])
