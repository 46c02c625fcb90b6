"""The docs describe what exists now: `docs/performance.md` holds current results (each section
with tables names its device and date, no heading is a date, no text tells the story of a
session), and no doc reads as a diary. History lives in git."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"
DIARY = re.compile(
    r"this session|in this change|before this change|scratch script|\bcommit [0-9a-f]{7,}",
    re.IGNORECASE,
)
"""Phrases of a lab notebook rather than of a description."""
SETUP_SECTIONS = ("Reproducing", "Targets")
"""Sections of performance.md that describe how to measure and what is aimed at."""


def _sections(text: str) -> list[tuple[str, str]]:
    parts = re.split(r"^(#{2,} .*)$", text, flags=re.MULTILINE)
    return list(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md")))
def test_no_doc_reads_as_a_diary(doc):
    text = (DOCS / doc).read_text()
    assert not DIARY.findall(text), f"{doc}: {DIARY.findall(text)[:3]}"


def test_performance_sections_name_their_device_and_date():
    sections = _sections((DOCS / "performance.md").read_text())
    assert len(sections) > 5
    for heading, body in sections:
        assert not re.search(r"\d{4}-\d\d-\d\d", heading), f"a dated heading: {heading}"
        if "|---" not in body or heading.lstrip("# ") in SETUP_SECTIONS:
            continue
        assert re.search(r"H100|H200|CPU", body), f"{heading}: no device"
        assert re.search(r"20\d\d-\d\d-\d\d", body), f"{heading}: no date"
