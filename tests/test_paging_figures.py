"""Chapter 07's arithmetic, figures and widget callback, without the model."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from lifeofprompt.engine.block_manager import BlockManager
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import Sequence
from lifeofprompt.figures import paging as paging_figures
from lifeofprompt.figures.paging import draw_fragmentation, draw_snapshot, draw_trace, paging_panel, place_requests
from lifeofprompt.lessons.paging import (
    format_fragmentation_table,
    fragmentation_table,
    request_lengths,
    requests_that_fit,
    slots_wasted_contiguous,
    slots_wasted_paged,
    snapshot,
)

LENGTHS = [1, 16, 17, 100]


def test_waste_and_fit_by_hand():
    assert slots_wasted_contiguous(LENGTHS, 128) == 127 + 112 + 111 + 28
    assert slots_wasted_paged(LENGTHS, 16) == 15 + 0 + 15 + 12
    assert slots_wasted_paged(LENGTHS, 1) == 0
    assert requests_that_fit(LENGTHS, 256, None, 128) == 2
    assert requests_that_fit(LENGTHS, 256, 16) == 4  # 16 + 16 + 32 + 112 = 176 slots
    assert requests_that_fit(LENGTHS, 100, 16) == 3


def test_fragmentation_table_rows_and_text():
    rows = fragmentation_table(LENGTHS, 128, 256, block_sizes=(16, 64), bytes_per_token=1024)
    assert [(r["layout"], r["reserved"], r["wasted"], r["fit"]) for r in rows] == [
        ("contiguous", 512, 378, 2),
        ("paged, block 16", 176, 42, 4),
        ("paged, block 64", 320, 186, 3),
    ]
    assert rows[1]["wasted_bytes"] == 42 * 1024
    # In the pool: only the requests that fit, so the reservation's waste is counted for 2 of them.
    assert [r["pool_wasted"] for r in rows] == [127 + 112, 42, 63 + 48 + 47]
    assert rows[0]["pool_wasted_bytes"] == 239 * 1024
    text = format_fragmentation_table(rows)
    assert "all requests" in text.splitlines()[0] and "held in the pool" in text.splitlines()[0]
    assert text.splitlines()[2].split() == ["contiguous", "512", "378", "73.8%", "0.4", "2", "239", "0.2"]
    with pytest.raises(ValueError):
        fragmentation_table([200], 128, 256)


def test_request_lengths_are_seeded_and_bounded():
    a = request_lengths(50, 512, seed=1)
    assert a == request_lengths(50, 512, seed=1) != request_lengths(50, 512, seed=2)
    assert len(a) == 50 and min(a) >= 1 and max(a) <= 512
    assert a[:5] == [19, 241, 185, 38, 88]


def test_place_requests_stops_at_the_first_that_does_not_fit():
    bm, seqs, fit = place_requests([20, 40, 100, 5], num_blocks=6, block_size=16)
    assert fit == 2 and [s.block_table for s in seqs] == [[0, 1], [2, 3, 4]]
    assert bm.num_free_blocks == 1


def test_panel_numbers_follow_the_sliders():
    lengths = request_lengths(32, 512, seed=1)
    fig, text = paging_panel(16, 2048, lengths, 512, 22528, " of TinyLlama bf16 KV")
    assert text.splitlines() == [
        "pool: 2048 token slots; block size 16 → 128 blocks",
        "paged:       17 of 32 requests fit, 157 slots wasted = 3.4 MiB of TinyLlama bf16 KV",
        "contiguous:   4 of 32 requests fit, 1565 slots wasted = 33.6 MiB of TinyLlama bf16 KV",
    ]
    ax_paged = fig.axes[0]
    outlines = ax_paged.collections[-1]
    assert len(outlines.get_paths()) == 128  # one cell per block
    fig_big, text_big = paging_panel(128, 2048, lengths, 512)
    assert len(fig_big.axes[0].collections[-1].get_paths()) == 16
    assert "paged:       11 of 32 requests fit, 817 slots wasted" in text_big
    fig_pool, text_pool = paging_panel(16, 4096, lengths, 512)
    assert "contiguous:   8 of 32" in text_pool and "256 blocks" in text_pool
    plt.close("all")


def test_snapshot_and_grid_show_owners_fill_sharing_and_cached_free_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    greedy = SamplingParams(temperature=0)
    a, b = Sequence("a", list(range(10)), greedy), Sequence("b", list(range(9)), greedy)
    for seq in (a, b):
        seq.num_computed_tokens = bm.claim_cached_prefix(seq)
        bm.allocate_slots(seq, len(seq) - seq.num_computed_tokens)
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
    snap = snapshot(bm, {"a": a, "b": b}, step=1, events=["x"])
    assert snap.owners[:4] == [["a", "b"], ["a", "b"], ["a"], ["b"]]
    assert snap.filled[:4] == [4, 4, 2, 1] and snap.cached[:4] == [True, True, False, False]
    assert snap.table_lines() == ["a   10 tokens  blocks [0, 1, 2]", "b    9 tokens  blocks [0, 1, 3]"]
    assert snap.table_lines(3) == ["a     10 tokens  blocks [0, 1, 2]", "b      9 tokens  blocks [0, 1, 3]"]
    fig = draw_snapshot(snap, ["a", "b"])
    hatched = [p for p in fig.axes[0].patches if p.get_hatch() == "///"]
    assert len(hatched) == 2  # the two shared blocks
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["a", "b"] and "shared" in legend  # drawn alone, the figure names its colours
    bm.free(a)
    bm.free(b)
    after = snapshot(bm, {}, step=2, events=["freed"])
    assert after.owners == [[]] * 6 and after.filled[:2] == [4, 4] and after.cached[:2] == [True, True]
    fig = draw_trace([snap, after], ["a", "b"], columns=6)
    assert len(fig.axes) == 4
    plt.close("all")


def test_fragmentation_figure_has_one_bar_per_layout():
    rows = fragmentation_table(LENGTHS, 128, 256, block_sizes=(4, 16, 64))
    fig = draw_fragmentation(rows)
    assert [len(ax.patches) for ax in fig.axes] == [4, 4]
    assert fig.axes[1].patches[0].get_height() == 2  # contiguous: 2 requests fit
    plt.close("all")


def test_widget_redraws_through_the_callback_when_a_slider_moves(monkeypatch):
    calls = []

    def fake_panel(block_size, pool_tokens, *args):
        calls.append((block_size, pool_tokens))
        return plt.figure(), "text"

    monkeypatch.setattr(paging_figures, "paging_panel", fake_panel)
    box = paging_figures.paging_widget([10, 20], 64)
    (block, pool), summary, image = box.children[0].children, box.children[1], box.children[2]
    assert calls == [(16, 2048)]
    assert bytes(image.value[:4]) == b"\x89PNG" and "text" in summary.value
    block.value = 64
    pool.value = 4096
    assert calls == [(16, 2048), (64, 2048), (64, 4096)]
    plt.close("all")


def test_widget_image_is_the_panel_drawn_in_full():
    box = paging_figures.paging_widget(request_lengths(32, 512, seed=1), 512)
    summary, image = box.children[1], box.children[2]
    before = bytes(image.value)
    assert "block size 16 → 128 blocks" in summary.value
    box.children[0].children[0].value = 32
    assert "block size 32 → 64 blocks" in summary.value
    assert bytes(image.value) != before and len(image.value) > 20_000  # a whole figure, not a blank canvas
