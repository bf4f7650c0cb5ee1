"""Chapter 11's toy, run against the package outside the notebook: a padded decode step in static buffers.

The toy (``# toy: padded decode buffers``) writes the ladder of captured batch sizes, the padding of a batch to one
of them, and the fill of fixed buffers in plain Python; its check (``# check: padded decode buffers``) compares them
with ``graph_batch_sizes``, ``padded_batch_size`` and ``DecodeGraphs.fill``. Here the check runs on a tiny random
model (a fill never runs the model), and each broken toy must fail it.
"""

from __future__ import annotations

import pytest
from test_notebook_toys import broken, cell_sources

from lifeofprompt import SamplingParams

GRAPHS = ("11_kernels_and_graphs.ipynb", "# toy: padded decode buffers", "# check: padded decode buffers")


def run(sources, tiny_model):
    model, _ = tiny_model
    namespace = {"__name__": "graphs", "model": model, "SamplingParams": SamplingParams}
    for i, source in enumerate(sources):
        exec(compile(source, f"<graphs cell {i}>", "exec"), namespace)
    return namespace


def test_the_graph_toy_fills_what_the_package_fills(tiny_model, capsys):
    ns = run(cell_sources(*GRAPHS), tiny_model)
    # what the Markdown before the toy tells the reader to find: one padding row, token 0 at position 0, slot -1
    assert ns["size"] == 4
    assert [ns["static"][name][3] for name in ("input_ids", "positions", "slot_mapping", "seq_lens")] == [0, 0, -1, 1]
    assert "agree with the toy" in capsys.readouterr().out


@pytest.mark.parametrize(
    "old, new",
    [
        ("list(range(16, max_num_seqs, 16))", "list(range(16, max_num_seqs, 32))"),  # a sparser ladder
        ("if size >= batch", "if size > batch"),  # pads a batch that fits exactly
        (
            "[t[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for _, pos, t in rows] + [-1] * pad",
            "[t[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for _, pos, t in rows] + [0] * pad",
        ),  # padding rows would overwrite slot 0
        ("[pos + 1 for _, pos, _ in rows] + [1] * pad", "[pos for _, pos, _ in rows] + [1] * pad"),  # one key short
    ],
    ids=["sparse-ladder", "pads-exact-fits", "padding-writes-slot-0", "lengths-one-short"],
)
def test_the_graph_check_fails_on_a_broken_toy(tiny_model, old, new):
    with pytest.raises(AssertionError):
        run(broken(cell_sources(*GRAPHS), old, new), tiny_model)
