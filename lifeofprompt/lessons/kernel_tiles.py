"""The tiles one Triton paged-attention launch takes, worked out from the launch's own arguments.

A picture of "how the kernel tiles this batch" is only true if it is drawn from the batch the
kernel ran and with the tile sizes it chose. ``launch_tiles`` takes exactly the arguments of
``lifeofprompt.kernels.paged_attention`` (the same ``tile_n``/``block_m``/``num_kv_splits``
overrides included) and asks the kernel's own ``launch_plan``, so a notebook can run the kernel
and draw it from one set of arguments; ``kernel_tiles`` then walks each sequence with the kernel's
own bounds, and the figure (``lifeofprompt.figures.tiles``) reads the plan. The engine never asks
for a tile plan: the kernel computes its bounds itself. Importing the kernels imports Triton, so
the import waits until a plan is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..kernels.tiles import TileConfig


@dataclass(frozen=True)
class SequenceTiles:
    """One sequence of the launch: its blocks, its length after the step and its new rows."""

    block_table: list[int]
    seq_len: int
    query_len: int

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass(frozen=True)
class LaunchTiles:
    """What one launch does: its tile shapes, its KV splits and every sequence it covers."""

    config: object  # lifeofprompt.kernels.tiles.TileConfig
    num_kv_splits: int
    block_size: int
    sequences: list[SequenceTiles]

    def tiles(self, index: int) -> list:
        """Every (query tile, KV tile) step of sequence ``index``, with the kernel's bounds."""
        seq = self.sequences[index]
        return kernel_tiles(
            seq.block_table, self.block_size, seq.seq_len, seq.query_len, self.config, self.num_kv_splits
        )


def launch_tiles(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float | None = None,
    num_kv_splits: int | None = None,
    tile_n: int | None = None,
    block_m: int | None = None,
) -> LaunchTiles:
    """The plan ``paged_attention`` follows for these arguments (``v_pool`` and ``scale`` do not change it)."""
    from ..kernels.paged_attention import launch_plan

    num_seqs = seq_lens.shape[0]
    config, _, splits = launch_plan(
        query, k_pool.shape[2], num_seqs, max_query_len, max_seq_len, num_kv_splits, tile_n, block_m
    )
    starts = query_start_loc.tolist()
    sequences = []
    for b, (table, seq_len) in enumerate(zip(block_tables.tolist(), seq_lens.tolist())):
        sequences.append(SequenceTiles([t for t in table if t >= 0], seq_len, starts[b + 1] - starts[b]))
    return LaunchTiles(config, splits, k_pool.shape[1], sequences)


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
    from ..kernels.tiles import cdiv

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
