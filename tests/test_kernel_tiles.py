"""Chapter 11's tiles figure draws the launch its check ran: one parameter set, the kernel's own plan.

Runs the Triton kernel under the interpreter on ``MIXED_LAUNCH`` (a few seconds), so it is
skipped where Triton is missing, like ``tests/test_kernels.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # find it without importing it: lifeofprompt.kernels
    pytest.skip("Triton is not installed", allow_module_level=True)  # must be first (interpreter mode)
from lifeofprompt.kernels.paged_attention import launch_plan  # noqa: E402

from lifeofprompt import kernels  # noqa: E402
from lifeofprompt.lessons.kernel_launch import MIXED_LAUNCH  # noqa: E402
from lifeofprompt.lessons.kernel_tiles import launch_tiles  # noqa: E402
from lifeofprompt.lessons.paged_cases import make_case  # noqa: E402
from lifeofprompt.model.paged_attention import paged_attention as reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and not kernels.INTERPRETED,
    reason="CPU interpreter tests; on a GPU machine run tests/gpu",
)


@pytest.fixture(scope="module")
def case():
    return make_case(**MIXED_LAUNCH.case_kwargs())


def test_the_checked_launch_matches_the_reference_with_the_figures_tiles(case):
    args = case.attention_args()
    ours = kernels.paged_attention(*args, **MIXED_LAUNCH.kernel_kwargs())
    assert ours.shape == (sum(MIXED_LAUNCH.query_lens), MIXED_LAUNCH.num_heads, MIXED_LAUNCH.head_dim)
    assert (ours - reference(*args)).abs().max() < 1e-5


def test_the_plan_is_the_kernels_own_for_the_same_arguments(case):
    args = case.attention_args()
    plan = launch_tiles(*args, **MIXED_LAUNCH.kernel_kwargs())
    config, _, splits = launch_plan(
        case.query,
        MIXED_LAUNCH.num_kv_heads,
        len(MIXED_LAUNCH.query_lens),
        case.max_query_len,
        case.max_seq_len,
        **MIXED_LAUNCH.kernel_kwargs(),
    )
    assert plan.config == config and plan.num_kv_splits == splits == MIXED_LAUNCH.num_kv_splits
    assert (plan.config.tile_n, plan.config.block_m) == (MIXED_LAUNCH.tile_n, MIXED_LAUNCH.block_m)
    assert plan.block_size == MIXED_LAUNCH.block_size
    assert [s.query_len for s in plan.sequences] == list(MIXED_LAUNCH.query_lens)
    assert [s.context_len for s in plan.sequences] == list(MIXED_LAUNCH.context_lens)
    for seq, row in zip(plan.sequences, case.block_tables.tolist()):
        assert seq.block_table == [b for b in row if b >= 0] and len(seq.block_table) == -(
            -seq.seq_len // plan.block_size
        )


def test_without_the_overrides_each_short_sequence_would_be_one_tile(case):
    """Why kernel_launch forces small tiles: the kernel's default covers each of these sequences at once."""
    plan = launch_tiles(*case.attention_args())
    assert plan.config.tile_n == 128 and plan.num_kv_splits == 1
    assert all(len(plan.tiles(i)) == 1 for i, s in enumerate(plan.sequences) if s.query_len == 1)


def test_the_figure_draws_every_sequence_of_the_checked_launch(case):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lifeofprompt.figures.tiles import launch_figure

    plan = launch_tiles(*case.attention_args(), **MIXED_LAUNCH.kernel_kwargs())
    fig = launch_figure(plan)
    assert len(fig.axes) == len(MIXED_LAUNCH.query_lens)
    longest = max(s.seq_len for s in plan.sequences)
    for i, ax in enumerate(fig.axes):
        seq = plan.sequences[i]
        assert len(ax.patches) == len(plan.tiles(i))  # one rectangle per KV tile the kernel takes
        assert ax.get_xlim() == (0, longest)  # one key axis for all panels
        assert f"{seq.seq_len} keys" in ax.get_title()
        assert [t.get_text() for t in ax.texts][0] == f"block {seq.block_table[0]}"
    assert "tiles of 16 keys over blocks of 4, 2 KV splits" in fig._suptitle.get_text()
    prefill = fig.axes[2].get_title()
    assert "12 tokens after 20 cached" in prefill and "3 programs of 5 tokens" in prefill
    plt.close(fig)
