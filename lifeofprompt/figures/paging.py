"""Figures of chapter 07: the block pool as a grid, fragmentation bars, and the block-size / pool-size panel.

Every drawing function takes plain data (a ``PoolSnapshot``, rows of ``fragmentation_table``)
and returns a matplotlib figure, so pytest can call them; the widget's callback
``paging_panel`` is an ordinary function too.
"""

from __future__ import annotations

import math

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.collections import PatchCollection
from matplotlib.patches import Patch, Rectangle

from ..engine.block_manager import BlockManager
from ..lessons.paging import (
    PoolSnapshot,
    requests_that_fit,
    slots_wasted_contiguous,
    slots_wasted_paged,
)

PALETTE = [matplotlib.colors.to_hex(c) for c in plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]]
CACHED_FREE = "#BBBBBB"
UNUSED = "#C44E52"  # slots held but never (or not yet) written, dotted in both panels


def owner_colors(names) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def draw_pool_grid(
    ax,
    owners: list[list[str]],
    filled: list[int],
    block_size: int,
    colors: dict[str, str],
    cached: list[bool] | None = None,
    columns: int | None = None,
    label_blocks: bool | None = None,
):
    """Blocks as cells, row by row: coloured by owner, the filled part of each block solid, the rest
    (slots held but not yet written) white, dotted in red as the contiguous panel's unused slots are.
    Not a pale shade of the owner: half of the palette is pale already, so a pale tail could not be
    told from a request.

    A block held by several sequences (a shared prefix) is hatched; a free block still in the
    prefix cache is grey; a free block is white.
    """
    n = len(owners)
    columns = columns or max(1, min(16, math.ceil(math.sqrt(n * 2))))
    rows = math.ceil(n / columns)
    label_blocks = n <= 64 if label_blocks is None else label_blocks
    cached = cached or [False] * n
    tails, solid, outlines = [], [], []
    solid_colors, hatched = [], []
    for b in range(n):
        x, y = b % columns, rows - 1 - b // columns
        outlines.append(Rectangle((x, y), 0.92, 0.92))
        if owners[b]:
            color = colors[owners[b][0]]
        elif cached[b]:
            color = CACHED_FREE
        else:
            continue
        frac = filled[b] / block_size
        if frac > 0:
            solid.append(Rectangle((x, y), 0.92 * frac, 0.92))
            solid_colors.append(color)
        if frac < 1:
            tails.append(Rectangle((x + 0.92 * frac, y), 0.92 * (1 - frac), 0.92))
        if len(owners[b]) > 1:
            hatched.append((x, y))
    ax.add_collection(PatchCollection(tails, facecolors="white", edgecolors=UNUSED, hatch="...", linewidths=0))
    ax.add_collection(PatchCollection(solid, facecolors=solid_colors, edgecolors="none"))
    ax.add_collection(PatchCollection(outlines, facecolors="none", edgecolors="#444444", linewidths=0.6))
    for x, y in hatched:
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, fill=False, hatch="///", edgecolor="black", linewidth=0, zorder=3))
    if label_blocks:
        # On a white box above the hatching, so a shared block's numbers stay readable.
        box = dict(boxstyle="round,pad=0.12", facecolor="white", edgecolor="none", alpha=0.85)
        for b in range(n):
            x, y = b % columns, rows - 1 - b // columns
            ax.text(x + 0.46, y + 0.66, f"#{b}", ha="center", va="center", fontsize=7.5, bbox=box, zorder=4)
            if owners[b] or cached[b]:
                ax.text(
                    x + 0.46,
                    y + 0.28,
                    f"{filled[b]}/{block_size}",
                    ha="center",
                    va="center",
                    fontsize=7.5,
                    bbox=box,
                    zorder=4,
                )
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def legend_handles(names) -> list[Patch]:
    """One patch per owner's colour, then the free, still-cached, and shared (hatched) blocks."""
    handles = [Patch(color=c, label=n) for n, c in owner_colors(names).items()]
    return handles + [
        Patch(facecolor=CACHED_FREE, label="free, still cached"),
        Patch(facecolor="white", edgecolor="#444444", label="free"),
        Patch(facecolor="white", edgecolor=UNUSED, hatch="...", label="held, not yet written"),
        Patch(facecolor="white", edgecolor="black", hatch="///", label="shared"),
    ]


def draw_snapshot(snap: PoolSnapshot, names, ax_grid=None, ax_text=None, columns: int = 8, title: str | None = None):
    """One moment of the pool: the grid, and the block tables printed beside it.

    Drawn alone (no axes given) it has its own colour legend and a note on the cell labels.
    """
    colors = owner_colors(names)
    alone = ax_grid is None
    if alone:
        fig, (ax_grid, ax_text) = plt.subplots(1, 2, figsize=(12, 3.0), gridspec_kw=dict(width_ratios=[1, 1.1]))
    draw_pool_grid(ax_grid, snap.owners, snap.filled, snap.block_size, colors, snap.cached, columns)
    ax_grid.set_title(
        title or f"after step {snap.step}: {snap.num_free_blocks} of {snap.num_blocks} blocks free", fontsize=10
    )
    if ax_text is not None:
        lines = snap.table_lines() or ["(no live sequence)"]
        lines += [""] + [f"· {e}" for e in snap.events]
        ax_text.text(
            0, 1, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=8, transform=ax_text.transAxes
        )
        ax_text.axis("off")
    if alone:
        fig = ax_grid.figure
        ax_grid.text(
            0,
            -0.04,
            f"each cell: #block id, and slots filled / {snap.block_size}",
            fontsize=8,
            va="top",
            transform=ax_grid.transAxes,
        )
        fig.tight_layout(rect=(0, 0.16, 1, 1))
        fig.legend(handles=legend_handles(names), loc="lower center", ncol=4, fontsize=8, frameon=False)
    return ax_grid.figure


def draw_trace(snapshots: list[PoolSnapshot], names, columns: int = 8, suptitle: str | None = None):
    """Several moments of a traced generation, one row each (the static version of the animation)."""
    fig, axes = plt.subplots(
        len(snapshots),
        2,
        figsize=(12, 1.7 * len(snapshots) + 0.6),
        gridspec_kw=dict(width_ratios=[1, 1.5]),
        squeeze=False,
    )
    for snap, (ax_grid, ax_text) in zip(snapshots, axes):
        draw_snapshot(snap, names, ax_grid, ax_text, columns)
    handles = legend_handles(names)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(
        suptitle
        or f"The KV pool: {snapshots[0].num_blocks} blocks of {snapshots[0].block_size} "
        "token slots (solid = slots filled)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    return fig


def draw_fragmentation(rows: list[dict], title: str = "Contiguous reservation vs paging"):
    """Two bar charts over layouts: share of reserved slots wasted, and requests that fit at once."""
    fig, (ax_waste, ax_fit) = plt.subplots(1, 2, figsize=(12, 3.8))
    labels = ["contig."] + [str(r["block_size"]) for r in rows[1:]]
    colors = ["#C44E52"] + ["#4C72B0"] * (len(rows) - 1)
    ax_waste.bar(labels, [100 * r["wasted_share"] for r in rows], color=colors)
    ax_waste.set_ylabel("reserved slots left empty (%)")
    ax_waste.set_xlabel("layout (numbers: paged, block size in tokens)")
    ax_waste.set_title("Memory wasted")
    ax_fit.bar(labels, [r["fit"] for r in rows], color=colors)
    ax_fit.set_ylabel("requests held at once")
    ax_fit.set_xlabel("layout (numbers: paged, block size in tokens)")
    ax_fit.set_title("Requests that fit in the same pool")
    for ax, key, fmt in ((ax_waste, "wasted_share", "{:.0%}"), (ax_fit, "fit", "{}")):
        for i, r in enumerate(rows):
            ax.text(
                i,
                ax.get_ylim()[1] * 0.01 + (100 * r[key] if key == "wasted_share" else r[key]),
                fmt.format(r[key]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the interactive panel


def place_requests(lengths: list[int], num_blocks: int, block_size: int) -> tuple[BlockManager, list, int]:
    """Admit requests of ``lengths`` tokens in order into a fresh pool until one does not fit.

    Returns the manager, the admitted sequences (with their tokens marked computed), and how many fit.
    """
    from ..engine.sampling_params import SamplingParams
    from ..engine.sequence import Sequence

    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(f"req {i}", list(range(n)), SamplingParams(temperature=0))
        if not bm.allocate_slots(seq, n):
            break
        seq.num_computed_tokens = n
        seqs.append(seq)
    return bm, seqs, len(seqs)


def paging_panel(
    block_size: int,
    pool_tokens: int,
    lengths: list[int],
    max_len: int,
    bytes_per_token: int | None = None,
    bytes_label: str = "",
):
    """The widget's callback: the pool under paging and under contiguous reservation, plus the waste figures.

    Returns ``(figure, summary_text)``. Requests are admitted in order until the pool is full.
    """
    from ..units import format_bytes

    num_blocks = max(1, pool_tokens // block_size)
    bm, seqs, fit_paged = place_requests(lengths, num_blocks, block_size)
    fit_contig = requests_that_fit(lengths, pool_tokens, None, max_len)
    owners = [[] for _ in range(num_blocks)]
    filled = [0] * num_blocks
    for seq in seqs:
        for i, b in enumerate(seq.block_table):
            owners[b] = [seq.request_id]
            filled[b] = min(block_size, len(seq) - i * block_size)
    names = [f"req {i}" for i in range(len(lengths))]
    colors = owner_colors(names)

    fig, (ax_paged, ax_contig) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw=dict(width_ratios=[1.1, 1]))
    draw_pool_grid(
        ax_paged, owners, filled, block_size, colors, columns=max(8, min(32, math.ceil(math.sqrt(num_blocks * 2))))
    )
    paged_waste = slots_wasted_paged(lengths[:fit_paged], block_size)
    ax_paged.set_title(
        f"Paged: {num_blocks} blocks of {block_size} slots, {fit_paged} requests fit\n"
        f"{paged_waste} slots wasted (dotted: the empty tail of each last block)",
        fontsize=10,
    )
    ax_paged.text(
        0,
        -0.02,
        "colour = request (admitted in order until one does not fit); plain white = free block",
        transform=ax_paged.transAxes,
        va="top",
        fontsize=8,
    )

    rows = pool_tokens // max_len
    for r in range(rows):
        y = rows - 1 - r
        ax_contig.add_patch(Rectangle((0, y), max_len, 0.8, facecolor="white", edgecolor="#444444", linewidth=0.6))
        if r < fit_contig:
            n = lengths[r]
            ax_contig.add_patch(Rectangle((0, y), n, 0.8, facecolor=colors[names[r]]))
            ax_contig.add_patch(
                Rectangle((n, y), max_len - n, 0.8, facecolor="white", hatch="...", edgecolor=UNUSED, linewidth=0)
            )
            ax_contig.text(max_len * 1.01, y + 0.4, f"{n}/{max_len}", va="center", fontsize=8.5)
    contig_waste = slots_wasted_contiguous(lengths[:fit_contig], max_len)
    ax_contig.set_xlim(0, max_len * 1.12)
    ax_contig.set_ylim(-0.2, max(rows, 1))
    ax_contig.set_yticks([])
    ax_contig.set_xlabel("token slots reserved per request")
    ax_contig.set_title(
        f"Contiguous: {rows} reservations of {max_len} slots, {fit_contig} requests fit\n"
        f"{contig_waste} slots reserved but never used (dotted)",
        fontsize=10,
    )
    fig.tight_layout()

    def money(slots):
        return f" = {format_bytes(slots * bytes_per_token)}{bytes_label}" if bytes_per_token else ""

    summary = (
        f"pool: {pool_tokens} token slots; block size {block_size} → {num_blocks} blocks\n"
        f"paged:      {fit_paged:>3} of {len(lengths)} requests fit, {paged_waste} slots wasted{money(paged_waste)}\n"
        f"contiguous: {fit_contig:>3} of {len(lengths)} requests fit, {contig_waste} slots wasted{money(contig_waste)}"
    )
    return fig, summary


def figure_png(fig, dpi: int = 80) -> bytes:
    """The figure as PNG bytes, drawn completely before anything shows it (then closed)."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def paging_widget(
    lengths: list[int],
    max_len: int,
    bytes_per_token: int | None = None,
    bytes_label: str = "",
    block_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
    pool_tokens=(512, 8192, 256, 2048),
):
    """Block-size and pool-size sliders that redraw ``paging_panel`` (needs ipywidgets).

    The figure travels as PNG bytes in an ``Image`` widget, replaced whole on every change.
    """
    import html

    import ipywidgets as widgets

    lo, hi, step, start = pool_tokens
    block = widgets.SelectionSlider(options=list(block_sizes), value=16, description="block size")
    pool = widgets.IntSlider(min=lo, max=hi, step=step, value=start, description="pool slots")
    summary = widgets.HTML()
    image = widgets.Image(format="png")

    def redraw(_=None):
        fig, text = paging_panel(block.value, pool.value, lengths, max_len, bytes_per_token, bytes_label)
        image.value = figure_png(fig)
        summary.value = f"<pre class='lop-paging-summary'>{html.escape(text)}</pre>"

    block.observe(redraw, names="value")
    pool.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([block, pool]), summary, image])
