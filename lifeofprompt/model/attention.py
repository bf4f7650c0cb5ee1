"""Attention metadata: the one object that tells the shared Llama layers where keys and values live.

The model always runs a *flat* batch: ``T`` token rows drawn from ``B`` sequences, each
sequence owning the rows ``query_start_loc[b]:query_start_loc[b+1]``. What changes from
one notebook to the next is only where the keys and values of earlier tokens come from:

* ``NoCacheMetadata`` (chapters 02, 03): nowhere: a sequence attends only to this call's rows;
* ``ContiguousCacheMetadata`` (chapter 04): one reserved row per sequence of a
  ``ContiguousKVCache``, written at the token's position;
* ``PagedCacheMetadata`` (chapter 07 on, the engine): blocks of a ``PagedKVCache`` found
  through block tables, new rows written by ``slot_mapping``.

Each kind implements ``attend(layer_idx, q, k, v)``; the layers call nothing else, so the
same weights and the same code run every stage. All per-step data are tensors (the GPU path
captures decode steps in CUDA graphs); ``max_query_len``/``max_seq_len`` are Python ints
that only size padded buffers and kernel grids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .paged_attention import (
    AttentionPlan,
    attend_groups,
    paged_attention,
    row_coordinates,
    store_kv,
    valid_writes,
    write_rows,
)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32: first row of each sequence, then T
    seq_lens: torch.Tensor  # [B] int32: tokens of each sequence once this step is done
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor | None = None  # rows whose logits are wanted; None means all
    scale: float | None = None  # softmax scale; the model fills in 1/sqrt(head_dim)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def torch_plan(self, **paged) -> AttentionPlan:
        """The torch path's per-step plan, built by the first layer and reused by the others."""
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = AttentionPlan.build(self.query_start_loc, self.seq_lens, **paged)
            self.__dict__["_plan"] = plan
        return plan

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def describe_batch(query_lens: list[int], seq_lens: list[int], device, last_rows_only: bool = True) -> dict:
        """The fields every kind shares, built from per-sequence query and total lengths."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        logits_indices = (query_start_loc[1:].long() - 1) if last_rows_only else None
        return dict(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            logits_indices=logits_indices,
        )


def _scale(meta: AttentionMetadata, q: torch.Tensor) -> float:
    return meta.scale if meta.scale is not None else q.shape[-1] ** -0.5


@dataclass
class NoCacheMetadata(AttentionMetadata):
    """Every sequence is complete in this call: attention among its own rows, causal."""

    @classmethod
    def for_lengths(cls, lengths: list[int], device="cpu", last_rows_only: bool = False) -> NoCacheMetadata:
        return cls(**cls.describe_batch(lengths, lengths, device, last_rows_only))

    def attend(self, layer_idx, q, k, v):
        # Every sequence is all query rows here: its keys are exactly its own rows.
        plan = self.torch_plan()
        return attend_groups(
            q,
            plan,
            lambda g: (
                k[g.rows].view(len(g.seq_ids), g.length, *k.shape[1:]),
                v[g.rows].view(len(g.seq_ids), g.length, *v.shape[1:]),
            ),
            _scale(self, q),
        )


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

        return attend_groups(q, self.torch_plan(), fetch, _scale(self, q))


class PagedKVCache:
    """The KV pool of the engine: per layer, K and V shaped ``[num_blocks, block_size, kv_heads, head_dim]``.

    One tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` holds it all, so
    its size is exactly ``num_blocks`` × the bytes of one block (chapter 05's arithmetic).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=torch.float32,
        device="cpu",
    ):
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu"):
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)

    def k(self, layer_idx: int) -> torch.Tensor:
        return self.kv[layer_idx, 0]

    def v(self, layer_idx: int) -> torch.Tensor:
        return self.kv[layer_idx, 1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def attention_backend(name: str):
    """``(store_kv, paged_attention)`` for a backend name: ``"torch"`` or ``"triton"``."""
    if name == "torch":
        return store_kv, paged_attention
    if name == "triton":
        from ..kernels import paged_attention as triton_attention
        from ..kernels import store_kv as triton_store

        return triton_store, triton_attention
    from ..errors import ConfigError

    raise ConfigError(
        f"unknown attention backend {name!r}: use 'torch' (any device) or 'triton' (GPU, or CPU under "
        "TRITON_INTERPRET=1)",
        param="attention_backend",
    )


@dataclass
class PagedCacheMetadata(AttentionMetadata):
    """The engine's metadata: block tables ``[B, max_blocks]`` and one slot per new row."""

    cache: PagedKVCache | None = None
    block_tables: torch.Tensor | None = None  # [B, max_blocks_per_seq] int32, unused entries -1
    slot_mapping: torch.Tensor | None = None  # [T] int64, negative = padding row (not stored)
    backend: str = "torch"
    decode_in_c: bool = False  # torch backend: decode rows by c_step.decode_attention

    @cached_property
    def writes(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The torch path's ``(rows, slots)`` to store, found once per step instead of in every layer."""
        return valid_writes(self.slot_mapping)

    def attend(self, layer_idx, q, k, v):
        store, attention = attention_backend(self.backend)
        k_pool, v_pool = self.cache.k(layer_idx), self.cache.v(layer_idx)
        extra = {}
        if self.backend == "torch":  # what every layer shares is worked out once per step
            write_rows(k, v, k_pool, v_pool, *self.writes)
            extra["plan"] = self.torch_plan(block_tables=self.block_tables, block_size=self.cache.block_size)
            if self.decode_in_c:
                from ..cpu.c_step import decode_attention

                extra["decode_kernel"] = decode_attention
        else:
            store(k, v, k_pool, v_pool, self.slot_mapping)
        return attention(
            q,
            k_pool,
            v_pool,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.max_query_len,
            self.max_seq_len,
            _scale(self, q),
            **extra,
        )
