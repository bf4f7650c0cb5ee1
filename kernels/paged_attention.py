"""One paged-attention kernel for decode and (chunked) prefill rows, plus flash-decoding.

The torch reference (``lifeofprompt.model.paged_attention``) gathers every sequence's keys into a
padded tensor first. The kernel never builds that tensor: it reads keys and values straight
from the pool, a tile at a time, through the block table.

Grid ``(query tiles, sequences, KV heads × splits)``. A program owns

* ``BLOCK_Q`` query tokens of one sequence × the ``GROUP`` query heads of one KV head:
  ``BLOCK_M`` rows in one ``tl.dot`` tile, so each K/V tile is read once for the whole
  group (GQA). A decode row is just a tile with one token; a prefill row gets as many
  programs as it has tiles of tokens. Programs past a sequence's tokens exit at once, so
  decode and prefill rows share one launch.
* the keys ``0 .. kv_end`` its tokens may see (causal: token ``i`` of a step that starts at
  ``context_len`` sees keys ``<= context_len + i``), in tiles of ``TILE_N``. For each key
  the kernel looks up ``block_tables[seq, pos // BLOCK_SIZE]``, so ``TILE_N`` and
  ``BLOCK_SIZE`` are independent.
* an online softmax: a running max ``m``, a running sum ``l`` and an unnormalised output
  ``acc``, rescaled whenever the max grows. Scores are kept in base 2 (``exp2``), the scale
  folded in as ``scale * log2(e)``.

With ``NUM_SPLITS > 1`` (flash-decoding) the KV tiles of each program are shared among
``NUM_SPLITS`` programs; each writes its partial ``(m, l, acc)`` and ``reduce_splits_kernel``
merges them: ``out = Σ acc_s 2^(m_s - M) / Σ l_s 2^(m_s - M)`` with ``M = max m_s``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from lifeofprompt.errors import ConfigError

from .tiles import TileConfig, cdiv, choose_num_kv_splits, choose_tiles, next_power_of_2
from .triton_mode import INTERPRETED


def check_device(tensor: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; say so instead of failing deep inside Triton."""
    if not INTERPRETED and not tensor.is_cuda:
        raise ConfigError(
            f"the Triton kernels are compiled for the GPU but got a tensor on {tensor.device}: "
            "move the model and cache to CUDA, use backend='torch', or set TRITON_INTERPRET=1 "
            "before the first import of lifeofprompt.kernels"
        )


@triton.jit
def paged_attention_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    k_pool_ptr,
    v_pool_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    stride_q_row,
    stride_q_head,
    stride_out_row,
    stride_out_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table_seq,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return  # this sequence has fewer query tokens
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # cached tokens before this step's first query

    # Tile row m = query token m // GROUP of this tile, query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    token = q_tile * BLOCK_Q + rows // GROUP  # index among this sequence's query tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < query_len)
    dim_ok = dims < HEAD_DIM
    flat_row = (query_start + token).to(tl.int64)
    q = tl.load(
        query_ptr + flat_row[:, None] * stride_q_row + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q = q.to(k_pool_ptr.dtype.element_ty)
    query_pos = context_len + token  # absolute position of each row's token

    # Keys any row of this tile may see, then this split's share of their tiles.
    last_token = tl.minimum(query_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_end = tl.maximum(tl.minimum(seq_len, context_len + last_token + 1), 0)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for t in range(first_tile, end_tile):
        key_pos = t * TILE_N + tl.arange(0, TILE_N)
        key_ok = key_pos < kv_end
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        k_off = block * stride_k_block + in_block * stride_k_slot + kv_head * stride_k_head
        v_off = block * stride_v_block + in_block * stride_v_slot + kv_head * stride_v_head
        k = tl.load(k_pool_ptr + k_off[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_pool_ptr + v_off[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)

        scores = tl.dot(q, k, input_precision="ieee") * scale_log2  # [BLOCK_M, TILE_N], base 2
        visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # nothing visible (padding) -> 0
        tl.store(
            out_ptr + flat_row[:, None] * stride_out_row + head[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        part = (flat_row * NUM_HEADS + head) * NUM_SPLITS + split  # [T, heads, splits] layout
        tl.store(partial_max_ptr + part, m_i, mask=row_ok)
        tl.store(partial_sum_ptr + part, l_i, mask=row_ok)
        tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def reduce_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_out_row,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    """Merge the partial softmax states of one (row, head) from its ``NUM_SPLITS`` programs."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    split_ok = splits < NUM_SPLITS
    part = (row * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(partial_max_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(partial_sum_ptr + part, mask=split_ok, other=0.0)  # noqa: E741 (the online softmax's own name)
    acc = tl.load(partial_acc_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :], mask=split_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + row * stride_out_row + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_plan(
    query: torch.Tensor,
    num_kv_heads: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_splits: int | None = None,
    tile_n: int | None = None,
    block_m: int | None = None,
) -> tuple[TileConfig, tuple, int]:
    """Tiles, grid and number of KV splits, from shapes and Python ints only (no host sync)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    config = choose_tiles(num_heads, num_kv_heads, head_dim, max_query_len, tile_n=tile_n, block_m=block_m)
    q_tiles = cdiv(max(1, max_query_len), config.block_q)
    if num_kv_splits is None:
        num_sms = _num_sms(query.device.index or 0) if query.is_cuda else None
        num_kv_splits = choose_num_kv_splits(q_tiles * num_seqs * num_kv_heads, max_seq_len, num_sms)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    return config, (q_tiles, num_seqs, num_kv_heads * num_kv_splits), num_kv_splits


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
    num_kv_splits: int | None = None,
    tile_n: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of query rows ``[T, heads, head_dim]`` over the paged pool -> ``[T, heads, head_dim]``.

    Same contract as ``lifeofprompt.model.paged_attention.paged_attention``. ``num_kv_splits``
    forces flash-decoding with that many splits (1 = never); None lets ``choose_num_kv_splits``
    decide from the grid size and ``max_seq_len``. Grid sizes come from tensor shapes and the
    Python ints ``max_query_len``/``max_seq_len`` only, never from tensor values, so decode
    steps can be captured in CUDA graphs (with ``num_kv_splits`` fixed per graph).
    A graph captured with any split count stays correct for any lengths (each program derives
    its share of keys from ``seq_lens`` on the GPU); only speed depends on the count.
    ``tile_n``, ``block_m``, ``num_warps`` and ``num_stages`` override the tuned defaults
    (benchmarks and tests).

    Every row must belong to a sequence: ``query_start_loc[-1] == T`` and ``max_query_len``
    at least every query length (rows outside are not written). To pad a batch to a fixed
    size, add sequences of one query row with length 0 and slot -1: their output is 0.
    """
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_pool.shape[2]
    check_device(query)
    assert k_pool.shape == v_pool.shape and k_pool.shape[3] == head_dim
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1, "the pools' head_dim must be contiguous"
    assert block_tables.stride(-1) == 1, "block tables must be contiguous along the blocks"
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_seqs = seq_lens.shape[0]
    out = torch.empty(num_rows, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_rows == 0 or num_seqs == 0:
        return out
    config, grid, splits = launch_plan(
        query, num_kv_heads, num_seqs, max_query_len, max_seq_len, num_kv_splits, tile_n, block_m
    )
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    if splits > 1:
        partial_acc = torch.empty(
            num_rows, num_heads, splits, config.head_dim_padded, dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty(num_rows, num_heads, splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_acc = partial_max = partial_sum = out  # unused by the one-pass kernel
    paged_attention_kernel[grid](
        out,
        partial_acc,
        partial_max,
        partial_sum,
        query,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        v_pool.stride(0),
        v_pool.stride(1),
        v_pool.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=config.group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=config.head_dim_padded,
        BLOCK_SIZE=k_pool.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_Q=config.block_q,
        TILE_N=config.tile_n,
        NUM_SPLITS=splits,
        **launch,
    )
    if splits > 1:
        reduce_splits_kernel[(num_rows, num_heads)](
            out,
            partial_acc,
            partial_max,
            partial_sum,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=config.head_dim_padded,
            NUM_SPLITS=splits,
            SPLITS_PADDED=next_power_of_2(splits),
        )
    return out
