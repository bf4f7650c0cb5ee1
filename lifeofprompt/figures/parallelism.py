"""Tensor and pipeline parallelism drawn (notebook 15): the matrix split, the pipeline timeline,
and the measured step beside the cost model.

``split_figure`` draws one layer's two splits over ``T`` ranks: the column split of q/k/v (each
rank its heads, no communication) and the row split of ``o_proj`` (each rank a partial sum of
the whole output, added up by one all-reduce). ``bubble_figure`` draws ``lessons.parallelism``'s
pipeline schedules, stage by stage in time. ``steps_figure`` draws the engine's step times per
layout with the share spent in collectives. ``measured_figure`` sets the engine's step times and
collective times beside what the fitted cost model predicted. ``links_figure`` runs the same
model for GPU links.
"""

from __future__ import annotations

from ..lessons.parallelism import StageSlot, utilisation

RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
LIGHT = "#e8e8e8"


def _block(ax, x, y, w, h, color, text="", fontsize=9, text_color="white"):
    import matplotlib.pyplot as plt

    ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1.5))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def split_figure(ranks: int = 3):
    """Left: ``X @ W`` with ``W`` split by output columns. Right: split by input rows, then the all-reduce."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    w = 3.0 / ranks
    # column-parallel: X (full, on every rank) times W's column slices = each rank's own heads
    _block(left, 0, 1, 1.2, 3, "#999999", "X\n[tokens,\nhidden]\n(every\nrank)")
    left.text(1.45, 2.5, "@", fontsize=16, ha="center", va="center")
    for r in range(ranks):
        _block(left, 1.8 + r * w, 1, w, 3, RANK_COLORS[r], f"W\ncols\nrank {r}", fontsize=8)
    left.text(5.05, 2.5, "=", fontsize=16, ha="center", va="center")
    for r in range(ranks):
        _block(left, 5.4 + r * w, 1, w, 3, RANK_COLORS[r], f"q/k/v\nrank {r}", fontsize=8)
    left.text(
        4.0,
        0.45,
        "column split (q/k/v, gate/up): each rank computes its own heads;\nno communication",
        ha="center",
        va="center",
        fontsize=9,
    )
    left.set_title("column-parallel", fontsize=11)
    # row-parallel: X's column slices (what each rank's heads produced) times W's row slices = partial sums
    for r in range(ranks):
        _block(right, r * 0.5, 1, 0.5, 3, RANK_COLORS[r], f"X{r}", fontsize=8)
    right.text(1.8, 2.5, "@", fontsize=16, ha="center", va="center")
    for r in range(ranks):
        _block(right, 2.2, 1 + (ranks - 1 - r) * w, 1.6, w, RANK_COLORS[r], f"W rows, rank {r}", fontsize=8)
    right.text(4.15, 2.5, "=", fontsize=16, ha="center", va="center")
    for r in range(ranks):
        _block(right, 4.4 + r * 0.25, 1.3 - r * 0.15, 1.1, 2.5, RANK_COLORS[r], "", fontsize=8)
    right.text(5.2, 4.05, "partial Y, one per rank", ha="center", va="center", fontsize=8)
    right.annotate("", xy=(7.4, 2.5), xytext=(6.15, 2.5), arrowprops=dict(arrowstyle="->", lw=2))
    right.text(6.8, 2.75, "all-reduce\n(sum)", ha="center", fontsize=9)
    _block(right, 7.5, 1, 1.2, 3, "#333333", "Y\n[tokens,\nhidden]\n(every\nrank)")
    right.text(
        4.3,
        0.45,
        "row split (o_proj, down_proj): each rank's product is a partial sum of all of Y;\n"
        "one all-reduce of tokens × hidden adds them up",
        ha="center",
        va="center",
        fontsize=9,
    )
    right.set_title("row-parallel", fontsize=11)
    for ax in (left, right):
        ax.set_xlim(-0.2, 8.9)
        ax.set_ylim(0, 4.4)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(
        f"one attention block over {ranks} ranks: column split, then row split, then one all-reduce", fontsize=12
    )
    fig.tight_layout()
    return fig


def _timeline(ax, slots: list[StageSlot], num_stages: int, title: str) -> None:
    for s in slots:
        _block(
            ax,
            s.start,
            num_stages - 1 - s.stage,
            s.end - s.start,
            0.9,
            RANK_COLORS[s.group % len(RANK_COLORS)],
            f"r{s.group} s{s.step}",
            fontsize=7,
        )
    end = max(s.end for s in slots)
    ax.set_xlim(0, end)
    ax.set_ylim(-0.1, num_stages)
    ax.set_yticks([num_stages - 1 - k + 0.45 for k in range(num_stages)], [f"stage {k}" for k in range(num_stages)])
    ax.set_title(f"{title}: stages busy {utilisation(slots, num_stages):.0%} of the time", fontsize=10)
    ax.set_xlabel("time (one stage's step = 1)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def bubble_figure(schedules: list[tuple[str, list[StageSlot]]], num_stages: int):
    """One timeline per ``(title, slots)``; a box ``rG sK`` is request group G's step K on that stage."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.0 + 0.75 * num_stages * len(schedules)), squeeze=False)
    width = max(max(s.end for s in slots) for _, slots in schedules)
    for ax, (title, slots) in zip(axes[:, 0], schedules):
        _timeline(ax, slots, num_stages, title)
        ax.set_xlim(0, width)
    fig.tight_layout()
    return fig


def _step_bars(ax, runs) -> None:
    labels = [r.label for r in runs]
    steps = [r.mean_step_s * 1e3 for r in runs]
    comm = [min(r.collective_seconds_per_step() * 1e3, s) for r, s in zip(runs, steps)]
    ax.bar(labels, steps, color="#4c72b0", label="whole step (mean)")
    ax.bar(labels, comm, color="#dd8452", hatch="//", label="in collectives (rank 0)")
    for i, s in enumerate(steps):
        ax.text(i, s, f"{s:.1f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def steps_figure(runs, title: str = "the engine on this CPU, gloo, 1 thread per rank"):
    """The mean step of each run (``collective_bench.EngineRun``), its collective time hatched."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    _step_bars(ax, runs)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def measured_figure(runs, predicted: dict[str, float], checked=None):
    """Left: decode step time per split, its collective share hatched. Right: collective seconds
    per step, measured on rank 0 against the fitted model (``predicted``: label -> seconds per step).

    ``checked``: the runs the prediction was made for, where they are not ``runs`` themselves (the
    cost-model check runs its own engine): the right panel must set a prediction beside the run it
    predicted, not beside another run of the same split."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    _step_bars(left, runs)
    left.set_title("the engine on this CPU, gloo, 1 thread per rank", fontsize=10)
    shown = [r for r in (runs if checked is None else checked) if r.label in predicted]
    for i, r in enumerate(shown):
        pair = (
            (i - 0.18, r.collective_seconds_per_step() * 1e3, "#dd8452"),
            (i + 0.18, predicted[r.label] * 1e3, "#8c8c8c"),
        )
        for x, value, color in pair:
            right.bar(x, value, 0.34, color=color)
            right.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=9)
    right.set_xticks(range(len(shown)), [r.label for r in shown])
    right.set_xlim(-0.7, len(shown) - 0.3)
    right.set_ylabel("ms of collectives per step")
    right.set_title("collectives: measured (orange) against\nL + n/β fitted on other sizes (grey)", fontsize=10)
    for side in ("top", "right"):
        right.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def links_figure(curves: dict[str, tuple[list[int], list[float]]], floor_s: dict[str, float], title: str):
    """Seconds of communication per step against batch tokens, one curve per layout; the decode
    floors (weights over HBM bandwidth) as dashed lines to compare with."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(9, 5.4))
    styles = (("o", "-"), ("s", "-"), ("^", "--"))
    for (name, (tokens, seconds)), color, (marker, line) in zip(curves.items(), RANK_COLORS, styles):
        ax.plot(tokens, [s * 1e3 for s in seconds], marker=marker, linestyle=line, color=color, label=name)
    for (name, s), style in zip(floor_s.items(), ("--", ":", "-.")):
        ax.axhline(s * 1e3, color="#333333", linestyle=style, linewidth=1, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))
    ax.set_xlabel("tokens in the step (batch of decodes)")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
