"""Chapter 09's toy, run against the package outside the notebook: a long prompt cut into chunks by the step's
token budget, beside requests already decoding, with and without the per-prompt cap.

The toy and its check are found in ``notebooks/09_chunked_prefill.ipynb`` by their marker lines and run in one
namespace, in order, as the notebook holds them (the pattern of ``test_notebook_toys.py``). The check must be
able to fail: the ``broken`` tests change one rule of the toy and expect the check to raise.
"""

from __future__ import annotations

import random

import pytest
from test_notebook_toys import broken, run_cells
from test_notebook_toys import cell_sources as notebook_cells

NOTEBOOK = "09_chunked_prefill.ipynb"
MARKERS = ("# toy: chunked prefill", "# check: chunked prefill")


def cell_sources() -> list[str]:
    return notebook_cells(NOTEBOOK, *MARKERS)


def run(sources: list[str]) -> dict:
    return run_cells(sources, "chunked_prefill")


def test_the_toy_cuts_what_the_markdown_says(capsys):
    ns = run(cell_sources())
    # the first section's two lines: 1,000 tokens beside four decodes, budget 132, without and with the cap
    assert ns["toy_chunks"](1000, 4, 132) == [128] * 7 + [104]
    assert ns["default_cap"](132) == 64 and ns["toy_chunks"](1000, 4, 132, 64) == [64] * 15 + [40]
    assert "in all 10 cases" in capsys.readouterr().out


def test_the_toy_agrees_with_the_scheduler_on_random_prompts_and_budgets():
    ns = run(cell_sources())
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
        run(broken(cell_sources(), old, new))
