"""Figures of notebook 02: the decoder layer as boxes, and one naive decode step beside one cached step.

``plot_decoder_layer`` draws the boxes ``lifeofprompt.model.llama`` has one class for, in the order
a token's vector passes through them. ``plot_naive_vs_cached`` takes the toy of
``lessons.toy_attention`` with the next token appended ("a sunset is extremely") and colours
every cell of the step by what happens to it: computed and needed, computed again although the
previous step already had it, or read back from the cache.
"""

from __future__ import annotations

import torch

from ..lessons.toy_attention import ToyAttention

# (label, the class or weight in lifeofprompt.model.llama, colour)
LAYER_BOXES = [
    ("RMSNorm", "input_layernorm", "#e9c46a"),
    ("Q, K, V\nprojection", "self_attn.qkv_proj", "#8ab6d6"),
    ("RoPE\non Q and K", "rotary", "#8ab6d6"),
    ("attention\n(grouped-\nquery)", "attention", "#8ab6d6"),
    ("output\nprojection", "self_attn.o_proj", "#8ab6d6"),
    ("+", "residual", "#ffffff"),
    ("RMSNorm", "post_attention_layernorm", "#e9c46a"),
    ("gate, up\nprojection", "mlp.gate_up_proj", "#a8d5a2"),
    ("SiLU(gate)\n× up", "SwiGLU", "#a8d5a2"),
    ("down\nprojection", "mlp.down_proj", "#a8d5a2"),
    ("+", "residual", "#ffffff"),
]


def wrapped_module_name(code: str) -> str:
    """A module's dotted name on two lines where it is too long for its box: after the first dot, else
    after the underscore nearest its middle (``post_attention_`` / ``layernorm``)."""
    if len(code) <= 12:
        return code
    if "." in code:
        return code.replace(".", ".\n", 1)
    cuts = [i for i, ch in enumerate(code) if ch == "_"]
    if not cuts:
        return code
    cut = min(cuts, key=lambda i: abs(i - len(code) / 2))
    return code[: cut + 1] + "\n" + code[cut + 1 :]


def plot_decoder_layer(num_layers: int, hidden: int, shapes: dict[str, str] | None = None):
    """One decoder layer as a row of boxes, the two residual paths drawn over them.

    ``shapes`` (optional) maps a box's code name to the shape of what comes out of it, written under the box.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    shapes = shapes or {}
    fig, ax = plt.subplots(figsize=(14, 3.6))
    width, gap = 1.05, 0.3
    x = 0.9
    centres = []
    ax.text(0.35, 0.5, f"x\n[T, {hidden}]", ha="center", va="center", fontsize=10.5)
    for label, code, colour in LAYER_BOXES:
        w = 0.38 if label == "+" else width
        ax.add_patch(
            FancyBboxPatch(
                (x, 0.15),
                w,
                0.7,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=colour,
                edgecolor="#333333",
                linewidth=0.9,
            )
        )
        ax.text(x + w / 2, 0.5, label, ha="center", va="center", fontsize=10 if label != "+" else 14)
        if label != "+":
            ax.text(
                x + w / 2,
                0.08,
                wrapped_module_name(code),
                ha="center",
                va="top",
                fontsize=8.5,
                family="monospace",
                color="#444444",
            )
        if code in shapes:
            ax.text(x + w / 2, -0.32, shapes[code], ha="center", va="top", fontsize=9.5, color="#1d3557")
        centres.append((x, w))
        x += w + gap
    for (x0, w0), (x1, _) in zip(centres, centres[1:]):
        ax.annotate("", (x1, 0.5), (x0 + w0, 0.5), arrowprops=dict(arrowstyle="->", color="#333333", lw=0.9))
    ax.annotate("", (0.9, 0.5), (0.6, 0.5), arrowprops=dict(arrowstyle="->", color="#333333", lw=0.9))
    ax.text(
        x + 0.1,
        0.5,
        f"to the other {num_layers - 1} layers,\nthen final RMSNorm\nand the LM head",
        ha="left",
        va="center",
        fontsize=10,
    )
    ax.text(0.35, 0.08, "module:", ha="center", va="top", fontsize=8.5, color="#444444")
    if shapes:
        ax.text(0.35, -0.32, "output:", ha="center", va="top", fontsize=9.5, color="#1d3557")
    plus = [c for c, box in zip(centres, LAYER_BOXES) if box[0] == "+"]
    starts = [0.75, centres[5][0] + centres[5][1] + gap / 2]  # x before the norm, then the sum after attention
    for start, (px, pw), name in zip(starts, plus, ("attention", "MLP")):
        end = px + pw / 2
        ax.plot([start, start, end], [0.5, 1.1, 1.1], color="#c1121f", lw=1.1)
        ax.annotate("", (end, 0.86), (end, 1.1), arrowprops=dict(arrowstyle="->", color="#c1121f", lw=1.1))
        ax.text(
            (start + end) / 2,
            1.14,
            f"residual: x + {name}(norm(x))",
            ha="center",
            va="bottom",
            fontsize=10,
            color="#c1121f",
        )
    ax.set_xlim(0, x + 1.6)
    ax.set_ylim(-0.6, 1.35)
    ax.axis("off")
    ax.set_title(
        f"One of {num_layers} decoder layers: every box is one module of lifeofprompt.model.llama "
        "(yellow: norm, blue: attention, green: MLP)",
        fontsize=12,
    )
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- naive against cached

NEEDED, AGAIN, CACHED, MASKED = "#a8d5a2", "#f4a6a6", "#9ecae1", "#d9d9d9"


def _cells(ax, values: torch.Tensor, colours: list[list[str]], title: str, rows, cols):
    """A small matrix drawn cell by cell: the colour says what happened to the cell, the number is its value."""
    import matplotlib.patches as patches

    n_rows, n_cols = values.shape
    for i in range(n_rows):
        for j in range(n_cols):
            ax.add_patch(
                patches.Rectangle(
                    (j, n_rows - 1 - i), 0.96, 0.96, facecolor=colours[i][j], edgecolor="#555555", linewidth=0.5
                )
            )
            v = float(values[i, j])
            ax.text(
                j + 0.48,
                n_rows - 1 - i + 0.48,
                "−∞" if v == float("-inf") else f"{round(v, 1) + 0.0:.1f}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_xlim(-0.05, n_cols)
    ax.set_ylim(-0.05, n_rows)
    ax.set_aspect("equal")
    ax.set_xticks([j + 0.48 for j in range(n_cols)], cols, fontsize=7)
    ax.set_yticks([n_rows - 1 - i + 0.48 for i in range(n_rows)], rows, fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(f"{title} [{n_rows}×{n_cols}]", fontsize=8.5)


def plot_naive_vs_cached(toy: ToyAttention):
    """Top: the naive step over all n tokens. Bottom: the cached step, one new row over n cached keys and values.

    ``toy`` must hold the previous step's tokens plus the newest one (its last row).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(toy.tokens)
    dims = [f"d{i}" for i in range(toy.X.shape[1])]
    old_rows = lambda cols, last=NEEDED, old=AGAIN: [[old] * cols] * (n - 1) + [[last] * cols]  # noqa: E731
    square = [[MASKED if j > i else (NEEDED if i == n - 1 else AGAIN) for j in range(n)] for i in range(n)]
    fig, axes = plt.subplots(2, 5, figsize=(13, 5.6), gridspec_kw=dict(height_ratios=[n, n]))
    new = [toy.tokens[-1]]
    naive = [
        ("Q", toy.Q, old_rows(4)),
        ("K", toy.K, old_rows(4)),
        ("V", toy.V, old_rows(4)),
        ("scores, masked", toy.masked, square),
        ("context", toy.context, old_rows(4)),
    ]
    for ax, (name, values, colours) in zip(axes[0], naive):
        _cells(ax, values, colours, name, toy.tokens, toy.tokens if values.shape[1] == n and "scores" in name else dims)
    q_new = toy.Q[-1:]
    scores_new = q_new @ toy.K.T / toy.X.shape[1] ** 0.5
    context_new = scores_new.softmax(dim=-1) @ toy.V
    cached = [
        ("q (newest only)", q_new, [[NEEDED] * 4], new, dims),
        ("K: 3 cached + 1 new", toy.K, old_rows(4, NEEDED, CACHED), toy.tokens, dims),
        ("V: 3 cached + 1 new", toy.V, old_rows(4, NEEDED, CACHED), toy.tokens, dims),
        ("scores", scores_new, [[NEEDED] * n], new, toy.tokens),
        ("context", context_new, [[NEEDED] * 4], new, dims),
    ]
    for ax, (name, values, colours, rows, cols) in zip(axes[1], cached):
        _cells(ax, values, colours, name, rows, cols)
    axes[0, 0].annotate(
        "without a cache:\nall 4 rows again",
        (-0.9, 0.5),
        xycoords="axes fraction",
        ha="center",
        va="center",
        fontsize=9,
        rotation=90,
    )
    axes[1, 0].annotate(
        "with a cache:\none new row",
        (-0.9, 0.5),
        xycoords="axes fraction",
        ha="center",
        va="center",
        fontsize=9,
        rotation=90,
    )
    handles = [
        Patch(facecolor=NEEDED, edgecolor="#555555", label="computed, needed for the next token"),
        Patch(
            facecolor=AGAIN, edgecolor="#555555", label="computed again (the step before had it, or it is never used)"
        ),
        Patch(facecolor=CACHED, edgecolor="#555555", label="read from the cache, not computed"),
        Patch(facecolor=MASKED, edgecolor="#555555", label="masked (the future)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(
        f'"{" ".join(toy.tokens)}" → next token: the naive step recomputes {n}×{n}, '
        f"the cached step computes one row (same last context row)",
        fontsize=10.5,
    )
    fig.tight_layout(rect=(0.03, 0.08, 1, 0.96))
    return fig
