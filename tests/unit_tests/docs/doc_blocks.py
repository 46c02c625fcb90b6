"""The fenced code blocks of README.md and docs/*.md, where the docs tests find them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block.

    Attributes:
        doc: the Markdown file, relative to the repository (`docs/running.md`).
        line: the line of its opening fence, from 1.
        language: the fence's info string (`python`, `bash`), "" when untagged.
        body: the text between the fences.
    """

    doc: str
    line: int
    language: str
    body: str

    @property
    def where(self) -> str:
        """`doc:line`, for test ids and messages."""
        return f"{self.doc}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every docs/*.md."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_blocks(language: str | None = None) -> list[CodeBlock]:
    """Every fenced block of the docs, or those whose info string is `language`."""
    blocks = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            block = CodeBlock(
                doc=str(path.relative_to(REPO)),
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(1).strip(),
                body=match.group(2),
            )
            if language is None or block.language == language:
                blocks.append(block)
    return blocks
