"""Chapter 07's toy (a block pool: free queue, block tables, slots) run against the package outside the notebook.

The toy cell (``# toy: block table``) and its check (``# check: block table``) are read from the notebook and run in
one namespace, as the notebook runs them: the check plays a script of allocations and finishes on the toy and on
``BlockManager`` and asserts they hold the same tables and free queue after every move. The ``broken`` tests change
one rule of the toy and expect the check to fail, so the check can fail.
"""

from __future__ import annotations

import pytest
from test_notebook_toys import broken, run_cells
from test_notebook_toys import cell_sources as notebook_cells

NOTEBOOK = "07_paged_cache.ipynb"
MARKERS = ("# toy: block table", "# check: block table")


def cell_sources() -> list[str]:
    return notebook_cells(NOTEBOOK, *MARKERS)


def run(sources: list[str]) -> dict:
    return run_cells(sources, "paging_toy")


def test_the_toy_holds_the_packages_tables_and_free_queue():
    ns = run(cell_sources())
    # what the Markdown says the output shows: a second block that is not next to the first, and its slot
    assert ns["block_tables"] == {"today": [1, 2]} and ns["free_queue"] == [0, 3, 4, 5, 6, 7]


def test_the_toys_slots_follow_the_block_table():
    ns = run(cell_sources()[:1])
    ns["block_tables"]["s"] = [5, 2]
    assert [ns["slot"]("s", j) for j in (0, 15, 16, 17)] == [80, 95, 32, 33]


@pytest.mark.parametrize(
    "old, new",
    [
        ("free_queue[:0] = block_tables.pop(seq)", "free_queue.extend(block_tables.pop(seq))"),  # freed to the tail
        ("-(-num_tokens // BLOCK_SIZE)", "(num_tokens // BLOCK_SIZE)"),  # rounds down: a partial block forgotten
        ("free_queue.pop(0)", "free_queue.pop()"),  # takes from the tail
    ],
)
def test_a_broken_toy_fails_its_check(old, new):
    with pytest.raises((AssertionError, IndexError)):
        run(broken(cell_sources(), old, new))
