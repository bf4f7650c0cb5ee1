"""How the paged-attention kernel cuts its work into tiles, and a picture of it.

The kernel (``kernels/paged_attention.py``) gives each program one *query tile* and walks
the keys in *KV tiles*:

* a query tile is ``block_m`` rows: ``block_q`` query tokens of one sequence × the ``group``
  query heads that share one KV head (GQA), flattened. Row ``m`` is token ``m // group``,
  head ``m % group``. Every KV tile is loaded once and used by all of them.
* a KV tile is ``tile_n`` consecutive key positions of that sequence. Its size has nothing to
  do with the cache's ``block_size``: each key finds its own physical block in the block
  table (``block_table[pos // block_size]``), so one tile may span many blocks (small
  blocks) or a slice of one (big blocks).
* with flash-decoding (``num_kv_splits > 1``) the KV tiles of a sequence are shared out
  between several programs, whose partial softmax states are merged by a reduce kernel.

This module holds that arithmetic (no Triton needed, so the wrapper, the tests and the
notebook figure all use the same numbers) and ``plot_kernel_tiles``/``tiles_figure``.
"""

from __future__ import annotations

from dataclasses import dataclass


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class TileConfig:
    """The compile-time tile shapes of one launch."""

    group: int  # query heads per KV head
    block_m: int  # rows of a query tile: block_q tokens × group heads, padded to a power of 2
    block_q: int  # query tokens per program
    tile_n: int  # keys per KV tile
    head_dim: int
    head_dim_padded: int  # head_dim rounded up to a power of 2 (masked)

    def check(self) -> None:
        """``tl.dot`` needs every operand dimension >= 16; ``tl.arange`` needs powers of 2."""
        for name in ("block_m", "tile_n", "head_dim_padded"):
            size = getattr(self, name)
            if size < 16 or not is_power_of_2(size):
                raise ValueError(f"{name}={size}: tl.dot tiles must be powers of 2 and at least 16")
        if not 1 <= self.block_q * self.group <= self.block_m:
            raise ValueError(
                f"block_q={self.block_q} tokens × group={self.group} heads do not fit block_m={self.block_m}"
            )


def choose_tiles(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    tile_n: int | None = None,
    block_m: int | None = None,
) -> TileConfig:
    """Tile shapes for a batch: small query tiles for decode, up to 64 rows for prefill.

    Decode rows have one token, so a tile holds just the ``group`` heads (padded to 16 rows,
    the smallest ``tl.dot``); prefill rows pack as many tokens as fit in 64 rows.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    group = num_heads // num_kv_heads
    if block_m is None:
        block_m = max(16, next_power_of_2(group), min(64, next_power_of_2(max(1, max_query_len) * group)))
    head_dim_padded = max(16, next_power_of_2(head_dim))
    if tile_n is None:  # measured on an H200 in bf16 decode: 128 keys for head_dim 64, 64 for 128
        tile_n = max(16, min(128, 8192 // head_dim_padded))
    config = TileConfig(group, block_m, max(1, block_m // group), tile_n, head_dim, head_dim_padded)
    config.check()
    return config


def choose_num_kv_splits(
    num_programs: int, max_seq_len: int, num_sms: int | None, min_keys_per_split: int = 256, max_splits: int = 64
) -> int:
    """Flash-decoding heuristic: split the keys only when the unsplit grid leaves SMs idle.

    ``num_programs`` is the unsplit grid (query tiles × sequences × KV heads). With fewer
    programs than SMs, each sequence's keys are cut into enough pieces for about four
    programs per SM, each piece at least ``min_keys_per_split`` keys. Without a GPU
    (``num_sms`` None, the interpreter) never split. On an H200 (132 SMs), bf16, TinyLlama's
    heads: 8 × 4096 tokens ran 4.6× faster with 16 splits, 1 × 32k 22× faster with 64.
    """
    if num_sms is None or num_programs >= num_sms:
        return 1
    splits = min(cdiv(4 * num_sms, max(1, num_programs)), max_seq_len // min_keys_per_split, max_splits)
    return max(1, splits)


@dataclass(frozen=True)
class Tile:
    """One (query tile, KV tile) step of one program, in the sequence's own positions."""

    program: int  # query-tile index within the sequence
    split: int
    query_rows: range  # indices into the sequence's query tokens
    keys: range  # key positions
    blocks: tuple  # physical block ids that the keys live in


def kernel_tiles(
    block_table: list[int], block_size: int, seq_len: int, query_len: int, config: TileConfig, num_kv_splits: int = 1
) -> list[Tile]:
    """Every step the kernel takes for one sequence, with the same bounds as the kernel."""
    context_len = seq_len - query_len
    tiles = []
    for program in range(cdiv(query_len, config.block_q)):
        first = program * config.block_q
        last = min(query_len, first + config.block_q) - 1
        kv_end = max(0, min(seq_len, context_len + last + 1))
        num_tiles = cdiv(kv_end, config.tile_n)
        per_split = cdiv(num_tiles, num_kv_splits)
        for split in range(num_kv_splits):
            for t in range(split * per_split, min((split + 1) * per_split, num_tiles)):
                keys = range(t * config.tile_n, min(kv_end, (t + 1) * config.tile_n))
                blocks = tuple(dict.fromkeys(block_table[k // block_size] for k in keys))
                tiles.append(Tile(program, split, range(first, last + 1), keys, blocks))
    return tiles


def plot_kernel_tiles(
    ax,
    block_table: list[int],
    block_size: int,
    seq_len: int,
    query_len: int,
    config: TileConfig,
    num_kv_splits: int = 1,
    title: str | None = None,
):
    """Query tokens (rows) × key positions (columns) of one sequence, the kernel's tiles on top.

    Grey cells are the (query, key) pairs the causal mask lets through; the physical block of
    every stretch of ``block_size`` keys is written under the axis; each coloured rectangle is
    one KV tile of one program (colour = program, hatching = split).
    """
    import matplotlib.patches as patches
    import numpy as np

    context_len = seq_len - query_len
    visible = np.array([[k <= context_len + q for k in range(seq_len)] for q in range(query_len)], dtype=float)
    ax.imshow(
        visible,
        cmap="Greys",
        vmin=0,
        vmax=3,
        aspect="auto",
        origin="upper",
        extent=(0, seq_len, query_len, 0),
        interpolation="nearest",
    )
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    hatches = ["", "//", "\\\\", "xx", "..", "oo"]
    for tile in kernel_tiles(block_table, block_size, seq_len, query_len, config, num_kv_splits):
        q0, q1 = tile.query_rows.start, tile.query_rows.stop
        k0, k1 = tile.keys.start, tile.keys.stop
        ax.add_patch(
            patches.Rectangle(
                (k0 + 0.08, q0 + 0.08),
                k1 - k0 - 0.16,
                q1 - q0 - 0.16,
                fill=False,
                edgecolor=colours[tile.program % len(colours)],
                linewidth=2,
                hatch=hatches[tile.split % len(hatches)],
            )
        )
    for b in range(cdiv(seq_len, block_size)):
        start, end = b * block_size, min(seq_len, (b + 1) * block_size)
        if b:
            ax.axvline(start, color="black", linewidth=0.6, linestyle=":")
        label = f"block {block_table[b]}" if end - start >= 3 else f"#{block_table[b]}"  # a block with 1-2 keys here
        ax.text(
            (start + end) / 2,
            query_len + 0.15,
            label,
            ha="center",
            va="top",
            fontsize=8,
            rotation=90 if block_size < 3 else 0,
        )
    ax.set_xlim(0, seq_len)
    ax.set_ylim(query_len + (1.6 if block_size < 4 else 0.9), 0)
    ax.set_xlabel("key position in the sequence (physical block below; #n: block n, too narrow to spell out)")
    ax.set_ylabel("query token of this step")
    ax.set_yticks([q + 0.5 for q in range(query_len)], [str(context_len + q) for q in range(query_len)])
    ax.set_title(
        title
        or f"{query_len} query tokens after {context_len} cached, tiles of "
        f"{config.block_q} tokens × {config.group} heads and {config.tile_n} keys"
    )
    return ax


# Two sequences' block tables in one shuffled pool (as the block manager hands blocks out after some churn).
DECODE_TABLE = [7, 2, 11, 4, 9, 0, 5, 13, 1, 8, 19, 22, 18, 25, 20, 23, 27, 26, 28, 29]
PREFILL_TABLE = [3, 12, 6, 10, 21, 15, 24, 17, 14, 16, 30, 31]


def tiles_figure(
    block_size: int = 4,
    tile_n: int = 16,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    decode_len: int = 61,
    prefill_prefix: int = 20,
    prefill_len: int = 12,
    num_kv_splits: int = 2,
):
    """Two panels: a decode row with flash-decoding splits, and a chunked-prefill row after a cached prefix.

    The defaults are SmolLM2's heads (9 query heads over 3 KV heads, so 3 share each KV tile)
    with a small block size and a shuffled block table, so tiles visibly cross blocks.
    """
    import matplotlib.pyplot as plt

    decode_table = DECODE_TABLE[: cdiv(decode_len, block_size)]
    prefill_table = PREFILL_TABLE[: cdiv(prefill_prefix + prefill_len, block_size)]
    decode = choose_tiles(num_heads, num_kv_heads, 64, 1, tile_n=tile_n)
    prefill = choose_tiles(num_heads, num_kv_heads, 64, prefill_len, tile_n=tile_n, block_m=16)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), gridspec_kw={"height_ratios": [1, 3]})
    plot_kernel_tiles(
        top,
        decode_table,
        block_size,
        decode_len,
        1,
        decode,
        num_kv_splits,
        f"decode row: 1 token × {decode.group} heads = {decode.group} of {decode.block_m} tile rows; "
        f"{decode_len} keys in tiles of {tile_n}, split over {num_kv_splits} programs (hatching)",
    )
    plot_kernel_tiles(
        bottom,
        prefill_table,
        block_size,
        prefill_prefix + prefill_len,
        prefill_len,
        prefill,
        1,
        f"prefill row: {prefill_len} new tokens after {prefill_prefix} cached; each program takes "
        f"{prefill.block_q} tokens × {prefill.group} heads ({prefill.block_m} rows) and stops at its causal edge",
    )
    fig.suptitle(f"One paged-attention launch: KV tiles of {tile_n} keys over blocks of {block_size}")
    fig.tight_layout()
    return fig
