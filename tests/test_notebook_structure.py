"""The series holds together: chapters numbered 01 to 15 with titles that say so, every link between
chapters (and from the README) points at a notebook that exists, every chapter ends with exercises that
check their answers, and no chapter narrates how it was made or calls the two articles "seeds"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\(((?:notebooks/)?[\w.-]+\.ipynb)(?:#[^)]*)?\)")
# Words that narrate the project's making, or name the two articles as what they were to us.
PROCESS_TALK = re.compile(
    r"seed texts?|the (?:first|second) seed|rerun at|wired in|now warms up|as stored for this project"
    r"|our first torch path|in this session",
    re.I,
)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def markdown(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in cells(path) if c["cell_type"] == "markdown"]


def test_the_chapters_are_numbered_01_to_15_and_their_titles_say_so():
    assert [p.name[:2] for p in CHAPTERS] == [f"{n:02d}" for n in range(1, 16)]
    for path in CHAPTERS:
        title = markdown(path)[0].splitlines()[0]
        assert title.startswith(f"# {path.name[:2]} · "), f"{path.name}: first line is {title!r}"


def test_every_link_to_a_notebook_points_at_one_that_exists():
    sources = {p.name: "\n".join(markdown(p)) for p in NOTEBOOKS.glob("*.ipynb")}
    sources["README.md"] = (ROOT / "README.md").read_text()
    broken = [
        (name, target)
        for name, text in sources.items()
        for target in LINK.findall(text)
        if not (NOTEBOOKS / Path(target).name).exists()
    ]
    assert not broken, broken


def test_every_chapter_but_the_first_is_linked_from_the_one_before():
    for before, after in zip(CHAPTERS, CHAPTERS[1:]):
        assert after.name in "\n".join(markdown(before)), f"{before.name} never links to {after.name}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_ends_with_exercises_that_run_a_check(path):
    all_cells = cells(path)
    starts = [
        i
        for i, c in enumerate(all_cells)
        if c["cell_type"] == "markdown" and re.search(r"^## Exercises", "".join(c["source"]), re.M)
    ]
    assert starts, f"{path.name} has no '## Exercises' section"
    after = all_cells[starts[-1] + 1 :]
    code = [c for c in after if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert len(code) >= 2, f"{path.name}: the exercises need a cell to edit and a cell that checks it"
    exercises_cell = "".join(all_cells[starts[-1]]["source"])
    rest = [exercises_cell[exercises_cell.index("## Exercises") :]]
    rest += ["".join(c["source"]) for c in after if c["cell_type"] == "markdown"]
    later = [h for text in rest for h in re.findall(r"^## .*", text, re.M) if h != "## Exercises"]
    assert not later, f"{path.name}: sections after the exercises (the chapter must end with them): {later}"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_no_chapter_narrates_its_making_or_calls_the_articles_seeds(path):
    found = [m.group(0) for text in markdown(path) for m in PROCESS_TALK.finditer(text)]
    assert not found, f"{path.name}: {found}"
