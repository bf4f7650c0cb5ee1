"""The figure of structured output (chapter 12): the grammar's mask over one answer, and at one step.

Takes ``lessons.structured.MaskStep``s and returns a matplotlib ``Figure`` with a footer naming
the machine (``figures.serving.machine_label``), like every measured figure of the series.
"""

from __future__ import annotations

from .serving import _finish


def _show(text: str) -> str:
    """A token's text, with its spaces, newlines and control characters visible (a label must not be blank)."""
    import re

    text = re.sub(r" {3,}", lambda m: f"·×{len(m.group())}", text.replace("\n", "\\n")).replace(" ", "·")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text) or "∅"


def plot_mask(steps, decode, vocab_size: int, at: int, title: str, label: str | None = None):
    """Left: how many of the vocabulary's tokens the grammar allowed at each step (log scale), red
    where the model's own first choice was refused. Right: at step ``at``, the model's top tokens
    without the mask, green where the grammar allowed them, grey where it set them to -inf, and
    below them the allowed tokens the model liked best (the chosen one outlined)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.7, 1]})
    x = range(len(steps))
    colours = ["tab:red" if s.overridden else "tab:green" for s in steps]
    left.bar(x, [s.num_allowed for s in steps], color=colours)
    left.axhline(vocab_size, color="gray", linestyle=":", linewidth=1)
    left.text(len(steps) - 0.5, vocab_size, f"whole vocabulary: {vocab_size:,}", ha="right", va="bottom", fontsize=8)
    left.set_yscale("log")
    left.set_ylim(0.7, vocab_size * 3)
    left.set_xticks(
        list(x), [_show(decode(s.chosen)) for s in steps], rotation=60, ha="right", fontsize=9, rotation_mode="anchor"
    )
    left.get_xticklabels()[at].set_fontweight("bold")
    left.set(
        xlabel="the token produced at each step",
        ylabel="tokens the grammar allows (log scale)",
        title="Allowed tokens per step (red: the model's first choice was refused)",
    )
    left.grid(True, axis="y", alpha=0.3)
    step = steps[at]
    wanted_ids = {t for t, _, _ in step.wanted}
    extra = [(t, p, True) for t, p in step.best_allowed if t not in wanted_ids]  # what the grammar let through
    rows = list(step.wanted) + extra
    names = [_show(decode(t)) for t, _, _ in rows]
    probs = [max(p, 1e-12) for _, p, _ in rows]
    bars = right.barh(
        range(len(rows)),
        probs,
        color=["tab:green" if ok else "lightgray" for _, _, ok in rows],
        edgecolor=["black" if t == step.chosen else "none" for t, _, _ in rows],
        linewidth=1.5,
    )
    right.set_yticks(range(len(rows)), names, fontsize=9)
    right.invert_yaxis()
    if extra:
        right.axhline(len(step.wanted) - 0.5, color="gray", linewidth=0.8, linestyle="--")
    for bar, (t, p, ok) in zip(bars, rows):
        note = "  chosen" if t == step.chosen else ("" if ok else "  refused")
        right.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {p:.2g}{note}", va="center", fontsize=8)
    right.set_xscale("log")
    right.set_xlim(min(probs) / 3, max(probs) * 40)
    right.set(
        xlabel="the model's probability without the mask (log scale)",
        title=f"Step {at}: {step.num_allowed:,} of {vocab_size:,} tokens allowed",
    )
    right.text(
        0.99,
        0.01,
        f"above the dashes: the model's top {len(step.wanted)}\nbelow: the allowed tokens it liked best"
        if extra
        else f"the model's top {len(step.wanted)}",
        transform=right.transAxes,
        ha="right",
        va="bottom",
        fontsize=7,
        color="dimgray",
    )
    fig.suptitle(title)
    return _finish(fig, label)
