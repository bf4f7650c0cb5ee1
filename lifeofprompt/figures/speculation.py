"""Speculative decoding drawn (notebook 14): the verify steps of one request, and the yield curve.

``verify_figure`` lays out a request's verify steps as rows, one column per position the drafts
guessed: the drafts the model kept (their KV rows stay), the first draft it rejected with the
model's own token in the same column (the guess and its correction), the drafts guessed after the
miss (rolled back), and, when every draft was kept, the model's bonus token in the column after
them. ``yield_figure`` plots the expected tokens per verify step against k for several acceptance
rates, with measured runs placed on it. ``update_speculation(k, alpha, runs)`` is the widget's
callback as a plain function, so tests call it directly; ``speculation_panel(runs)`` wires it to
ipywidgets.
"""

from __future__ import annotations

import itertools

from ..lessons.speculation import SpeculationRun, expected_tokens_per_step

KEPT, REJECTED, OWN = "#55a868", "#c44e52", "#4c72b0"
AFTER_MISS = "#e8a3a5"  # drafts guessed after the first wrong one: computed, never judged, rolled back
ALPHAS = (0.3, 0.5, 0.7, 0.8, 0.9)


def verify_cells(step) -> list[tuple[int, str]]:
    """``(token_id, state)`` for one verify step in the order of its query rows: its drafts
    (kept / rejected), the model's own token after the kept ones."""
    drafts, n = list(step.draft_token_ids), step.num_accepted
    kept = [(t, "kept") for t in drafts[:n]]
    own = [(step.token_ids[n], "own")] if len(step.token_ids) > n else []  # none when a stop ended the run
    return kept + own + [(t, "rejected") for t in drafts[n:]]


def verify_columns(step) -> list[list[tuple[int, str]]]:
    """One verify step by the positions it guessed: column i holds what was drafted for the step's
    (i + 1)-th new position and, at the first miss, the model's token for that same position.

    States: ``kept``, ``rejected`` (the first wrong draft), ``after_miss`` (drafts after it, rolled
    back unjudged), ``own`` (the model's token: the correction at the miss, or the bonus token one
    column past the drafts when all were kept)."""
    drafts, n = list(step.draft_token_ids), step.num_accepted
    own = step.token_ids[n] if len(step.token_ids) > n else None  # None when a stop ended the answer
    columns = [[(t, "kept")] for t in drafts[:n]]
    if n < len(drafts):
        columns.append([(drafts[n], "rejected")] + ([(own, "own")] if own is not None else []))
        columns += [[(t, "after_miss")] for t in drafts[n + 1 :]]
    elif own is not None:
        columns.append([(own, "own")])
    return columns


def visible_token(text: str, width: int = 9) -> str:
    """A token's text as a cell can show it: spaces as ␣, newlines as ⏎ and tabs as ⇥ (code
    drafts are often just indentation, which would otherwise print as an empty cell)."""
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")[:width] or "∅"


def verify_figure(steps, token_text, title: str = "", max_steps: int = 12):
    """One row per verify step, one column per position its drafts guessed.

    ``steps``: ``SpecStep`` records (``RequestOutput.metrics.spec_steps``); ``token_text(id)``
    gives a token's text. A row is labelled with the positions its cells stand for (its first
    cell is the token after the verify's last verified one). Where the model rejected a draft,
    the cell is split: the wrong guess on top, the model's own token for that position below.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = list(steps)[:max_steps]
    rows = [verify_columns(step) for step in steps]
    width = max((len(columns) for columns in rows), default=1)  # a "+k+1" column only where a bonus was drawn
    fig, ax = plt.subplots(figsize=(1.25 * width + 2.4, 0.55 * len(steps) + 1.6))
    colors = {"kept": KEPT, "rejected": REJECTED, "own": OWN, "after_miss": AFTER_MISS}

    def cell(col, top, height, token, state):
        ax.add_patch(plt.Rectangle((col, top), 0.94, height, color=colors[state], alpha=0.9))
        text = visible_token(token_text(token))
        ax.text(
            col + 0.47,
            top + height / 2,
            text,
            ha="center",
            va="center",
            fontsize=10,
            family="monospace",  # "." and "," stay apart at a glance
            fontweight="bold",
            color="black" if state == "after_miss" else "white",
        )

    for row, (step, columns) in enumerate(zip(steps, rows)):
        for col, stack in enumerate(columns):
            height = 0.86 / len(stack)  # a split cell: the wrong guess above, the correction below
            for j, (token, state) in enumerate(stack):
                cell(col, row + j * height, height, token, state)
        first = step.position + 1
        label = f"pos {first}" if len(columns) == 1 else f"pos {first}–{first + len(columns) - 1}"
        ax.text(-0.15, row + 0.43, label, ha="right", va="center", fontsize=8)
    for col in range(width):  # columns count positions after the step's last verified token
        ax.text(col + 0.47, -0.12, f"+{col + 1}", ha="center", va="bottom", fontsize=8, color="dimgrey")
    ax.set_xlim(-1.8, width)
    ax.set_ylim(len(steps), -0.55)
    ax.axis("off")
    ax.set_title(title or "verify steps: what was drafted, kept and rolled back", fontsize=10)
    ax.legend(
        handles=[
            Patch(color=KEPT, label="draft kept (KV row stays)"),
            Patch(color=REJECTED, label="draft rejected (top of a split cell)"),
            Patch(color=OWN, label="the model's own token (correction or bonus)"),
            Patch(color=AFTER_MISS, label="guessed after a miss (rolled back)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    return fig


RUN_MARKERS = ("D", "s", "^", "v", "P", "*")


def yield_figure(max_k: int = 8, alphas=ALPHAS, runs: list[SpeculationRun] = (), ax=None, highlight=None):
    """Expected tokens per verify step against k, one curve per α; measured runs as labelled points."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5 + 2.5 * bool(runs), 4.2))
    ks = list(range(0, max_k + 1))
    for alpha in alphas:
        ax.plot(ks, [expected_tokens_per_step(alpha, k) for k in ks], marker=".", label=f"α = {alpha:g}")
    # Each run is a black marker of its own shape, named in a legend of its own: labels written
    # beside the points would crowd wherever two runs land close together.
    run_handles = [
        ax.plot(
            [run.mean_drafts],
            [run.tokens_per_step],
            marker=shape,
            markersize=7,
            color="black",
            markeredgecolor="white",
            markeredgewidth=0.8,
            linestyle="none",
            zorder=5,  # above the curves and the highlight ring
            label=f"{run.label} (α ≈ {run.alpha:.2f})",
        )[0]
        for run, shape in zip(runs, itertools.cycle(RUN_MARKERS))
    ]
    if highlight is not None:
        k, alpha = highlight
        ax.plot(
            [k],
            [expected_tokens_per_step(alpha, k)],
            marker="o",
            markersize=13,
            markerfacecolor="none",
            markeredgecolor="red",
            markeredgewidth=1.2,
            linestyle="none",
            zorder=4,  # beneath the measured runs' markers: a run inside the ring stays visible
            label=f"k = {k}, α = {alpha:.2f}",
        )
    ax.set_xlabel("draft tokens per verify step, k (a run: its drafts per verify on average)")
    ax.set_ylabel("tokens per verify step")
    ax.set_title("What one verify step yields: (1 − α^(k+1)) / (1 − α)")
    ax.grid(alpha=0.3)
    ax.legend(handles=[line for line in ax.get_lines() if line not in run_handles], fontsize=8, loc="upper left")
    if run_handles:  # the runs' names to the right of the axes, in a legend of the figure's own
        ax.figure.tight_layout(rect=(0, 0, 0.72, 1))
        ax.figure.legend(
            handles=run_handles,
            title="measured runs",
            title_fontsize=8,
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(0.73, 0.93),
            frameon=False,
        )
    else:
        ax.figure.tight_layout()
    return ax.figure


def update_speculation(k: int, alpha: float, runs: list[SpeculationRun] = ()):
    """The widget's callback: the curve with (k, α) marked, and predicted against measured tokens per step."""
    fig = yield_figure(max(8, k), runs=runs, highlight=(k, alpha))
    lines = [f"predicted at k = {k}, α = {alpha:.2f}: {expected_tokens_per_step(alpha, k):.2f} tokens per verify step"]
    for run in runs:
        lines.append(
            f"{run.label}: measured {run.tokens_per_step:.2f} at k = {run.k}, {run.mean_drafts:.2f} drafts a verify "
            f"(α ≈ {run.alpha:.2f}; the formula at those drafts gives {run.expected_at_drafts:.2f})"
        )
    return fig, "\n".join(lines)


def speculation_panel(runs: list[SpeculationRun] = ()):
    """Sliders for k and α over ``update_speculation`` (needs ipywidgets)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    k = widgets.IntSlider(value=4, min=1, max=12, description="k")
    alpha = widgets.FloatSlider(value=0.7, min=0.0, max=1.0, step=0.05, description="α")
    out = widgets.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, text = update_speculation(k.value, alpha.value, runs)
            display(fig)
            plt.close(fig)
            print(text)

    k.observe(redraw, names="value")
    alpha.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([k, alpha]), out])
