"""Chapter 04's cache: one reserved row of ``max_len`` positions per sequence, per layer.

The simplest cache that works: each sequence's keys and values sit in its own row at their
positions, and the same Llama layers read them through ``ContiguousCacheMetadata.attend``, as they
read the engine's paged pool through ``model/attention.py: PagedCacheMetadata``. Chapter 07 measures
what reserving every row for the longest conversation wastes; the engine never uses this cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..model.attention import AttentionMetadata
from ..model.paged_attention import attend_groups


def row_coordinates(query_start_loc: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each flat query row: which sequence it belongs to and its index inside that sequence's rows."""
    rows = torch.arange(num_rows, device=query_start_loc.device)
    seq_index = torch.searchsorted(query_start_loc[1:].long(), rows, right=True)
    return seq_index, rows - query_start_loc.long()[seq_index]


class ContiguousKVCache:
    """One reserved stretch of ``max_len`` positions per sequence, per layer: the simple cache of chapter 04.

    ``k[layer]`` has shape ``[max_seqs, max_len, kv_heads, head_dim]``; a sequence's keys sit in
    its row at their own positions. Simple, and wasteful: every row is sized for the longest
    conversation it might ever hold (chapter 07 measures how much that wastes).
    """

    def __init__(
        self,
        num_layers: int,
        max_seqs: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=torch.float32,
        device="cpu",
    ):
        shape = (num_layers, max_seqs, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, config, max_seqs: int, max_len: int, dtype=torch.float32, device="cpu"):
        return cls(config.num_layers, max_seqs, max_len, config.num_kv_heads, config.head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class ContiguousCacheMetadata(AttentionMetadata):
    """Sequence ``b`` keeps its keys/values in row ``cache_rows[b]`` of a ``ContiguousKVCache``."""

    cache: ContiguousKVCache | None = None
    cache_rows: torch.Tensor | None = None  # [B] long
    positions: torch.Tensor | None = None  # [T] long: where each new row is written

    @cached_property
    def write_rows(self) -> torch.Tensor:
        """The cache row of every new token (the same in every layer, so computed once)."""
        seq_index, _ = row_coordinates(self.query_start_loc, self.positions.shape[0])
        return self.cache_rows[seq_index]

    def attend(self, layer_idx, q, k, v):
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_cache[self.write_rows, self.positions] = k.to(k_cache.dtype)
        v_cache[self.write_rows, self.positions] = v.to(v_cache.dtype)

        def fetch(group):  # each sequence's own row, up to its length
            own = self.cache_rows[group.seq_index]
            return k_cache[own, : group.length], v_cache[own, : group.length]

        return attend_groups(q, self.torch_plan(), fetch, self.scale_for(q))
