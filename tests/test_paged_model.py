"""The paged cache end to end: torch paged attention against plain attention, then the real model over blocks."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from lifeofprompt.engine.block_manager import BlockManager
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.lessons.generate import generate_cached
from lifeofprompt.lessons.paging import trace_paged_generation
from lifeofprompt.model.paged_attention import paged_attention, store_kv

# Greedy continuations of the three prompts on the embedded model (same as generate_cached); every step
# decided far beyond fp32 rounding (tests/test_pins.py), so paged or contiguous, any CPU, gives them exactly.
PINNED = {
    "hi my name is": [2026, 365, 10905, 6176, 28, 4836],
    "today is a beautiful summer day": [281, 260, 216, 34, 33, 302],
    "hello there": [506, 787, 737, 288, 536, 357],
}

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


# ---------------------------------------------------------------------- paged attention vs plain attention
def plain_attention(q, k, v, scale):
    """One sequence, written out: queries are its last rows, each sees every key up to its own position."""
    num_q, heads = q.shape[:2]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    context = k.shape[0] - num_q
    mask = torch.arange(k.shape[0])[None, :] > (context + torch.arange(num_q))[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_matches_plain_attention(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = rng.choice([(4, 4), (4, 2), (6, 2), (8, 1)])
    head_dim, block_size, num_blocks = rng.choice([8, 16]), rng.choice([1, 2, 4, 16]), 64
    num_seqs = rng.randint(1, 4)
    # each sequence: a cached prefix (possibly empty) and this step's rows (1 = decode)
    shapes = [(rng.choice([0, rng.randint(1, 20)]), rng.choice([1, rng.randint(1, 9)])) for _ in range(num_seqs)]
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)  # garbage everywhere
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous tables
    tables, keys, values, queries, new_slots, new_k, new_v = [], [], [], [], [], [], []
    for context, num_q in shapes:
        length = context + num_q
        table = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(table)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        keys.append(k)
        values.append(v)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        store_kv(k[:context], v[:context], k_pool, v_pool, torch.tensor(slots[:context], dtype=torch.long))
        new_slots += slots[context:] + [-1]  # one padding row after each
        new_k += [k[context:], torch.full((1, kv_heads, head_dim), 1e6)]
        new_v += [v[context:], torch.full((1, kv_heads, head_dim), 1e6)]
        queries.append(torch.randn(num_q, heads, head_dim, generator=gen))
    before = k_pool.clone()
    store_kv(torch.cat(new_k), torch.cat(new_v), k_pool, v_pool, torch.tensor(new_slots))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[s for s in new_slots if s >= 0]] = True
    flat_before, flat_after = before.view(-1, kv_heads, head_dim), k_pool.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_after[~written], flat_before[~written])  # padding stored nowhere
    assert flat_after.abs().max() < 1e5

    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens = [n for _, n in shapes]
    seq_lens = [c + n for c, n in shapes]
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_attention(
        torch.cat(queries),
        k_pool,
        v_pool,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc,
        max(query_lens),
        max(seq_lens),
        scale,
    )
    expected = torch.cat([plain_attention(q, k, v, scale) for q, k, v in zip(queries, keys, values)])
    assert out.shape == (sum(query_lens), heads, head_dim)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_padding_row_comes_out_zero_whatever_sdpa_returns_for_it(monkeypatch):
    # A padding sequence (length 0) sees no key. SDPA's answer for such a row depends on the kernel that
    # runs (NaN, zeros, or, in the GPU's half-precision kernels, an average of the values): the
    # reference must zero it whatever that answer is.
    from lifeofprompt.lessons.paged_cases import make_case
    from lifeofprompt.model import paged_attention as module

    real_sdpa = module._sdpa

    def sdpa_that_averages_empty_rows(q, k, v, mask, scale):
        out = real_sdpa(q, k, v, mask, scale)
        average = v.mean(dim=2, keepdim=True).repeat_interleave(q.shape[1] // k.shape[1], 1)
        return torch.where(mask.any(-1, keepdim=True), out, average)

    monkeypatch.setattr(module, "_sdpa", sdpa_that_averages_empty_rows)
    case = make_case([3, 1, 1], [5, 9, 0], 4, num_heads=4, num_kv_heads=2, head_dim=8, seed=1, padding_seqs=1)
    store_kv(case.key, case.value, case.k_pool, case.v_pool, case.slot_mapping)
    out = paged_attention(*case.attention_args())
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert out[:-1].abs().sum(dim=(1, 2)).min() > 0


# ---------------------------------------------------------------------- the model over blocks
def shuffled_manager(num_blocks, block_size, seed, **kw):
    """A block manager whose free queue is shuffled, so tables are non-contiguous and interleaved."""
    bm = BlockManager(num_blocks, block_size, **kw)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    bm.free_queue = OrderedDict((i, None) for i in order)
    return bm


def test_three_prompts_over_shuffled_blocks_with_a_chunked_prompt_match_generate_cached(smollm2, story_ids):
    model, _ = smollm2
    prompts = dict(zip(PINNED, story_ids))
    bm = shuffled_manager(16, 2, seed=3)
    trace = trace_paged_generation(model, prompts, 6, block_manager=bm, chunk_size=3)
    first_tables = trace.snapshots[1].block_tables
    assert any(t != sorted(t) or t[-1] - t[0] != len(t) - 1 for t in first_tables.values())  # really scattered
    assert trace.snapshots[1].num_tokens["today is a beautiful summer day"] == 3  # the 6-token prompt ran in chunks
    assert trace.outputs == PINNED
    assert trace.outputs["hi my name is"] == generate_cached(model, story_ids[0], 6)
    assert trace.outputs["today is a beautiful summer day"] == generate_cached(model, story_ids[1], 6)
    assert bm.num_free_blocks == 16


def test_one_prompt_alone_over_blocks_matches_generate_cached(smollm2, story_ids):
    model, _ = smollm2
    trace = trace_paged_generation(
        model, {"hello there": story_ids[2]}, 6, block_manager=shuffled_manager(8, 4, seed=1)
    )
    assert trace.outputs["hello there"] == PINNED["hello there"] == generate_cached(model, story_ids[2], 6)


def test_shared_system_prompt_is_computed_once_and_changes_no_token(smollm2, story_ids):
    model, _ = smollm2
    system = list(range(1000, 1020))  # 20 tokens: one full block of 16, then 4
    prompts = {name: system + ids for name, ids in zip(PINNED, story_ids)}
    arrivals = {"today is a beautiful summer day": 1, "hello there": 1}
    on = trace_paged_generation(model, prompts, 2, num_blocks=12, block_size=16, arrivals=arrivals)
    off = trace_paged_generation(
        model, prompts, 2, num_blocks=12, block_size=16, arrivals=arrivals, enable_prefix_caching=False
    )
    # with the cache on, the later prompts compute 10 and 6 prompt rows instead of 26 and 22: other shapes,
    # other rounding. And after system + "hi my name is" + ' "' the best two tokens differ by 1e-4: either is right.
    margins = [top2_margins(teacher_forced_logits(model, prompts[p], off.outputs[p])).tolist() for p in PINNED]
    assert_greedy_agrees(
        [on.outputs[p] for p in PINNED], [off.outputs[p] for p in PINNED], margins, FP32_TOLERANCE, min_steps=5
    )
    assert on.stats["hits"] == 2 and on.stats["saved_tokens"] == 32  # the two later arrivals skip 16 each
    assert on.computed_tokens == {"hi my name is": 25, "today is a beautiful summer day": 11, "hello there": 7}
    assert sum(off.computed_tokens.values()) - sum(on.computed_tokens.values()) == 32
    shared = [s for s in on.snapshots if any(len(o) == 3 for o in s.owners)]
    assert shared, "the system prompt's block is held by all three at once"
