"""The figures of chapters 09 and 13: a short request beside a long prompt, the batching curve, and what users
wait under load.

Each function takes measured results (``serving_study.BatchPoint``s, ``loadtest.LoadTestResult``s)
and returns a matplotlib ``Figure``; each figure carries a footer naming the machine it was
measured on, since every number in it belongs to that machine.
"""

from __future__ import annotations

import os

import numpy as np

from ..loadtest.client import waiting_over_time


def machine_label() -> str:
    """Which machine, which versions, and how busy it was (the 1-minute load average)."""
    import torch

    from ..env import cpu_label, env_info

    info = env_info()
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    where = info["device"] if torch.cuda.is_available() else f"{cpu_label()}, {os.cpu_count()} cores, no GPU"
    return f"measured on {where}, torch {info['torch']} with {torch.get_num_threads()} thread(s){load}, {info['date']}"


def _finish(fig, label: str | None):
    """Tight layout above a footer line naming the machine (``label``, else ``machine_label()``)."""
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.text(0.01, 0.005, label if label is not None else machine_label(), fontsize=7, color="dimgray", va="bottom")
    return fig


def plot_batching_curve(
    points, predicted_s, floor_s: float, title: str = "The batching curve", label: str | None = None
):
    """Step time and tokens/s against sequences in flight: measured, the roofline, the decode floor.

    The panel titles state the measured ratios, not a shape: whether the curve bends, and where,
    belongs to the machine it was measured on.
    """
    import matplotlib.pyplot as plt

    batch = np.array([p.batch_size for p in points])
    measured = np.array([p.step_s for p in points])
    predicted = np.asarray(predicted_s)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(batch, measured * 1e3, "o-", label="measured decode step (fastest)")
    if all(p.median_s is not None for p in points):
        left.plot(batch, [p.median_s * 1e3 for p in points], "o:", color="C0", alpha=0.4, label="measured (median)")
    left.plot(batch, predicted * 1e3, "s--", label="roofline prediction")
    left.axhline(
        floor_s * 1e3, color="gray", linestyle=":", label=f"decode floor (weights ÷ bandwidth): {floor_s * 1e3:.0f} ms"
    )
    left.set(
        xscale="log",
        xlabel="sequences decoding together (batch size)",
        ylabel="time per step (ms)",
        title=f"Step time: {measured[-1] / measured[0]:.1f}× from {batch[0]} to {batch[-1]} sequences",
    )
    right.plot(batch, batch / measured, "o-", label="measured")
    right.plot(batch, batch / predicted, "s--", label="roofline prediction")
    right.set(
        xscale="log",
        xlabel="sequences decoding together (batch size)",
        ylabel="output tokens per second",
        title=f"Throughput: {(batch[-1] / measured[-1]) / (batch[0] / measured[0]):.1f}× from {batch[0]} to "
        f"{batch[-1]} sequences",
    )
    for ax in (left, right):
        ax.set_xticks(batch, [str(b) for b in batch])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _finish(fig, label)


def ttft_rows(results, capacity: float) -> list[dict]:
    """One row per run, in order of the rate achieved: the numbers the TTFT figure plots and tabulates."""
    rows = [
        dict(
            set_factor=r.config.rate / capacity,
            set_rate=r.config.rate,
            got=r.summary["achieved_arrival_rate"],
            offered_factor=r.summary["achieved_arrival_rate"] / capacity,
            p50=r.summary["ttft_s"]["p50"],
            p99=r.summary["ttft_s"]["p99"],
        )
        for r in results
    ]
    rows.sort(key=lambda row: row["got"])
    return [dict(row, number=i + 1) for i, row in enumerate(rows)]


def log_ticks(low: float, high: float, mantissas=(1, 2, 3, 5)) -> list[float]:
    """Tick values for a log axis from ``low`` to ``high``: 1, 2, 3, 5 in every decade, none crowding the next."""
    ticks = []
    for exponent in range(int(np.floor(np.log10(low))) - 1, int(np.ceil(np.log10(high))) + 1):
        ticks += [float(f"{m}e{exponent}") for m in mantissas if low <= m * 10.0**exponent <= high]
    return ticks


def plot_ttft_against_rate(results, capacity: float, label: str | None = None):
    """Median and p99 time to first token against the achieved arrival rate, capacity marked.

    Each run is a numbered pair of points; its numbers (set and achieved rate, p50, p99) stand in
    a table beside the plot rather than as labels on it, where runs at nearby rates collide.
    """
    import matplotlib.pyplot as plt

    rows = ttft_rows(results, capacity)
    got = np.array([row["got"] for row in rows])
    p50, p99 = np.array([row["p50"] for row in rows]), np.array([row["p99"] for row in rows])
    fig, (ax, side) = plt.subplots(1, 2, figsize=(10.5, 4.5), gridspec_kw={"width_ratios": [2.3, 1]})
    ax.plot(got, p50, "o-", label="median (p50)")
    ax.plot(got, p99, "^-", label="p99")
    ax.axvline(capacity, color="gray", linestyle=":", label=f"closed-loop capacity {capacity:.2f} req/s")
    for row in rows:  # the run's number under its median, where no other label is
        ax.annotate(
            str(row["number"]),
            (row["got"], row["p50"]),
            textcoords="offset points",
            xytext=(0, -13),
            ha="center",
            fontsize=8,
            fontweight="bold",
            color="C0",
        )
    low, high = float(min(p50.min(), p99.min())) / 1.6, float(max(p50.max(), p99.max())) * 1.4
    span = (max(got.max(), capacity) - min(got.min(), capacity)) or capacity or 1.0
    ax.set_xlim(min(got.min(), capacity) - 0.06 * span, max(got.max(), capacity) + 0.06 * span)
    ax.set(
        yscale="log",
        ylim=(low, high),
        xlabel="achieved arrival rate (requests per second, Poisson)",
        ylabel="time to first token (s, log scale)",
        title="Time to first token against the arrival rate: median and p99",
    )
    ax.set_yticks(log_ticks(low, high), [f"{t:g}" for t in log_ticks(low, high)])
    ax.yaxis.set_minor_locator(plt.NullLocator())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    side.axis("off")
    height = 0.09 * (len(rows) + 1)
    table = side.table(
        cellText=[
            [
                str(row["number"]),
                f"{row['offered_factor']:.2f}×",
                f"{row['got']:.2f}",
                f"{row['p50']:.2f}",
                f"{row['p99']:.2f}",
            ]
            for row in rows
        ],
        colLabels=["run", "offered", "got", "p50", "p99"],
        cellLoc="center",
        bbox=(0, 1 - height, 1, height),
    )
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    side.text(
        0,
        1 - height - 0.04,
        "run: its number on the plot\noffered: the rate the arrivals\nachieved, × capacity\n"
        "got: the same in req/s\np50, p99: time to first token, s",
        fontsize=8,
        va="top",
        color="dimgray",
        transform=side.transAxes,
    )
    side.set_title("the runs", fontsize=10)
    return _finish(fig, label)


def plot_queue_growth(results, capacity: float, label: str | None = None):
    """Requests sent but still without a first token, over time: one panel per arrival rate (shared
    axes), since four step lines drawn over each other cannot be told apart."""
    import matplotlib.pyplot as plt

    runs = sorted(results, key=lambda r: r.config.rate)
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(7.5, 1.25 * len(runs) + 1.2), sharex=True, sharey=True, squeeze=False
    )
    for ax, r, colour in zip(axes[:, 0], runs, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        times, waiting = waiting_over_time(r)
        ax.step(times, waiting, where="post", linewidth=1.2, color=colour)
        ax.fill_between(times, waiting, step="post", alpha=0.2, color=colour)
        offered = r.summary["achieved_arrival_rate"]  # what the schedule offered (its set rate is a little higher)
        ax.set_title(f"{offered:.2f} req/s offered ({offered / capacity:.2f}× capacity)", fontsize=8, pad=2)
        ax.set_ylabel("waiting", fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first request (waiting: requests sent, no first token yet)")
    fig.suptitle(
        "Bursts of Poisson arrivals build a queue, which drains in the lulls;\n"
        "one run per rate, so its peak is chance as much as load",
        fontsize=10,
    )
    return _finish(fig, label)


def plot_repeats(results, label: str | None = None):
    """The same load test, several seeds: p50 and p99 time to first token per run."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = np.arange(len(results))
    p50 = [r.summary["ttft_s"]["p50"] for r in results]
    p99 = [r.summary["ttft_s"]["p99"] for r in results]
    ax.bar(x - 0.2, p50, width=0.4, label="median (p50)")
    ax.bar(x + 0.2, p99, width=0.4, label="p99")
    ax.set_xticks(x, [f"seed {r.config.seed}\n{r.summary['achieved_arrival_rate']:.2f} req/s" for r in results])
    rate = results[0].config.rate if results else float("nan")
    ax.set(
        ylabel="time to first token (s)",
        xlabel="run (seed, achieved arrival rate)",
        title=f"Same set rate ({rate:.2f} req/s), different runs: p99 moves",
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, label)


def plot_fair_prefill(off, on, alone_s: float, label: str | None = None):
    """A short request beside a long prefill (``lessons.fair_prefill.ShortBesideLong``), cap off and on.

    Left: each engine step as a box on a time line, blue while only the long prompt computes,
    orange once the short request shares the step; the short request's arrival (▼) and first
    token (★). Right: its time to first token alone, and beside the long prompt without and with the cap.
    """
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [2.2, 1]})
    runs = [(1, "cap off", off), (0, f"cap on ({on.threshold} tokens)", on)]
    for y, _, run in runs:
        for span in run.spans:
            colour = "tab:orange" if span.short_tokens else "tab:blue"
            left.broken_barh(
                [(span.start_s, span.duration_s)], (y - 0.3, 0.6), facecolors=colour, edgecolors="white", linewidth=1.2
            )
            if span.duration_s > 0.06 * max(r.spans[-1].end_s for _, _, r in runs):
                left.text(
                    span.start_s + span.duration_s / 2,
                    y,
                    f"{span.long_tokens + span.short_tokens:,}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
        left.plot([run.short_arrival_s], [y + 0.38], "v", color="black", markersize=8)
        left.plot([run.first_token_s], [y + 0.38], "*", color="black", markersize=12)
        left.annotate(
            "",
            (run.first_token_s, y + 0.38),
            (run.short_arrival_s, y + 0.38),
            arrowprops=dict(arrowstyle="<->", color="black", shrinkA=6, shrinkB=7),
        )
        left.text(
            (run.short_arrival_s + run.first_token_s) / 2,
            y + 0.46,
            f"TTFT {run.ttft_s:.2f} s",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    left.set_yticks([y for y, _, _ in runs], [name for _, name, _ in runs])
    left.set_ylim(-0.6, 2.35)  # the legend above the TTFT labels
    left.set(
        xlabel="seconds since the long prompt arrived (numbers: tokens computed in the step)",
        ylabel="long_prefill_token_threshold",
        title=f"A {off.short_len}-token request arrives while a {off.long_len:,}-token prompt prefills",
    )
    from matplotlib.patches import Patch

    left.legend(
        handles=[
            Patch(color="tab:blue", label="step: only the long prompt"),
            Patch(color="tab:orange", label="step: the short request too"),
            plt.Line2D([], [], marker="v", color="black", linestyle="", label="short request arrives"),
            plt.Line2D([], [], marker="*", color="black", linestyle="", markersize=10, label="its first token"),
        ],
        fontsize=8,
        loc="upper right",
        ncol=2,
    )
    left.grid(True, axis="x", alpha=0.3)
    names = ["alone\n(idle engine)", "beside it,\ncap off", "beside it,\ncap on"]
    values = [alone_s, off.ttft_s, on.ttft_s]
    bars = right.bar(names, values, color=["tab:gray", "tab:red", "tab:green"])
    for bar, value in zip(bars, values):
        right.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f} s", ha="center", va="bottom", fontsize=9)
    right.set_ylim(0, max(values) * 1.15)
    right.set(ylabel="time to first token (s)", title="The short request's wait")
    right.grid(True, axis="y", alpha=0.3)
    return _finish(fig, label)
