"""How the paged-attention kernel cuts its work into tiles.

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

This module holds that arithmetic (no Triton needed, so the wrapper, the tests and chapter 11's
tile plan, ``lifeofprompt/lessons/kernel_tiles.py``, all use the same numbers).
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
