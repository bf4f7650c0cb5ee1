"""The Triton kernels compiled for a real GPU: the CPU cases in bf16/fp16/fp32, large shapes, CUDA graphs.

Run on the GPU machine with ``python -m pytest tests/gpu -q``. Skipped, with the reason, on
a machine without CUDA (there ``tests/test_kernels.py`` runs the same cases in the
interpreter). fp32 compares tightly because the kernel asks ``tl.dot`` for IEEE fp32
(no TF32); bf16/fp16 outputs are compared at their own precision.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lifeofprompt.model import paged_attention as reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU; the CPU interpreter runs the same cases in tests/test_kernels.py",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: these tests compile the kernels for the GPU",
    ),
]

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
TINYLLAMA_HEADS = dict(num_heads=32, num_kv_heads=4, head_dim=64)
LLAMA_8B_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def _kernels():
    from lifeofprompt import kernels

    assert not kernels.INTERPRETED
    return kernels


def _covering():
    if importlib.util.find_spec("triton") is None:
        return []
    from lifeofprompt.lessons.paged_cases import covering_cases

    return covering_cases(24, [torch.bfloat16, torch.float16, torch.float32], max_len=300)


def check_step(case, num_kv_splits=None, tile_n=None, poison=True):
    """Triton store + attention (NaN-poisoned pools and output) against the torch reference."""
    from lifeofprompt.lessons.paged_cases import run_step

    out, expected, _ = run_step(case, num_kv_splits, tile_n, poison)
    assert not out.isnan().any(), "output elements left unwritten or NaN read from an unused slot"
    torch.testing.assert_close(out, expected, **TOLERANCE[case.query.dtype])
    return out, expected


@pytest.mark.parametrize("params", _covering(), ids=lambda c: c["id"])
def test_random_cases(poison_allocations, params):
    from lifeofprompt.lessons.paged_cases import make_case

    params = dict(params)
    num_kv_splits, tile_n, _ = params.pop("num_kv_splits"), params.pop("tile_n"), params.pop("id")
    out, _ = check_step(make_case(**params, device="cuda"), num_kv_splits, tile_n)
    if params["padding_seqs"]:
        assert (out[-params["padding_seqs"] :] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_batch_64_of_4096(poison_allocations, dtype, num_kv_splits):
    from lifeofprompt.lessons.paged_cases import make_case

    case = make_case([1] * 64, [4095 - 7 * i for i in range(64)], 16, **TINYLLAMA_HEADS, dtype=dtype, device="cuda")
    check_step(case, num_kv_splits)


@pytest.mark.parametrize("num_kv_splits", [1, None, 7])
def test_decode_one_sequence_of_32k(poison_allocations, num_kv_splits):
    from lifeofprompt.kernels.paged_attention import launch_plan

    from lifeofprompt.lessons.paged_cases import make_case

    case = make_case([1], [32767], 16, **LLAMA_8B_HEADS, dtype=torch.bfloat16, device="cuda")
    _, _, splits = launch_plan(case.query, 8, 1, 1, case.max_seq_len, num_kv_splits)
    assert splits == num_kv_splits if num_kv_splits else splits > 1  # the heuristic splits one long sequence
    check_step(case, num_kv_splits)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_long_prefill_chunks_and_decodes(poison_allocations, block_size):
    """Chunked prefills of 300-512 tokens after long prefixes next to 24 decode rows, one launch."""
    from lifeofprompt.lessons.paged_cases import make_case

    query_lens = [512, 1] * 2 + [1] * 20 + [300, 64]
    context_lens = [1500, 3000, 0, 2047] + [37 * i for i in range(20)] + [0, 4000]
    case = make_case(
        query_lens, context_lens, block_size, **LLAMA_8B_HEADS, dtype=torch.bfloat16, device="cuda", padding_seqs=3
    )
    check_step(case)


def test_fp16_and_fp32_long_prefill_without_prefix():
    from lifeofprompt.lessons.paged_cases import make_case

    for dtype in (torch.float16, torch.float32):
        check_step(make_case([1024, 333], [0, 0], 16, **TINYLLAMA_HEADS, dtype=dtype, device="cuda"))


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_step_replays_in_a_cuda_graph(num_kv_splits):
    """Store + attention captured once, replayed with new lengths, slots and queries: no host sync inside."""
    from lifeofprompt.lessons.paged_cases import make_case

    kernels = _kernels()
    case = make_case(
        [1] * 8, [100 * i + 50 for i in range(8)], 16, **TINYLLAMA_HEADS, dtype=torch.bfloat16, device="cuda"
    )
    k_pool, v_pool = case.k_pool.clone(), case.v_pool.clone()

    def step():
        kernels.store_kv(case.key, case.value, k_pool, v_pool, case.slot_mapping)
        return kernels.paged_attention(
            case.query,
            k_pool,
            v_pool,
            case.block_tables,
            case.seq_lens,
            case.query_start_loc,
            1,
            case.max_seq_len,
            case.scale,
            num_kv_splits=num_kv_splits,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    gen = torch.Generator(device="cuda").manual_seed(1)
    block_size = k_pool.shape[1]
    for shrink in (0, 13, 49):
        new_lens = (case.seq_lens - shrink).clamp(min=1)
        last = (new_lens - 1).long()
        slots = (
            case.block_tables.gather(1, (last // block_size)[:, None]).squeeze(1).long() * block_size
            + last % block_size
        )
        case.seq_lens.copy_(new_lens)
        case.slot_mapping.copy_(slots)
        for t in (case.query, case.key, case.value):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32).to(t.dtype))
        ref_k, ref_v = k_pool.clone(), v_pool.clone()
        graph.replay()
        reference.store_kv(case.key, case.value, ref_k, ref_v, case.slot_mapping)
        expected = reference.paged_attention(
            case.query,
            ref_k,
            ref_v,
            case.block_tables,
            case.seq_lens,
            case.query_start_loc,
            1,
            case.max_seq_len,
            case.scale,
        )
        torch.cuda.synchronize()
        assert torch.equal(k_pool, ref_k) and torch.equal(v_pool, ref_v)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_splits", [1, None])
def test_low_precision_kernel_is_as_precise_as_the_reference(dtype, num_kv_splits):
    """Against fp32 attention on the same inputs, the kernel's error is about the torch reference's own
    (its bf16/fp16 output rounding): the Triton backend adds no error of its own to the engine."""
    from lifeofprompt.lessons.paged_cases import errors_against_fp32, make_case

    case = make_case(
        [1] * 16 + [200, 57],
        [3000 - 150 * i for i in range(16)] + [0, 900],
        16,
        **TINYLLAMA_HEADS,
        dtype=dtype,
        device="cuda",
    )
    _kernels()
    err = errors_against_fp32(case, num_kv_splits=num_kv_splits)
    print(err)
    assert err["kernel_rms"] <= 1.5 * err["reference_rms"], err
    assert err["kernel_max"] <= 2 * err["reference_max"], err
