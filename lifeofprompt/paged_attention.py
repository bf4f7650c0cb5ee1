"""Paged attention in plain torch: the engine's CPU path and the reference for the Triton kernels.

The KV pool of one layer is a tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence does not own a contiguous stretch of it: it owns a *block table*, the ordered list
of physical block ids that hold its tokens. Token ``j`` of sequence ``b`` lives in

    slot = block_tables[b, j // block_size] * block_size + j % block_size

of the pool flattened to ``[num_blocks * block_size, ...]``. Two functions do all the work:

* ``store_kv`` writes this step's new key/value rows into their slots (``slot_mapping``;
  a negative slot is padding and is skipped);
* ``paged_attention`` lets every query row attend to its own sequence's keys, read back
  through the block table. Decode rows (one query per sequence) and prefill or chunked
  prefill rows (many queries after a cached prefix) mix freely in one flat batch.

The Triton kernels in ``lifeofprompt.kernels`` have exactly these signatures.
"""

from __future__ import annotations

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` rows ``[T, kv_heads, head_dim]`` into the pools at ``slot_mapping[T]``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_pool.view(-1, *k_pool.shape[2:])[slots] = key[keep].to(k_pool.dtype)
    v_pool.view(-1, *v_pool.shape[2:])[slots] = value[keep].to(v_pool.dtype)


def gather_slots(block_tables: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
    """Slot of every (sequence, position < max_seq_len) pair through the block tables: ``[B, max_seq_len]``.

    Positions past a table's end read block 0; the caller masks them out by sequence length.
    """
    positions = torch.arange(max_seq_len, device=block_tables.device)
    block_index = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables[:, block_index].long().clamp(min=0)
    return blocks * block_size + (positions % block_size)


def paged_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, max_seq_len: int, scale: float) -> torch.Tensor:
    """Causal grouped-query attention of query rows ``[T, heads, head_dim]`` over the paged pool.

    Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; they are its
    *last* tokens, so its first ``seq_lens[b] - query_len`` tokens are a cached prefix that
    every one of its queries may see.
    """
    block_size = k_pool.shape[1]
    slots = gather_slots(block_tables, max_seq_len, block_size)
    keys = k_pool.reshape(-1, *k_pool.shape[2:])[slots]        # [B, max_seq_len, kv_heads, D]
    values = v_pool.reshape(-1, *v_pool.shape[2:])[slots]
    return attend_padded(query, keys, values, seq_lens, query_start_loc, max_query_len, scale)


def row_coordinates(query_start_loc: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each flat query row: which sequence it belongs to and its index inside that sequence's rows."""
    rows = torch.arange(num_rows, device=query_start_loc.device)
    seq_index = torch.searchsorted(query_start_loc[1:].long(), rows, right=True)
    return seq_index, rows - query_start_loc.long()[seq_index]


def attend_padded(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, scale: float) -> torch.Tensor:
    """Attention of flat query rows over per-sequence keys/values padded to ``[B, L, kv_heads, D]``.

    Shared by every cache layout: only how ``keys``/``values`` were gathered differs.
    """
    num_rows, num_heads, head_dim = query.shape
    num_seqs, max_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    seq_index, row_index = row_coordinates(query_start_loc, num_rows)

    # Scatter the flat rows into a padded [B, Qmax, heads, D] block, grouped by KV head.
    q = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    q[seq_index, row_index] = query
    q = q.view(num_seqs, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    k = keys.permute(0, 2, 3, 1)                                   # [B, kv, D, L]
    v = values.permute(0, 2, 1, 3)                                 # [B, kv, L, D]
    scores = (q.float() @ k.float().unsqueeze(2)) * scale          # [B, kv, group, Qmax, L]

    # Row i of sequence b sits at position context_len + i and sees keys 0..that position.
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    context_lens = seq_lens.long() - query_lens
    key_pos = torch.arange(max_len, device=query.device)
    query_pos = context_lens[:, None] + torch.arange(max_query_len, device=query.device)[None]
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens.long()[:, None, None])
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights)                            # rows with nothing visible (padding)
    out = weights @ v.float().unsqueeze(2)                         # [B, kv, group, Qmax, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_query_len, num_heads, head_dim)
    return out[seq_index, row_index].to(query.dtype)
