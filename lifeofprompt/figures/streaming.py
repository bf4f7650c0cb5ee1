"""The streams' tokens while a long prompt prefills, with and without chunking (chapter 09)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .footer import add_footer


def plot_stream_gaps(results, footer: str | None = None):
    """One panel per run: every stream's tokens as ticks on one time axis, the long prompt's prefill
    shaded from its arrival to its first token. A wide hole between ticks is a user's stall."""
    end = max(max(t[-1] for t in r.token_times.values()) for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.2 + 1.3 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        names = list(r.token_times)
        ax.eventplot(
            [r.token_times[n] for n in names], colors="#1f77b4", lineoffsets=range(len(names)), linelengths=0.7
        )
        ax.axvspan(
            r.arrival_s,
            r.arrival_s + r.long_ttft_s,
            color="#ff7f0e",
            alpha=0.18,
            label=f"{r.long_len}-token prompt prefills ({len(r.prefill_chunks)} step"
            f"{'s' if len(r.prefill_chunks) != 1 else ''})",
        )
        ax.set_yticks(range(len(names)), [f"user {i + 1}" for i in range(len(names))], fontsize=8)
        ax.set_ylim(-0.7, len(names) + 0.6)  # a free row on top for the legend, off the ticks
        ax.set_title(
            f"{r.label}: gaps while it prefills {r.median_gap_s * 1e3:.0f} ms median, {r.worst_gap_s * 1e3:.0f} ms "
            f"worst; {r.steady_gap_s * 1e3:.0f} ms before",
            fontsize=9,
            loc="left",
        )
        ax.legend(loc="upper right", fontsize=7.5, framealpha=0.9, borderpad=0.3)
    axes[-1, 0].set_xlim(0, end * 1.02)
    axes[-1, 0].set_xlabel("seconds since the streams started (each tick: one token reaches its user)")
    fig.tight_layout()
    if footer:
        add_footer(fig, footer)
    return fig
