"""How one paged-attention launch cuts a batch into tiles, drawn from the launch itself (chapter 11).

The figure takes a ``LaunchTiles`` plan (``lifeofprompt.model.kernel_tiles.launch_tiles``),
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


def launch_figure(plan, title: str | None = None):
    """One panel per sequence of the launch: query rows × key positions, the kernel's tiles on top."""
    import matplotlib.pyplot as plt

    from ..model.kernel_tiles import plot_sequence_tiles

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
