"""Attention metadata: the one object that tells the shared Llama layers where keys and values live.

The model always runs a *flat* batch: ``T`` token rows drawn from ``B`` sequences, each
sequence owning the rows ``query_start_loc[b]:query_start_loc[b+1]``. What changes from
one notebook to the next is only where the keys and values of earlier tokens come from:

* ``NoCacheMetadata`` (chapters 02, 03): nowhere: a sequence attends only to this call's rows;
* ``ContiguousCacheMetadata`` (chapter 04, ``lessons/contiguous_cache.py``): one reserved row per
  sequence of a ``ContiguousKVCache``, written at the token's position;
* ``PagedCacheMetadata`` (chapter 07 on, the engine): blocks of a ``PagedKVCache`` found
  through block tables, new rows written by ``slot_mapping``.

Each kind implements ``attend(layer_idx, q, k, v)``; the layers call nothing else, so the
same weights and the same code run every stage. All per-step data are tensors (the GPU path
captures decode steps in CUDA graphs); ``max_query_len``/``max_seq_len`` are Python ints
that only size padded buffers and kernel grids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from .attention_backends import attention_backend
from .paged_attention import (
    AttentionPlan,
    attend_groups,
    valid_writes,
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

    def scale_for(self, q: torch.Tensor) -> float:
        """The softmax scale: as set, else ``1 / sqrt(head_dim)``."""
        return self.scale if self.scale is not None else q.shape[-1] ** -0.5

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
            self.scale_for(q),
        )


class PagedKVCache:
    """The KV pool of the engine: per layer, K and V shaped ``[num_blocks, block_size, kv_heads, head_dim]``.

    One tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` holds it all, so
    its size is exactly ``num_blocks`` × the bytes of one block (chapter 05's arithmetic). ``kv_dtype``
    (``kv_cache_formats.py``) stores it in fewer bytes: a float dtype, or codes with ``scales`` beside
    them (q8_0: one fp16 per 32 values; fp8: one float per layer for keys and one for values).
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
        kv_dtype: str = "auto",
    ):
        from .kv_cache_formats import FLOAT_FORMS, Q8_BLOCK

        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        storage = {"q8_0": torch.int8, "fp8": torch.float8_e4m3fn}.get(kv_dtype, FLOAT_FORMS.get(kv_dtype, dtype))
        self.kv = torch.zeros(shape, dtype=storage, device=device)
        self.scales = None
        if kv_dtype == "q8_0":
            self.scales = torch.zeros(*shape[:-1], head_dim // Q8_BLOCK, dtype=torch.float16, device=device)
        elif kv_dtype == "fp8":
            self.scales = torch.ones(num_layers, 2, dtype=torch.float32, device=device)
        self.kv_dtype, self.num_blocks, self.block_size = kv_dtype, num_blocks, block_size

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu", kv_dtype="auto"):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return cls(*shape, dtype, device, kv_dtype)

    def k(self, layer_idx: int):
        return self.layer_pool(layer_idx, 0)

    def v(self, layer_idx: int):
        return self.layer_pool(layer_idx, 1)

    def layer_pool(self, layer_idx: int, kv: int):
        """One layer's keys (``kv`` 0) or values (1): the tensor itself, or a ``BlockPool`` of codes and scales."""
        if self.scales is None:
            return self.kv[layer_idx, kv]
        from .kv_cache_formats import BlockPool

        return BlockPool(self.kv_dtype, self.kv[layer_idx, kv], self.scales[layer_idx, kv])

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales


@dataclass
class PagedCacheMetadata(AttentionMetadata):
    """The engine's metadata: block tables ``[B, max_blocks]`` and one slot per new row."""

    cache: PagedKVCache | None = None
    block_tables: torch.Tensor | None = None  # [B, max_blocks_per_seq] int32, unused entries -1
    slot_mapping: torch.Tensor | None = None  # [T] int64, negative = padding row (not stored)
    backend: object = "torch"  # the attention backend (attention_backends.py), or its name

    def __post_init__(self):
        if isinstance(self.backend, str):
            self.backend = attention_backend(self.backend)

    @classmethod
    def for_batch(
        cls, query_lens: list[int], seq_lens: list[int], block_tables, slot_mapping, cache, backend, device,
        logits_indices=None,
    ) -> PagedCacheMetadata:  # fmt: skip
        """One step's metadata from each sequence's query and total lengths, its block tables and new rows'
        slots (host tensors, copied to ``device`` once); ``logits_indices`` None: each sequence's last row."""
        fields = cls.describe_batch(query_lens, seq_lens, device)
        if logits_indices is not None:
            fields["logits_indices"] = logits_indices.to(device, non_blocking=True)
        tables, slots = block_tables.to(device, non_blocking=True), slot_mapping.to(device, non_blocking=True)
        return cls.over_cache(fields, cache, tables, slots, backend)

    @classmethod
    def over_cache(cls, fields: dict, cache, block_tables, slot_mapping, backend) -> PagedCacheMetadata:
        """The one builder of paged metadata: the fields every kind shares (``describe_batch``'s, a decode
        graph's fixed buffers, or what rank 0 broadcast), already on the device, over ``cache``'s pool."""
        return cls(**fields, cache=cache, block_tables=block_tables, slot_mapping=slot_mapping, backend=backend)

    def over_pool(self, cache: PagedKVCache, backend) -> PagedCacheMetadata:
        """The same step's rows, slots and tables over another pool (the draft model's, which mirrors them)."""
        return dataclasses.replace(self, cache=cache, backend=backend, logits_indices=None)

    @cached_property
    def writes(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The torch path's ``(rows, slots)`` to store, found once per step instead of in every layer."""
        return valid_writes(self.slot_mapping)

    def attend(self, layer_idx, q, k, v):
        return self.backend.attend(self, layer_idx, q, k, v)


def synthetic_step(model, cache: PagedKVCache, lengths: list[int], decode: bool = False, backend="torch"):
    """``(input_ids, positions, meta)`` of a made-up step over ``cache``, for what start-up times or profiles:
    a sequence per length, in consecutive blocks (wrapping round the pool); each prefills its whole
    length, or (``decode``) only its last token after the rest. No scheduler or sequence is involved."""
    size = cache.block_size
    width = max(-(-n // size) for n in lengths)
    ids, positions, slots, query_lens, tables, next_block = [], [], [], [], [], 0
    for i, n in enumerate(lengths):
        blocks = [(next_block + b) % cache.num_blocks for b in range(-(-n // size))]
        next_block += len(blocks)
        tables.append(blocks + [-1] * (width - len(blocks)))
        first = n - 1 if decode else 0
        ids += [i % model.config.vocab_size] * (n - first)
        positions += range(first, n)
        slots += [blocks[p // size] * size + p % size for p in range(first, n)]
        query_lens.append(n - first)
    table = torch.tensor(tables, dtype=torch.int32)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    meta = PagedCacheMetadata.for_batch(query_lens, list(lengths), table, slot_mapping, cache, backend, model.device)
    return torch.tensor(ids, device=model.device), torch.tensor(positions, device=model.device), meta
