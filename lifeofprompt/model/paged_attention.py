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


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` rows ``[T, kv_heads, head_dim]`` into the pools at ``slot_mapping[T]``."""
    write_rows(key, value, k_pool, v_pool, *valid_writes(slot_mapping))


def valid_writes(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rows, slots)`` of the rows that are stored (``rows`` is None when all of them are)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping.long()
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping[rows].long()


def write_rows(key, value, k_pool, v_pool, rows: torch.Tensor | None, slots: torch.Tensor) -> None:
    """``store_kv`` once its valid rows are known (the engine's torch path finds them once per step)."""
    if rows is not None:
        key, value = key[rows], value[rows]
    for rows_of, pool in ((key, k_pool), (value, v_pool)):
        if hasattr(pool, "write"):  # a pool of codes and scales (kv_cache_formats.BlockPool): quantized going in
            pool.write(rows_of, slots)
        else:
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, rows_of.to(pool.dtype))


def paged_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: AttentionPlan | None = None,
    decode_kernel=None,
) -> torch.Tensor:
    """Causal grouped-query attention of query rows ``[T, heads, head_dim]`` over the paged pool.

    Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; they are its
    *last* tokens, so its first ``seq_lens[b] - query_len`` tokens are a cached prefix that
    every one of its queries may see. ``plan`` (optional) carries what every layer of one step
    shares (groups, masks, key slots), so a forward computes it once. ``decode_kernel``: a
    function like ``c_step.decode_attention`` that takes the decode rows, reading the pool
    through the block tables instead of copying each sequence's blocks out first (the engine's
    choice on the CPU; without it this function is the torch reference).
    """
    if plan is None:
        plan = AttentionPlan.build(query_start_loc, seq_lens, block_tables=block_tables, block_size=k_pool.shape[1])
    decode = None
    if decode_kernel is not None:

        def decode(q, g):
            return decode_kernel(q, k_pool, v_pool, block_tables[g.seq_index], seq_lens[g.seq_index], scale)

    return attend_groups(query, plan, lambda g: (g.gather(k_pool), g.gather(v_pool)), scale, decode)


class AttentionGroup:
    """Sequences attended together: all decode rows in one batch, each prefill (chunk) on its own.

    ``seq_index`` are the sequences (a tensor), ``rows`` their flat query rows ``[b * Q]``, ``mask``
    ``[b, 1, Q, L]`` which keys each row may see, ``blocks`` ``[b, ceil(L / block_size)]`` the
    physical blocks that hold those keys in a paged pool (None for the other layouts).
    ``all_rows`` says the group is the whole batch in order (no gather or scatter of rows needed);
    ``may_be_empty`` that some sequence sees no key (a padding row), whose output must be zeroed.
    """

    def __init__(
        self,
        seq_ids: list[int],
        rows,
        num_queries: int,
        length: int,
        mask,
        all_rows: bool = False,
        may_be_empty: bool = True,
    ):
        self.seq_ids, self.rows, self.num_queries, self.length, self.mask = seq_ids, rows, num_queries, length, mask
        self.all_rows, self.may_be_empty = all_rows, may_be_empty
        # [b * Q, 1, 1]: which rows see any key, built once per step rather than once per layer
        self.sees_a_key = mask.any(-1).reshape(-1, 1, 1) if may_be_empty else None
        self.seq_index = torch.tensor(seq_ids, device=rows.device)
        self.blocks = None

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        """This group's keys (or values) from one layer's pool ``[num_blocks, block_size, kv, D]``: ``[b, L, kv, D]``.

        Whole blocks are copied (one index per block, not per token) with ``index_select``,
        which copies rows as plain memory (~30 GB/s here; ``pool[blocks]`` runs at ~5), then
        cut to ``length``.
        """
        b, num_blocks = self.blocks.shape
        keys = pool.index_select(0, self.blocks.reshape(-1)).view(b, num_blocks * pool.shape[1], *pool.shape[2:])
        return keys[:, : self.length]


class AttentionPlan:
    """What every layer of one step shares, built once per forward by the torch path.

    Padding every sequence to the longest query would make a step that mixes one 256-token
    prefill chunk with 31 decodes compute 32 × 256 query rows; grouping decodes together and
    prefills one by one computes exactly the rows that exist.
    """

    def __init__(self, groups: list[AttentionGroup]):
        self.groups = groups

    @classmethod
    def build(cls, query_start_loc, seq_lens, block_tables=None, block_size=None) -> AttentionPlan:
        device = query_start_loc.device
        starts = query_start_loc.tolist()
        lengths = seq_lens.tolist()
        decodes = [b for b in range(len(lengths)) if starts[b + 1] - starts[b] == 1]
        prefills = [b for b in range(len(lengths)) if starts[b + 1] - starts[b] > 1]
        num_rows = starts[-1]
        groups = []
        if decodes:
            length = max(1, max(lengths[b] for b in decodes))
            lens = torch.tensor([lengths[b] for b in decodes], device=device)
            mask = (torch.arange(length, device=device)[None, :] < lens[:, None])[:, None, None, :]
            rows = torch.tensor([starts[b] for b in decodes], device=device)
            all_rows = len(decodes) == num_rows and all(starts[b] == b for b in decodes)
            groups.append(
                AttentionGroup(
                    decodes,
                    rows,
                    1,
                    length,
                    mask,
                    all_rows=all_rows,
                    may_be_empty=min(lengths[b] for b in decodes) == 0,
                )
            )
        for b in prefills:
            num_q, length = starts[b + 1] - starts[b], lengths[b]
            context = length - num_q  # cached prefix every row of the chunk sees
            key_pos = torch.arange(length, device=device)
            query_pos = context + torch.arange(num_q, device=device)
            mask = (key_pos[None, :] <= query_pos[:, None])[None, None]
            rows = torch.arange(starts[b], starts[b + 1], device=device)
            groups.append(
                AttentionGroup([b], rows, num_q, length, mask, all_rows=num_q == num_rows, may_be_empty=False)
            )
        if block_tables is not None:
            for group in groups:
                num_blocks = min((group.length + block_size - 1) // block_size, block_tables.shape[1])
                group.blocks = block_tables[group.seq_index, :num_blocks].long().clamp(min=0)
        return cls(groups)


def _sdpa(q, k, v, mask, scale):
    """``q [b, H, Q, D]`` over ``k, v [b, kv, L, D]``: grouped-query attention in one fused call.

    torch >= 2.5 shares each KV head among its query heads itself (``enable_gqa``); older
    versions get the KV heads repeated.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if k.shape[1] == q.shape[1]:
        return sdpa(q, k, v, attn_mask=mask, scale=scale)
    try:
        return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return sdpa(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=mask, scale=scale
        )


def attend_groups(query: torch.Tensor, plan: AttentionPlan, fetch, scale: float, decode=None) -> torch.Tensor:
    """Attention of flat query rows, group by group; ``fetch(group)`` gives its keys/values ``[b, L, kv, D]``.

    ``decode(q, group)`` (optional) computes the decode group (one query row per sequence) by
    itself. Rows of sequences that see no key at all (padding, length 0) come out as zeros.
    """
    num_rows, num_heads, head_dim = query.shape
    out = None
    for group in plan.groups:
        b, q_len = len(group.seq_ids), group.num_queries
        q = query if group.all_rows else query[group.rows]
        if decode is not None and q_len == 1:
            context = decode(q, group)
        else:
            keys, values = fetch(group)
            q = q.reshape(b, q_len, num_heads, head_dim).transpose(1, 2)
            k, v = keys.to(query.dtype).transpose(1, 2), values.to(query.dtype).transpose(1, 2)
            context = _sdpa(q, k, v, group.mask, scale).transpose(1, 2).reshape(b * q_len, num_heads, head_dim)
        if group.may_be_empty:  # no key at all: a softmax of nothing, NaN on the CPU, an average on some GPU kernels
            context = torch.where(group.sees_a_key, context, 0.0)
        if group.all_rows:
            return context
        if out is None:
            out = query.new_zeros(num_rows, num_heads, head_dim)
        out[group.rows] = context
    return out if out is not None else query.new_zeros(num_rows, num_heads, head_dim)
