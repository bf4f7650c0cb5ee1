"""Chapter 11's one paged-attention launch: the batch and tile sizes that its check runs and its figure draws.

The chapter runs the Triton kernel under the interpreter on a small mixed batch, checks it
against the torch reference, and draws how that launch tiles the keys. Both read the one
``MIXED_LAUNCH`` below, so the picture is of the batch that was checked, with the tile sizes it
ran with. The tile sizes are forced small (16 keys, two KV splits) because the kernel's own
choice for head_dim 64 (128-key tiles, no split for sequences this short) would cover each of these
sequences with a single tile and show nothing of the tiling.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelLaunch:
    """A batch for ``lessons.paged_cases.make_case`` and the tile overrides ``kernels.paged_attention`` takes."""

    query_lens: tuple[int, ...]  # new rows of each sequence this step: 1 is a decode row
    context_lens: tuple[int, ...]  # tokens of each already in the pool
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tile_n: int  # keys per KV tile
    block_m: int  # rows of a query tile (tokens × the heads sharing a KV head)
    num_kv_splits: int  # programs sharing one sequence's KV tiles (flash-decoding)

    def case_kwargs(self) -> dict:
        return dict(
            query_lens=list(self.query_lens),
            context_lens=list(self.context_lens),
            block_size=self.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def kernel_kwargs(self) -> dict:
        return dict(tile_n=self.tile_n, block_m=self.block_m, num_kv_splits=self.num_kv_splits)


# Two decode rows and one chunked-prefill row, SmolLM2's heads (9 over 3 KV heads), small blocks
# so that tiles visibly cross them.
MIXED_LAUNCH = KernelLaunch(
    query_lens=(1, 1, 12),
    context_lens=(60, 9, 20),
    block_size=4,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tile_n=16,
    block_m=16,
    num_kv_splits=2,
)
