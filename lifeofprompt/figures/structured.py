"""The figure of structured output (notebook 09): the grammar's mask over one answer, and at one step.

Takes ``lessons.structured.MaskStep``s and returns a matplotlib ``Figure`` with a footer naming
the machine (``figures.serving.machine_label``), like every measured figure of the series.
"""

from __future__ import annotations

from .serving import _finish


def _show(text: str) -> str:
    """A token's text, with its spaces, newlines and control characters visible (a label must not be blank)."""
    text = text.replace("\n", "⏎").replace(" ", "·")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text) or "∅"


def plot_mask(steps, decode, vocab_size: int, at: int, title: str, label: str | None = None):
    """Left: how many of the vocabulary's tokens the grammar allowed at each step (log scale), red
    where the model's own first choice was refused. Right: at step ``at``, the model's top tokens
    without the mask, green where the grammar allowed them, grey where it set them to -inf."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.7, 1]})
    x = range(len(steps))
    colours = ["tab:red" if s.overridden else "tab:green" for s in steps]
    left.bar(x, [s.num_allowed for s in steps], color=colours)
    left.axhline(vocab_size, color="gray", linestyle=":", linewidth=1)
    left.text(len(steps) - 0.5, vocab_size, f"whole vocabulary: {vocab_size:,}", ha="right", va="bottom", fontsize=8)
    left.set_yscale("log")
    left.set_ylim(0.7, vocab_size * 3)
    left.set_xticks(list(x), [_show(decode(s.chosen)) for s in steps], rotation=70, fontsize=8)
    left.get_xticklabels()[at].set_fontweight("bold")
    left.set(xlabel="the token produced at each step", ylabel="tokens the grammar allows (log scale)",
             title="Allowed tokens per step (red: the model's first choice was refused)")
    left.grid(True, axis="y", alpha=0.3)
    step = steps[at]
    names = [_show(decode(t)) for t, _, _ in step.wanted]
    probs = [p for _, p, _ in step.wanted]
    bars = right.barh(range(len(names)), probs, color=["tab:green" if ok else "lightgray" for _, _, ok in step.wanted],
                      edgecolor=["black" if t == step.chosen else "none" for t, _, _ in step.wanted])
    right.set_yticks(range(len(names)), names, fontsize=9)
    right.invert_yaxis()
    for bar, (_, p, ok) in zip(bars, step.wanted):
        right.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {p:.3f}{'' if ok else '  refused'}",
                   va="center", fontsize=8)
    right.set_xlim(0, max(probs) * 1.45)
    right.set(xlabel="the model's probability without the mask",
              title=f"Step {at}: {step.num_allowed:,} of {vocab_size:,} allowed; chose {_show(decode(step.chosen))!s}")
    fig.suptitle(title)
    return _finish(fig, label)
