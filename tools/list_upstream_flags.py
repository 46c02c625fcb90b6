"""Lists every option string of upstream Megatron-LM's training parser, from its source by AST.

    UPSTREAM=/path/to/Megatron-LM/.git  # a bare mirror works as well
    python tools/list_upstream_flags.py --git-dir $UPSTREAM \
        > tests/unit_tests/training/fixtures/upstream_flags.txt

Upstream's `megatron/training/arguments.py` defines its flags with literal
`group.add_argument('--flag', ...)` calls and with `ArgumentGroupFactory(SomeConfig)` groups that
make a flag of each dataclass field; `tools/compare_flag_defaults.py` reads both, and this tool
prints each option string it finds (aliases and the factory's `--no-*` / `--disable-*` forms
included), one a line, with `switch` (the flag takes no value) or `value`. The header records
upstream's commit, so `test_upstream_flags.py` checks this parser against a named upstream
version without a copy of upstream at test time. Nothing of upstream is imported: both projects
are named `megatron`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.compare_flag_defaults import ConfigSources, upstream_flags  # noqa: E402

_ARGUMENTS_PY = "megatron/training/arguments.py"


def _git(git_dir: str, *command: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *command], capture_output=True, text=True, check=True
    ).stdout


def option_strings(git_dir: str, rev: str = "HEAD") -> tuple[str, list[tuple[str, bool]]]:
    """Upstream's commit at `rev` and its option strings, each with whether it takes a value.

    Raises:
        RuntimeError: a dataclass of an `ArgumentGroupFactory` is not found (its flags would be
            missing from the list).
    """
    commit = _git(git_dir, "rev-parse", rev).strip()
    with tempfile.TemporaryDirectory() as folder:
        arguments = Path(folder) / "arguments.py"
        arguments.write_text(_git(git_dir, "show", f"{commit}:{_ARGUMENTS_PY}"))
        flags, unresolved = upstream_flags(arguments, ConfigSources([], git_dir, commit))
    if unresolved:
        raise RuntimeError(f"dataclasses not found in {commit}: {', '.join(unresolved)}")
    switches = ("store_true", "store_false", "store_const", "count")
    listed: dict[str, bool] = {}
    for flag in flags:
        for name in flag.names:
            listed.setdefault(name, flag.action not in switches and flag.nargs != 0)
    return commit, sorted(listed.items())


def main(argv: list[str] | None = None) -> int:
    """Prints the list (header, then `--flag switch|value` lines); returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git-dir", required=True, help="upstream Megatron-LM's git directory")
    parser.add_argument("--rev", default="HEAD", help="the upstream revision to read")
    options = parser.parse_args(argv)
    commit, listed = option_strings(options.git_dir, options.rev)
    print(f"# Every option string of upstream Megatron-LM's {_ARGUMENTS_PY}")
    print(f"# upstream commit: {commit}")
    print("# made by: python tools/list_upstream_flags.py --git-dir UPSTREAM_GIT_DIR")
    print(f"# {len(listed)} option strings; `switch` takes no value, `value` takes one or more")
    for name, takes_value in listed:
        print(f"{name} {'value' if takes_value else 'switch'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
