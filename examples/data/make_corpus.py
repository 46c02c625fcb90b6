"""Builds `pride_and_prejudice_vol1.jsonl` from a plain-text copy of Pride and Prejudice.

    python examples/data/make_corpus.py pride_and_prejudice.txt \\
        examples/data/pride_and_prejudice_vol1.jsonl

Keeps the title and Volume I (chapters 1 to 23), drops any e-text licence header and footer,
unwraps each paragraph onto one line and groups paragraphs, within a chapter, into documents
of at least `MIN_CHARS` characters: one JSON object `{"text": ...}` per line. README.md says
where the text comes from.
"""

from __future__ import annotations

import json
import re
import sys

MIN_CHARS = 500
"""Documents of a few hundred tokens: a few hundred documents in all, whole paragraphs each."""

LAST_CHAPTER = 23
"""Volume I ends with chapter 23."""


def documents(text: str) -> list[str]:
    """The documents of Volume I, in order."""
    # A raw e-text carries a licence header and footer between markers; keep what is inside.
    inside = re.search(r"\*\*\* ?START OF.*?\*\*\*(.*)\*\*\* ?END OF", text, re.S)
    if inside:
        text = inside.group(1)
    text = text[: text.index(f"\nChapter {LAST_CHAPTER + 1}\n")]
    result: list[str] = []
    chapters = re.split(r"\n(?=Chapter \d+\n)", text.strip())
    if not chapters[0].startswith("Chapter"):
        chapters[:2] = ["\n\n".join(chapters[:2])]  # the title opens chapter 1's document
    for chapter in chapters:
        paragraphs = [" ".join(part.split()) for part in re.split(r"\n\s*\n", chapter)]
        group: list[str] = []
        for paragraph in filter(None, paragraphs):
            group.append(paragraph)
            if sum(map(len, group)) >= MIN_CHARS:
                result.append("\n\n".join(group))
                group = []
        if group:
            result.append("\n\n".join(group))
    if any("gutenberg" in document.lower() for document in result):
        raise ValueError("the text still mentions the e-text's publisher; strip it first.")
    return result


def main(source: str, destination: str) -> None:
    with open(source, encoding="utf-8") as stream:
        docs = documents(stream.read())
    with open(destination, "w", encoding="utf-8") as stream:
        for document in docs:
            stream.write(json.dumps({"text": document}, ensure_ascii=False) + "\n")
    print(f"{len(docs)} documents -> {destination}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
