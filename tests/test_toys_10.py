"""Chapter 10's toy, run against the package outside the notebook: the runner's inputs for one step.

The toy (``# toy: runner inputs``) builds a step's token ids, positions, slot mapping, lengths and block tables in
plain Python; its check (``# check: runner inputs``) gives the same sequences to ``ModelRunner.prepare`` and compares.
Here the check runs on a tiny random model (``prepare`` never runs the model), and each broken toy must fail it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_notebook_toys import broken, cell_sources

from lifeofprompt import SamplingParams

RUNNER = ("10_model_runner.ipynb", "# toy: runner inputs", "# check: runner inputs")


def run(sources, tiny_model):
    """The cells in one namespace, with what the notebook defined before them (its model, its greedy params)."""
    model, _ = tiny_model
    namespace = {
        "__name__": "runner",
        "llm": SimpleNamespace(engine=SimpleNamespace(model=model)),
        "greedy": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    }
    for i, source in enumerate(sources):
        exec(compile(source, f"<runner cell {i}>", "exec"), namespace)
    return namespace


def test_the_runner_toy_prepares_what_the_package_prepares(tiny_model, capsys):
    ns = run(cell_sources(*RUNNER), tiny_model)
    # what the Markdown before the toy tells the reader to find in its output
    assert ns["slots"][:6] == [12, 13, 14, 15, 28, 29]  # A: four slots in block 3, two in block 7
    assert ns["slots"][-1] == 4  # C's fifth token opens its second block, block 1
    assert ns["tables"][0][-1] == -1 and ns["tables"][2][-1] == -1
    assert "ModelRunner.prepare builds the same five lists" in capsys.readouterr().out


def test_the_toy_agrees_on_other_batches(tiny_model):
    ns = run(cell_sources(*RUNNER), tiny_model)
    ns["BATCH"] = [("P", list(range(9)), 3, 5, [2, 6, 1]), ("Q", list(range(5)), 4, 1, [0, 3])]
    ns["ids"], ns["positions"], ns["slots"], ns["seq_lens"], ns["tables"] = ns["toy_prepare"](ns["BATCH"], 4)
    exec(compile(cell_sources(*RUNNER)[1], "<check again>", "exec"), ns)  # the check alone, on the new batch


@pytest.mark.parametrize(
    "old, new",
    [
        ("slot_mapping.append(block * block_size + pos % block_size)", "slot_mapping.append(pos)"),  # no paging
        ("for pos in range(cached, cached + n):", "for pos in range(0, n):"),  # positions restart at 0
        ("table + [-1] * (width - len(table))", "table + [0] * (width - len(table))"),  # pads with a real block
        ("seq_lens.append(cached + n)", "seq_lens.append(n)"),  # attention would skip the cached keys
    ],
    ids=["no-block-table", "positions-from-zero", "pads-with-block-0", "lengths-without-cache"],
)
def test_the_runner_check_fails_on_a_broken_toy(tiny_model, old, new):
    with pytest.raises(AssertionError):
        run(broken(cell_sources(*RUNNER), old, new), tiny_model)
