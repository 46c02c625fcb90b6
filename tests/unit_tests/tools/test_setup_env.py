"""`tools/setup_env.sh`, which README's two commands run first: in an environment it already set
up for this checkout it installs nothing, and sourced it exports `PYTHON` and leaves the
caller's shell options alone."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
STAMP = Path(sys.prefix) / ".megatron-fsdp-gpt-setup"


def _set_up_here() -> bool:
    """Whether setup_env.sh installed this checkout into this interpreter's environment."""
    digest = hashlib.sha256((REPO / "setup.py").read_bytes()).hexdigest()
    return STAMP.is_file() and STAMP.read_text().strip() == f"{REPO}:{digest}"


pytestmark = pytest.mark.skipif(
    not _set_up_here(), reason="this environment was not set up by tools/setup_env.sh"
)


def _bash(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_set_up_environment_gets_nothing_installed():
    done = _bash("bash tools/setup_env.sh")
    assert done.returncode == 0, done.stderr
    assert "nothing installed" in done.stdout
    assert "installing" not in done.stdout


def test_sourcing_exports_python_and_keeps_the_shells_options():
    done = _bash('set +eu; source tools/setup_env.sh >/dev/null; echo "$-|$PYTHON"')
    assert done.returncode == 0, done.stderr
    options, python = done.stdout.strip().splitlines()[-1].split("|")
    assert "e" not in options and "u" not in options
    assert python == sys.executable
