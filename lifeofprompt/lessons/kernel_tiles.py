"""The tiles one Triton paged-attention launch takes, worked out from the launch's own arguments.

A picture of "how the kernel tiles this batch" is only true if it is drawn from the batch the
kernel ran and with the tile sizes it chose. ``launch_tiles`` takes exactly the arguments of
``lifeofprompt.kernels.paged_attention`` (the same ``tile_n``/``block_m``/``num_kv_splits``
overrides included) and asks the kernel's own ``launch_plan`` and ``kernel_tiles``, so a
notebook can run the kernel and draw it from one set of arguments; the figure
(``lifeofprompt.figures.tiles``) reads the plan. Importing the kernels imports Triton, so the
import waits until a plan is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        from ..kernels.tiles import kernel_tiles

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
