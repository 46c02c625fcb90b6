"""Fixtures of the tools' tests."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[3] / "tools"


@pytest.fixture
def import_tool(monkeypatch) -> Callable[[str], ModuleType]:
    """Imports a script of `tools/` by module name, so that a test of its flags calls its
    `parse_args` here: a usage error then costs no process start (seconds each on CI)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    return importlib.import_module


def usage_error(parse: Callable[[], object], capsys) -> str:
    """What `parse` (a tool's `parse_args`) writes to stderr as it exits with a usage error
    (argparse's code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse()
    assert exit_info.value.code == 2
    return capsys.readouterr().err
