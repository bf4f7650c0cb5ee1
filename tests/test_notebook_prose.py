"""Each chapter's prose stays a chapter's length: about 2,000 words, at most a few sentences of them written by code.

Prose is what a reader reads as text: the Markdown cells (code blocks in them left out) and the Markdown that code
cells display (``text/markdown`` outputs, English assembled by the notebook). A chapter holds at most
``MAX_WORDS`` of it, and at most ``MAX_GENERATED_WORDS`` of the generated kind; an appendix notebook (its name says
``appendix``) is exempt. The chapters still over either limit are listed in ``NOT_YET`` with what they hold today:
they may only shrink, and one that fits must leave the list (so the list is a ratchet, not a licence).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
MAX_WORDS, MAX_GENERATED_WORDS = 2_200, 60  # "about 2,000", "a few sentences"

# A chapter over a limit would be listed here as chapter -> (prose words, generated words) and could only shrink.
NOT_YET: dict[str, tuple[int, int]] = {}  # every chapter fits since the textbook rewrite

WORD = re.compile(r"[A-Za-z0-9][\w'’.,-]*")
FENCED_CODE = re.compile(r"```.*?```", re.S)


def words(text: str) -> int:
    return len(WORD.findall(text))


def prose_words(notebook: dict) -> tuple[int, int]:
    """``(all prose words, generated ones)`` of a notebook as nbformat's JSON."""
    written = generated = 0
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            written += words(FENCED_CODE.sub("", "".join(cell["source"])))
        for output in cell.get("outputs", []):
            generated += words("".join(output.get("data", {}).get("text/markdown", "")))
    return written + generated, generated


def chapters() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("*.ipynb") if "appendix" not in p.name)


def test_the_counter_counts_markdown_and_generated_markdown_but_not_code():
    fake = {
        "cells": [
            {"cell_type": "markdown", "source": ["One idea, drawn.\n", "```python\nx = 1  # not prose\n```\n"]},
            {"cell_type": "code", "source": ["x"], "outputs": [{"data": {"text/markdown": "Two words"}}]},
            {"cell_type": "code", "source": [], "outputs": [{"text": "printed, not counted"}]},
        ]
    }
    assert prose_words(fake) == (5, 2)


def test_not_yet_names_only_chapters_that_exist():
    assert set(NOT_YET) <= {p.name for p in chapters()}


@pytest.mark.parametrize("path", chapters(), ids=lambda p: p.stem)
def test_a_chapters_prose_is_a_chapters_length(path):
    total, generated = prose_words(json.loads(path.read_text()))
    if path.name not in NOT_YET:
        assert total <= MAX_WORDS, f"{path.name}: {total} words of prose (at most {MAX_WORDS})"
        assert generated <= MAX_GENERATED_WORDS, f"{path.name}: {generated} words written by code"
        return
    was_total, was_generated = NOT_YET[path.name]
    assert total <= was_total and generated <= was_generated, f"{path.name} grew: {total}, {generated} words"
    assert total > MAX_WORDS or generated > MAX_GENERATED_WORDS, f"{path.name} fits now: take it out of NOT_YET"
