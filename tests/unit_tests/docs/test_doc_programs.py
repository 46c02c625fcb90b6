"""Every Python block of README.md and docs/*.md says on its first line what it is, and each whole
program runs as written.

- `# Whole program: torchrun --nproc-per-node N example.py` (or `python example.py`): saved as
  `example.py` and run as that command runs it (`program_launcher.run_program`, gloo on CPU),
  it exits with 0, and rank 0 prints its training losses on lines
  that begin `step K: loss X`, K = 0, 1, ..., every X finite.
- `# Fragment: ...`: part of a program; the line says where the names it leaves out come from.
  Fragments are not run.

Whole programs are found, not listed: a new one is run without editing this file. A Python block
with neither first line fails, and so does Python code in a block not tagged `python`.
"""

from __future__ import annotations

import ast
import math
import os
import re
from pathlib import Path

import pytest

from tests.unit_tests.docs.doc_blocks import REPO, CodeBlock, code_blocks, doc_files
from tests.unit_tests.program_launcher import run_program

WHOLE = re.compile(r"# Whole program: (?P<command>.+)")
FRAGMENT = re.compile(r"# Fragment: \S.*")
LAUNCH = re.compile(r"(?:torchrun --nproc-per-node (?P<ranks>\d+)|python) example\.py")
STEP = re.compile(r"^step (\d+): loss ([^\s,]+)", re.MULTILINE)


def _first_line(block: CodeBlock) -> str:
    return block.body.split("\n", 1)[0].strip()


def _whole_programs() -> list[CodeBlock]:
    return [block for block in code_blocks("python") if WHOLE.fullmatch(_first_line(block))]


def _ranks(block: CodeBlock) -> int | None:
    """The ranks torchrun starts for a whole program; None for `python example.py`."""
    command = WHOLE.fullmatch(_first_line(block))["command"].strip()
    launch = LAUNCH.fullmatch(command)
    assert launch, (
        f"{block.where}: '# Whole program: {command}' names no command the tests know; use "
        "'torchrun --nproc-per-node N example.py' or 'python example.py'."
    )
    return None if launch["ranks"] is None else int(launch["ranks"])


def test_every_python_block_is_found():
    """The fence pattern misses no block: as many as the files have ```python lines."""
    expected = sum(path.read_text(encoding="utf-8").count("\n```python\n") for path in doc_files())
    assert len(code_blocks("python")) == expected
    assert _whole_programs(), "the README's library programs are whole programs"


def test_every_python_block_is_marked_whole_or_fragment():
    unmarked = [
        f"{block.where}: {_first_line(block)!r}"
        for block in code_blocks("python")
        if not (WHOLE.fullmatch(_first_line(block)) or FRAGMENT.fullmatch(_first_line(block)))
    ]
    assert not unmarked, (
        "Python blocks must open with '# Whole program: COMMAND' or '# Fragment: where its "
        "other names come from':\n" + "\n".join(unmarked)
    )
    for block in _whole_programs():
        if _ranks(block) is not None:
            assert "dist.destroy_process_group()" in block.body, (
                f"{block.where}: a torchrun program ends by destroying its process group"
            )


def _is_python(body: str) -> bool:
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.Call, ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


def test_untagged_blocks_hold_no_python():
    """Python code in an untagged block would escape the marks above: it must say `python`."""
    untagged = [block.where for block in code_blocks("") if _is_python(block.body)]
    assert not untagged, f"tag these blocks ```python and mark them: {untagged}"


@pytest.mark.parametrize("block", _whole_programs(), ids=lambda block: block.where)
def test_whole_program_runs(tmp_path: Path, block: CodeBlock):
    (tmp_path / "example.py").write_text(block.body, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = run_program("example.py", nproc=_ranks(block), env=env, cwd=tmp_path)
    output = f"{block.where}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert proc.returncode == 0, output
    steps = STEP.findall(proc.stdout)
    assert [int(step) for step, _ in steps] == list(range(len(steps))) and steps, output
    assert all(math.isfinite(float(loss)) for _, loss in steps), output
