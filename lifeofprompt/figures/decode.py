"""Figures of notebooks 03 and 04: the cost of each decode step, and what it adds up to."""

from __future__ import annotations

from itertools import accumulate


def plot_steps_and_total(
    lengths: list[int], series: dict[str, list[float]], unit: str, title: str, scale: float = 1.0, log: bool = False
):
    """Two panels over sequence length: each step's cost, and the running total to that length.

    ``series`` maps a label ("without cache", "with cache") to one value per step; values are
    divided by ``scale`` (e.g. 1e9 for GFLOP) and drawn against ``lengths``. ``log`` draws both
    y axes logarithmic, so that a series hundreds of times smaller than another stays visible.
    """
    import matplotlib.pyplot as plt

    fig, (per_step, total) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, values in series.items():
        values = [v / scale for v in values]
        marker = "." if len(values) <= 100 else None
        per_step.plot(lengths[: len(values)], values, marker=marker, label=label)
        total.plot(lengths[: len(values)], list(accumulate(values)), marker=marker, label=label)
    per_step.set_title(f"{title}: each step")
    total.set_title(f"{title}: running total")
    per_step.set_ylabel(f"{unit} (log scale)" if log else unit)
    total.set_ylabel(f"{unit}, summed (log scale)" if log else f"{unit}, summed")
    for ax in (per_step, total):
        ax.set_xlabel("tokens in the sequence at that step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both" if log else "major")
        ax.legend()
    fig.tight_layout()
    return fig


def plot_time_against_count(
    lengths: list[int], seconds: dict[str, list[float]], flops: dict[str, list[float]], title: str
):
    """Measured milliseconds of one step (left axis, dots) and counted GFLOP (right axis, dashed) per length."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    right = ax.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (label, values) in zip(colors, seconds.items()):
        ax.plot(lengths, [v * 1e3 for v in values], "o-", color=color, label=f"{label}: measured (ms, left)")
    for color, (label, values) in zip(colors, flops.items()):
        right.plot(
            lengths, [v / 1e9 for v in values], "--", color=color, alpha=0.6, label=f"{label}: counted (GFLOP, right)"
        )
    ax.set_xlabel("tokens in the sequence at that step")
    ax.set_ylabel("ms per step (measured)")
    right.set_ylabel("GFLOP per step (counted)")
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    ax.set_title(title)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
