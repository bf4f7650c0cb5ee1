"""Chapter 14's figures and widget callback, called directly (the browser test moves the real slider)."""

from __future__ import annotations

from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")

from lifeofprompt.figures.speculation import (
    update_speculation,
    verify_cells,
    verify_columns,
    verify_figure,
    visible_token,
    yield_figure,
)  # noqa: E402
from lifeofprompt.lessons.speculation import SpeculationRun, expected_tokens_per_step  # noqa: E402


@dataclass
class Step:
    position: int
    draft_token_ids: list
    num_accepted: int
    token_ids: list = field(default_factory=list)


def test_cells_put_the_models_token_where_the_first_rejection_was():
    step = Step(10, [5, 6, 7, 8], 2, [5, 6, 99])
    assert verify_cells(step) == [(5, "kept"), (6, "kept"), (99, "own"), (7, "rejected"), (8, "rejected")]
    assert verify_cells(Step(3, [1, 2], 2, [1, 2, 4])) == [(1, "kept"), (2, "kept"), (4, "own")]
    assert verify_cells(Step(3, [1, 2], 1, [1])) == [(1, "kept"), (2, "rejected")]  # a stop after the kept draft


def test_whitespace_tokens_print_as_visible_marks():
    """Indentation drafts (common in code) must not leave blank cells."""
    assert visible_token("    ") == "␣␣␣␣"
    assert visible_token("\n\t") == "⏎⇥"
    assert visible_token("") == "∅"
    assert visible_token(" return") == "␣return"
    assert visible_token("abcdefghijkl") == "abcdefghi"


def test_columns_put_the_guess_and_its_correction_in_one_column():
    """The first rejected draft and the model's token for the same position share a column; the drafts
    after the miss follow; when all drafts are kept, the model's bonus token takes the column after them."""
    step = Step(10, [5, 6, 7, 8], 2, [5, 6, 99])
    assert verify_columns(step) == [
        [(5, "kept")],
        [(6, "kept")],
        [(7, "rejected"), (99, "own")],
        [(8, "after_miss")],
    ]
    assert verify_columns(Step(3, [1, 2], 2, [1, 2, 4])) == [[(1, "kept")], [(2, "kept")], [(4, "own")]]
    assert verify_columns(Step(3, [1, 2], 1, [1])) == [[(1, "kept")], [(2, "rejected")]]  # a stop after the kept one
    assert verify_columns(Step(3, [1, 2, 3], 0, [9])) == [
        [(1, "rejected"), (9, "own")],
        [(2, "after_miss")],
        [(3, "after_miss")],
    ]


def test_verify_figure_draws_a_cell_per_token_and_says_what_colours_mean():
    steps = [Step(4, [1, 2, 3], 1, [1, 7]), Step(6, [8, 9, 10], 3, [8, 9, 10, 11])]
    fig = verify_figure(steps, lambda t: f"t{t}")
    ax = fig.axes[0]
    assert len(ax.patches) == 8  # 1 kept + a split cell (2) + 1 after the miss; 3 kept + the bonus
    texts = [t.get_text() for t in ax.texts]
    assert "t7" in texts and "t11" in texts
    # a row is labelled with the positions its cells stand for: the first guess follows the last verified token
    assert "pos 5–7" in texts and "pos 7–10" in texts
    # the rejected guess (t2) and the model's token for the same position (t7) are drawn in one column
    x = {t.get_text(): t.get_position()[0] for t in ax.texts}
    assert x["t2"] == x["t7"]
    assert [t.get_text() for t in ax.get_legend().get_texts()][1].startswith("draft rejected")


def test_a_ring_around_the_chosen_k_does_not_hide_a_measured_run():
    run = SpeculationRun("at the ring", 4, 100, 2.0, 10, [7] * 4, [10] * 4)
    fig, _ = update_speculation(4, 0.7, [run])
    ax = fig.axes[0]
    ring = next(line for line in ax.get_lines() if line.get_label().startswith("k = 4"))
    marker = next(line for line in ax.get_lines() if line.get_color() == "black")
    assert marker.get_zorder() > ring.get_zorder() and ring.get_markerfacecolor() == "none"


def test_widget_callback_marks_k_and_alpha_and_reports_measured_runs():
    run = SpeculationRun("prompt lookup", 4, 100, 2.0, 40, [30, 20, 12, 6], [40, 30, 20, 12])
    fig, text = update_speculation(3, 0.6, [run])
    assert f"{expected_tokens_per_step(0.6, 3):.2f} tokens per verify step" in text
    assert "prompt lookup: measured 2.70 at k = 4" in text
    run.draft_lengths = [4] * 20 + [2] * 20  # half its verifies checked two drafts: compare at those
    _, text = update_speculation(3, 0.6, [run])
    alpha = run.alpha
    expected = (expected_tokens_per_step(alpha, 4) + expected_tokens_per_step(alpha, 2)) / 2
    assert f"3.00 drafts a verify (α ≈ {alpha:.2f}; the formula at those drafts gives {expected:.2f})" in text
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "k = 3, α = 0.60" in labels
    _, other = update_speculation(5, 0.9, [run])
    assert other != text


def test_yield_curves_rise_with_alpha():
    fig = yield_figure(6)
    tops = [line.get_ydata()[-1] for line in fig.axes[0].get_lines()]
    assert tops == sorted(tops) and len(tops) == 5


def test_measured_runs_are_named_in_a_legend_of_their_own():
    runs = [
        SpeculationRun("26-layer draft", 4, 100, 2.0, 40, [20, 10, 5, 2], [40, 20, 10, 5]),
        SpeculationRun("prompt lookup", 4, 100, 2.0, 40, [18, 9, 4, 2], [40, 18, 9, 4]),
    ]
    fig = yield_figure(8, runs=runs, highlight=(4, 0.5))
    ax = fig.axes[0]
    assert not ax.texts  # no labels written beside the points, where close runs would crowd
    names = {t.get_text() for legend in fig.legends for t in legend.get_texts()}
    for run in runs:
        assert f"{run.label} (α ≈ {run.alpha:.2f})" in names
    curve_labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "k = 4, α = 0.50" in curve_labels and "α = 0.3" in curve_labels
    assert not any("prompt lookup" in label for label in curve_labels)
