"""Chapter 09's toy, run against the package outside the notebook: a long prompt cut into chunks by the step's
token budget, beside requests already decoding, with and without the per-prompt cap.

The toy and its check are found in ``notebooks/09_chunked_prefill.ipynb`` by their marker lines and run in one
namespace, in order, as the notebook holds them (the pattern of ``test_notebook_toys.py``). The check must be
able to fail: the ``broken`` tests change one rule of the toy and expect the check to raise.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_chunked_prefill.ipynb"
MARKERS = ("# toy: chunked prefill", "# check: chunked prefill")


def cell_sources() -> list[str]:
    """The code cells holding each marker line, in order."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    found = []
    for marker in MARKERS:
        hits = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "code" and marker in (line.strip() for line in "".join(c["source"]).splitlines())
        ]
        assert len(hits) == 1, f"{NOTEBOOK.name}: {len(hits)} code cells marked {marker!r} (want one)"
        found.append(hits[0])
    return found


def run_cells(sources: list[str]) -> dict:
    namespace: dict = {"__name__": "chunked_prefill"}
    for i, source in enumerate(sources):
        exec(compile(source, f"<chunked prefill cell {i}>", "exec"), namespace)
    return namespace


def broken(sources: list[str], old: str, new: str) -> list[str]:
    """The cells with one rule of the toy changed (``old`` must be in exactly one of them)."""
    assert sum(s.count(old) for s in sources) == 1, f"the toy no longer holds {old!r}: update this test's change"
    return [s.replace(old, new) for s in sources]


def test_the_toy_cuts_what_the_markdown_says(capsys):
    ns = run_cells(cell_sources())
    # the first section's two lines: 1,000 tokens beside four decodes, budget 132, without and with the cap
    assert ns["toy_chunks"](1000, 4, 132) == [128] * 7 + [104]
    assert ns["default_cap"](132) == 64 and ns["toy_chunks"](1000, 4, 132, 64) == [64] * 15 + [40]
    assert "in all 10 cases" in capsys.readouterr().out


def test_the_toy_agrees_with_the_scheduler_on_random_prompts_and_budgets():
    ns = run_cells(cell_sources())
    rng = random.Random(0)
    for _ in range(30):
        budget = rng.choice([24, 40, 64, 100, 132, 256, 300, 512])
        num_decodes = rng.randint(0, min(12, budget - 1))
        prompt_len = rng.randint(1, 1500)
        for cap in (None, ns["default_cap"](budget), rng.randint(1, budget)):
            toy = ns["toy_chunks"](prompt_len, num_decodes, budget, cap)
            assert toy == ns["package_chunks"](prompt_len, num_decodes, budget, cap), (prompt_len, num_decodes, budget)
            assert sum(toy) == prompt_len


@pytest.mark.parametrize(
    "old, new",
    [
        ("min(left, budget - num_decodes)", "min(left, budget)"),  # the prompt ignores the decodes' share
        ("and num_decodes > 0", ""),  # cap a prompt that is alone
        ("max(budget // 4, floor)", "budget // 4"),  # no floor under the default cap
    ],
    ids=["decodes-not-first", "cap-when-alone", "no-floor"],
)
def test_the_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run_cells(broken(cell_sources(), old, new))
