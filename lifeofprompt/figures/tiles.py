"""How one paged-attention launch cuts a batch into tiles, drawn from the launch itself (chapter 11).

The figure takes a ``LaunchTiles`` plan (``lifeofprompt.lessons.kernel_tiles.launch_tiles``),
which is worked out from the very arguments the kernel ran with, so the picture and the check
printed beside it cannot drift apart: one panel per sequence of the batch, on one key axis.
"""

from __future__ import annotations


def panel_title(plan, index: int) -> str:
    """What the panel shows, in the plan's own numbers: rows, keys, tiles and splits of one sequence."""
    seq, config = plan.sequences[index], plan.config
    tiles = plan.tiles(index)
    splits = len({t.split for t in tiles})
    if seq.query_len == 1:
        what = (
            f"sequence {index}, a decode row: 1 token × {config.group} heads fills {config.group} of "
            f"{config.block_m} tile rows"
        )
    else:
        programs = len({t.program for t in tiles})
        what = (
            f"sequence {index}, a prefill chunk of {seq.query_len} tokens after {seq.context_len} cached: "
            f"{programs} programs of {config.block_q} tokens × {config.group} heads, each stops at its causal edge"
        )
    return (
        f"{what}\n{seq.seq_len} keys in {len(tiles)} KV tile{'s' if len(tiles) != 1 else ''} of up to {config.tile_n}, "
        f"in {splits} of the launch's {plan.num_kv_splits} KV splits (hatching)"
    )


TILE_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
SPLIT_HATCHES = ["", "//", "\\\\", "xx", "..", "oo"]


def plot_sequence_tiles(ax, plan, index: int, title: str):
    """Query tokens (rows) × key positions (columns) of one sequence, the kernel's tiles on top.

    Grey cells are the (query, key) pairs the causal mask lets through; the physical block of
    every stretch of ``block_size`` keys is written under the axis; each coloured rectangle is
    one KV tile of one program (colour = program, hatching = split).
    """
    import matplotlib.patches as patches
    import numpy as np

    seq, block_size = plan.sequences[index], plan.block_size
    seq_len, query_len, context_len = seq.seq_len, seq.query_len, seq.context_len
    visible = np.array([[k <= context_len + q for k in range(seq_len)] for q in range(query_len)], dtype=float)
    extent = (0, seq_len, query_len, 0)
    ax.imshow(
        visible, cmap="Greys", vmin=0, vmax=3, aspect="auto", origin="upper", extent=extent, interpolation="nearest"
    )
    for tile in plan.tiles(index):
        q0, q1, k0, k1 = tile.query_rows.start, tile.query_rows.stop, tile.keys.start, tile.keys.stop
        colour, hatch = TILE_COLOURS[tile.program % len(TILE_COLOURS)], SPLIT_HATCHES[tile.split % len(SPLIT_HATCHES)]
        box = patches.Rectangle((k0 + 0.08, q0 + 0.08), k1 - k0 - 0.16, q1 - q0 - 0.16, fill=False, hatch=hatch)
        box.set(edgecolor=colour, linewidth=2)
        ax.add_patch(box)
    for b in range(-(-seq_len // block_size)):
        start, end = b * block_size, min(seq_len, (b + 1) * block_size)
        if b:
            ax.axvline(start, color="black", linewidth=0.6, linestyle=":")
        label = f"block {seq.block_table[b]}" if end - start >= 3 else f"#{seq.block_table[b]}"  # 1-2 keys here
        rotation = 90 if block_size < 3 else 0
        ax.text((start + end) / 2, query_len + 0.15, label, ha="center", va="top", fontsize=8, rotation=rotation)
    ax.set_xlim(0, seq_len)
    ax.set_ylim(query_len + (1.6 if block_size < 4 else 0.9), 0)
    ax.set_xlabel("key position in the sequence (physical block below; #n: block n, too narrow to spell out)")
    ax.set_ylabel("query token of this step")
    ax.set_yticks([q + 0.5 for q in range(query_len)], [str(context_len + q) for q in range(query_len)])
    ax.set_title(title)
    return ax


def launch_figure(plan, title: str | None = None):
    """One panel per sequence of the launch: query rows × key positions, the kernel's tiles on top."""
    import matplotlib.pyplot as plt

    heights = [seq.query_len + 2.2 for seq in plan.sequences]
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(11, 1.0 + 0.32 * sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    longest = max(seq.seq_len for seq in plan.sequences)
    for index, ax in enumerate(axes[:, 0]):
        plot_sequence_tiles(ax, plan, index, panel_title(plan, index))
        ax.title.set_fontsize(9)
        ax.set_xlim(0, longest)  # one key axis for every panel: lengths compare by eye
        if index < len(heights) - 1:
            ax.set_xlabel("")
        if plan.sequences[index].query_len == 1:  # a one-row panel has no room for the long label
            ax.set_ylabel("query", fontsize=8)
    config = plan.config
    fig.suptitle(
        title
        or (
            f"One paged-attention launch as the check ran it: {len(plan.sequences)} sequences, "
            f"KV tiles of {config.tile_n} keys over blocks of {plan.block_size}, "
            f"{plan.num_kv_splits} KV splits\n"
        )
        + "grey: the (query, key) pairs the causal mask lets "
        "through; colour: one query-tile program; plain and hatched: the KV splits sharing its keys",
        fontsize=11,
    )
    fig.tight_layout()
    return fig
