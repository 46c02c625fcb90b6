"""The command lines of the docs' bash blocks name scripts that exist, with flags those take.

Nothing trains: `pretrain_gpt.py`'s flags, and those an `examples/` launch script hands on to it
after its own positional arguments, are parsed by its parser, values included; a `tools/*.py`
command's flags must be among the options its `--help` lists (its subcommand's, where it has
subcommands). In a command, `...` stands for flags left out and a shell expansion (`"$VAR"`,
`"${flags[@]}"`) for a flag's value, or for flags left out where no flag precedes it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass

import pytest

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.docs.doc_blocks import REPO, code_blocks
from tests.unit_tests.program_launcher import run_program

SHELL_LANGUAGES = ("bash", "sh", "shell")
SEPARATORS = ("|", "||", "&&", ";")
OPTION = re.compile(r"--[A-Za-z0-9][\w-]*")

# Runs each tool as `python tools/NAME.py ARGS --help` would, in one process (one torch import),
# and prints each help text (or error) as JSON.
HELP_SCRIPT = """
import contextlib, io, json, runpy, sys, traceback
texts = {}
for key, path, args in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = [path, *args, "--help"]
    sys.path[0] = path.rsplit("/", 1)[0]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as done:
            out.write(f"\\nexit status {done.code}")
        except Exception:
            out.write(traceback.format_exc())
    texts[key] = out.getvalue()
print(json.dumps(texts))
"""


@dataclass(frozen=True)
class Command:
    """A command line of a docs bash block that runs a script of this repository.

    Attributes:
        where: `doc:line` of the command (of its first line, where it continues over several).
        script: the script as written (`pretrain_gpt.py`, `tools/convert_hf.py`).
        args: the words after it.
    """

    where: str
    script: str
    args: tuple[str, ...]

    @property
    def text(self) -> str:
        return shlex.join([self.script, *self.args])


def _script_index(words: list[str]) -> int | None:
    """Where the script is among a command's words (after launchers and their flags); None when
    the command runs a module or inline code instead (`python -m pytest`, `python -c ...`)."""
    for index, word in enumerate(words):
        if word in ("-c", "-m") and words[index + 1 : index + 2] != ["torch.distributed.run"]:
            return None
        if word.endswith((".py", ".sh")) and not word.startswith("-"):
            return index
    return None


def _shell_lines(body: str, first: int) -> list[tuple[int, str]]:
    """The lines of a shell block with their continuations joined, each with its line number."""
    lines: list[tuple[int, str]] = []
    joined, start = "", first
    for number, line in enumerate(body.splitlines(), first):
        if not joined:
            start = number
        joined += line
        if line.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        lines.append((start, joined))
        joined = ""
    return lines


def _commands() -> list[Command]:
    commands = []
    for block in (b for b in code_blocks() if b.language in SHELL_LANGUAGES):
        for number, line in _shell_lines(block.body, block.line + 1):
            words: list[str] = []
            for word in [*shlex.split(line, comments=True), ";"]:
                if word not in SEPARATORS:
                    words.append(word)
                    continue
                index = _script_index(words)
                if index is not None:
                    where = f"{block.doc}:{number}"
                    commands.append(Command(where, words[index], tuple(words[index + 1 :])))
                words = []
    return commands


COMMANDS = _commands()


def _pretrain_flags(words: tuple[str, ...]) -> list[str]:
    """The words as `pretrain_gpt.py` flags: `...` dropped, a shell expansion a flag's value."""
    flags: list[str] = []
    for word in words:
        if word == "...":
            continue
        if "$" in word:
            if flags and flags[-1].startswith("--"):
                flags.append("1")
            continue
        flags.append(word)
    return flags


def _passed_on(command: Command) -> tuple[str, ...]:
    """What an `examples/` launch script hands on to pretrain_gpt.py: the words after `--` where
    the command has one (the words before are the script's own options), else the words from
    its first flag on (the words before are its own positional arguments)."""
    if "--" in command.args:
        return command.args[command.args.index("--") + 1 :]
    first = next((i for i, word in enumerate(command.args) if word.startswith("--")), None)
    return () if first is None else command.args[first:]


def test_commands_are_found():
    scripts = {command.script for command in COMMANDS}
    assert "pretrain_gpt.py" in scripts and any(s.startswith("tools/") for s in scripts)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.where)
def test_script_exists(command: Command):
    assert (REPO / command.script).is_file(), f"{command.where}: {command.text}: no such script"


PRETRAIN = [
    command
    for command in COMMANDS
    if command.script == "pretrain_gpt.py"
    or (command.script.startswith("examples/") and _passed_on(command))
]


@pytest.mark.parametrize("command", PRETRAIN, ids=lambda command: command.where)
def test_pretrain_flags_parse(command: Command, capsys: pytest.CaptureFixture[str]):
    words = command.args if command.script == "pretrain_gpt.py" else _passed_on(command)
    try:
        parse_args(args=_pretrain_flags(words))
    except SystemExit:
        pytest.fail(f"{command.where}: {command.text}\n{capsys.readouterr().err}")


MODELS = [command for command in PRETRAIN if command.where.startswith("docs/models.md:")]
"""The scaled-down command line of each architecture `docs/models.md` lists (2 ranks each)."""


def test_the_models_page_gives_each_architecture_a_command():
    assert len(MODELS) == 6


@pytest.mark.parametrize("command", MODELS, ids=lambda command: command.where)
def test_model_commands_validate(command: Command):
    """Their flags describe runs that start on 2 ranks: nothing refused, nothing contradicts
    (each architecture's training is tested beside its code)."""
    validate_args(parse_args(args=_pretrain_flags(command.args)), world_size=2)


TOOLS = [command for command in COMMANDS if re.fullmatch(r"tools/\w+\.py", command.script)]


def _leading_words(command: Command) -> list[str]:
    """The words before its first option: a subcommand (`import`), or positional arguments."""
    leading = []
    for word in command.args:
        if word.startswith("-"):
            break
        leading.append(word)
    return leading


@pytest.fixture(scope="module")
def tool_help() -> dict[str, str]:
    """Each tool command's `--help` text, keyed by the command's text."""
    requests = {command.text: (command.script, _leading_words(command)) for command in TOOLS}
    done = run_program(
        code=HELP_SCRIPT,
        args=[json.dumps([(k, *v) for k, v in requests.items()])],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _options(help_text: str) -> set[str]:
    """The options a `--help` text defines: those on its option lines (indented by two spaces),
    before the description column, not those its descriptions mention."""
    options: set[str] = set()
    for line in help_text.splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            options.update(OPTION.findall(invocation))
    return options


@pytest.mark.parametrize("command", TOOLS, ids=lambda command: command.where)
def test_tool_flags_exist(command: Command, tool_help: dict[str, str]):
    text = tool_help[command.text]
    assert text.rstrip().endswith("exit status 0"), f"{command.where}: {command.text}\n{text}"
    known = _options(text)
    # `[--flag VALUE]` marks an optional flag.
    options = [word.strip("[]").split("=", 1)[0] for word in command.args]
    unknown = [option for option in options if option.startswith("--") and option not in known]
    assert not unknown, f"{command.where}: {command.text}: {unknown} are not options of it"
