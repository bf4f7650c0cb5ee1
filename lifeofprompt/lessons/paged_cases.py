"""Random paged-attention batches: chapter 11's checked launch, the kernel tests (CPU and GPU), the benchmark.

A case is a batch of sequences, each with a cached prefix (``context_len`` tokens already in
the pool) and ``query_len`` new tokens this step: ``query_len == 1`` is a decode row, more is
a prefill or chunked-prefill row, ``context_len == 0`` a fresh prompt. Blocks are handed out
from a shuffled pool, so block tables are neither contiguous nor ordered, and unused table
entries are -1 as in the engine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..kernels.tiles import cdiv


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, heads, head_dim]
    key: torch.Tensor  # [T, kv_heads, head_dim]: this step's new rows
    value: torch.Tensor
    k_pool: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim], prefixes already stored
    v_pool: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding rows
    max_query_len: int
    max_seq_len: int
    scale: float

    def attention_args(self) -> tuple:
        return (
            self.query,
            self.k_pool,
            self.v_pool,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.max_query_len,
            self.max_seq_len,
            self.scale,
        )


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    padding_seqs: int = 0,
) -> PagedCase:
    """A batch whose prefixes are already in the pool and whose new rows are not (``store_kv`` does that).

    ``padding_seqs`` appends that many padding entries, as a CUDA-graph batch padded to a fixed
    size has: one query row each, slot -1 (not stored), length 0, an all -1 block table. Their
    attention output is 0 (the reference's convention for rows that see no key).
    """
    gen = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens) + [1] * padding_seqs
    context_lens = list(context_lens) + [-1] * padding_seqs
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(1, max(blocks_per_seq))
    tables, slots = [], []
    for b, (n, q) in enumerate(zip(seq_lens, query_lens)):
        table, order = order[: blocks_per_seq[b]], order[blocks_per_seq[b] :]
        tables.append(table + [-1] * (width - len(table)))
        slots.extend(table[p // block_size] * block_size + p % block_size if p >= 0 else -1 for p in range(n - q, n))

    device_gen = gen if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=device_gen, device=device).to(dtype)

    total = sum(query_lens)
    k_pool = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_pool = randn(num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedCase(
        query=randn(total, num_heads, head_dim),
        key=randn(total, num_kv_heads, head_dim),
        value=randn(total, num_kv_heads, head_dim),
        k_pool=k_pool,
        v_pool=v_pool,
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def gather_slots(block_tables: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
    """Slot of every (sequence, position < max_seq_len) pair through the block tables: ``[B, max_seq_len]``.

    Positions past a table's end read block 0; the caller masks them out by sequence length.
    """
    positions = torch.arange(max_seq_len, device=block_tables.device)
    block_index = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables[:, block_index].long().clamp(min=0)
    return blocks * block_size + (positions % block_size)


def used_slots(case: PagedCase) -> torch.Tensor:
    """Flat slots that hold a token of some sequence (its prefix or this step's rows)."""
    slots = gather_slots(case.block_tables, max(1, case.max_seq_len), case.k_pool.shape[1])
    positions = torch.arange(slots.shape[1], device=slots.device)
    return slots[positions[None, :] < case.seq_lens.long()[:, None]]


def poisoned_pools(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the pools with NaN in every slot no sequence owns: a kernel that reads one fails."""
    pools = []
    for pool in (case.k_pool, case.v_pool):
        flat = torch.full_like(pool, float("nan")).view(-1, *pool.shape[2:])
        keep = used_slots(case)
        flat[keep] = pool.view(-1, *pool.shape[2:])[keep]
        pools.append(flat.view(pool.shape))
    return pools[0], pools[1]


def random_batch(rng: random.Random, block_size: int, max_len: int = 70) -> tuple[list[int], list[int]]:
    """Query and prefix lengths of 2-4 sequences: at least one decode row and one prefill row.

    Prefill rows get a zero prefix half the time; the first sequence ends exactly on, or one
    token past, a block boundary.
    """
    decode = [(1, rng.randrange(0, max_len)) for _ in range(rng.randint(1, 2))]
    prefill = [(rng.randint(2, 24), rng.choice([0, rng.randrange(1, max_len)])) for _ in range(rng.randint(1, 2))]
    seqs = decode + prefill
    rng.shuffle(seqs)
    q, _ = seqs[0]
    seqs[0] = (q, max(0, block_size * rng.randint(1, 3) - q + rng.choice([0, 1])))
    return [q for q, _ in seqs], [c for _, c in seqs]


def covering_cases(count: int, dtypes: list, seed: int = 6, max_len: int = 70) -> list[dict]:
    """``count`` configurations that use every block size (1, 8, 16, 32), GQA group (1, 3, 8),
    head_dim (64, 128), dtype, split choice (1, heuristic, 2, 3), KV tile (16, 32, default)
    and padding several times each, with random lengths: ``make_case`` keyword arguments plus
    ``num_kv_splits``/``tile_n``/``id``."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        block_size = [1, 8, 16, 32][i % 4]
        group = [1, 3, 8][i % 3]
        head_dim = [64, 128][(i // 2) % 2]
        dtype = dtypes[(i // 4) % len(dtypes)]
        num_kv_heads = 1 if group == 8 or head_dim == 128 else 2
        splits = [1, None, 3, 2][(i + i // 4) % 4]
        tile_n = [16, 32, None][i % 3]
        query_lens, context_lens = random_batch(rng, block_size, max_len)
        cases.append(
            dict(
                query_lens=query_lens,
                context_lens=context_lens,
                block_size=block_size,
                num_heads=group * num_kv_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                seed=100 + i,
                padding_seqs=i % 2,
                num_kv_splits=splits,
                tile_n=tile_n,
                id=f"bs{block_size}-g{group}-d{head_dim}-{str(dtype)[6:]}-split{splits}-{i}",
            )
        )
    return cases


def run_step(case: PagedCase, num_kv_splits: int | None = None, tile_n: int | None = None, poison: bool = True):
    """Triton store + attention (on NaN-poisoned copies of the pools when ``poison``) and the torch reference.

    Returns ``(out, expected, (k_pool, v_pool))``: the kernel's output, the reference's, and the
    pools the kernels wrote, for the CPU interpreter tests and the GPU tests alike.
    """
    from ..kernels import paged_attention, store_kv
    from ..model import paged_attention as reference

    k_pool, v_pool = poisoned_pools(case) if poison else (case.k_pool.clone(), case.v_pool.clone())
    store_kv(case.key, case.value, k_pool, v_pool, case.slot_mapping)
    out = paged_attention(
        case.query,
        k_pool,
        v_pool,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.max_query_len,
        case.max_seq_len,
        case.scale,
        num_kv_splits=num_kv_splits,
        tile_n=tile_n,
    )
    reference.store_kv(case.key, case.value, case.k_pool, case.v_pool, case.slot_mapping)
    return out, reference.paged_attention(*case.attention_args()), (k_pool, v_pool)


def compare_with_reference(case: PagedCase, num_kv_splits: int | None = None, **tuning) -> dict:
    """Run one step through the Triton kernels and the torch reference, each on its own copy of the pools.

    For the notebook and quick checks: the largest output difference, whether the two pools
    hold the same rows afterwards, and the rows and heads compared.
    """
    from ..kernels import paged_attention, store_kv
    from ..model import paged_attention as reference

    pools = {name: (case.k_pool.clone(), case.v_pool.clone()) for name in ("triton", "torch")}
    store_kv(case.key, case.value, *pools["triton"], case.slot_mapping)
    reference.store_kv(case.key, case.value, *pools["torch"], case.slot_mapping)
    rest = (case.block_tables, case.seq_lens, case.query_start_loc, case.max_query_len, case.max_seq_len, case.scale)
    out = paged_attention(case.query, *pools["triton"], *rest, num_kv_splits=num_kv_splits, **tuning)
    expected = reference.paged_attention(case.query, *pools["torch"], *rest)
    return dict(
        max_abs_diff=float((out.float() - expected.float()).abs().max()),
        pools_equal=all(torch.equal(a, b) for a, b in zip(pools["triton"], pools["torch"])),
        rows=out.shape[0],
        heads=out.shape[1],
    )


def errors_against_fp32(case: PagedCase, num_kv_splits: int | None = None, **tuning) -> dict:
    """How far the kernel's and the torch reference's low-precision outputs each are from fp32 attention.

    Both read the same bf16/fp16 keys and values; the "truth" is the reference run on those
    exact values in fp32. A kernel as precise as the reference has about the reference's
    error (its own output rounding); a bug or a sloppy accumulation shows up as a larger one.
    """
    from ..kernels import paged_attention
    from ..model import paged_attention as reference

    rest = (case.block_tables, case.seq_lens, case.query_start_loc, case.max_query_len, case.max_seq_len, case.scale)
    truth = reference.paged_attention(case.query.float(), case.k_pool.float(), case.v_pool.float(), *rest)
    low = reference.paged_attention(case.query, case.k_pool, case.v_pool, *rest).float()
    out = paged_attention(case.query, case.k_pool, case.v_pool, *rest, num_kv_splits=num_kv_splits, **tuning).float()

    def rms(x):
        return float(x.pow(2).mean().sqrt())

    return dict(
        kernel_rms=rms(out - truth),
        reference_rms=rms(low - truth),
        kernel_max=float((out - truth).abs().max()),
        reference_max=float((low - truth).abs().max()),
    )
