"""Store kernel: this step's new key/value rows written into the paged pool by slot.

One program per token row copies its ``[kv_heads, head_dim]`` key and value into slot
``slot_mapping[row]`` of the pool ``[num_blocks, block_size, kv_heads, head_dim]``, i.e. block
``slot // block_size``, offset ``slot % block_size``. A negative slot marks a padding row:
its program stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import check_device
from .tiles import next_power_of_2


@triton.jit
def store_kv_kernel(
    key_ptr,
    value_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slot_mapping_ptr,
    stride_key_row,
    stride_key_head,
    stride_value_row,
    stride_value_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    heads = tl.arange(0, KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    num_heads_to_store = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # none for a padding row
    mask = (heads[:, None] < num_heads_to_store) & (dims[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    key = tl.load(key_ptr + row * stride_key_row + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(value_ptr + row * stride_value_row + heads[:, None] * stride_value_head + dims[None, :], mask=mask)
    k_dst = (
        k_pool_ptr + block * stride_k_block + offset * stride_k_slot + heads[:, None] * stride_k_head + dims[None, :]
    )
    v_dst = (
        v_pool_ptr + block * stride_v_block + offset * stride_v_slot + heads[:, None] * stride_v_head + dims[None, :]
    )
    tl.store(k_dst, key.to(k_pool_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_pool_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` rows ``[T, kv_heads, head_dim]`` into the pools at ``slot_mapping[T]``.

    Same contract as ``lifeofprompt.model.paged_attention.store_kv``; reads no tensor values on the
    host, so it can be captured in a CUDA graph.
    """
    num_rows, num_kv_heads, head_dim = key.shape
    check_device(key)
    assert value.shape == key.shape and k_pool.shape == v_pool.shape
    assert k_pool.shape[2:] == (num_kv_heads, head_dim), f"pool {tuple(k_pool.shape)} vs rows {tuple(key.shape)}"
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1, "the pools' head_dim must be contiguous"
    if num_rows == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    store_kv_kernel[(num_rows,)](
        key,
        value,
        k_pool,
        v_pool,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        v_pool.stride(0),
        v_pool.stride(1),
        v_pool.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_pool.shape[1],
        KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
    )
