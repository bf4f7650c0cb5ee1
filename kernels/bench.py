"""Speed of the paged-attention kernel on a GPU, and of torch SDPA over a contiguous cache.

Decode attention is memory-bound: each step reads every cached key and value once. So the
figure that matters is achieved bandwidth, ``bytes moved / time``, with bytes = K and V of
every token of every sequence + the query rows read + the output rows written. The torch
baseline is ``scaled_dot_product_attention`` over a contiguous ``[B, kv_heads, L, D]`` cache
of the same lengths (no block table, no paging): what paging costs or saves shows directly.

    python -m lifeofprompt.kernels.bench --out results.json    # on a GPU

Timings use ``triton.testing.do_bench`` (median of many runs after warm-up, L2 flushed).
"""

from __future__ import annotations

import argparse
import json

import torch

from .cases import make_case


def _bytes_moved(batch: int, seq_len: int, query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    kv = 2 * batch * seq_len * num_kv_heads * head_dim
    q_and_out = 2 * batch * query_len * num_heads * head_dim
    return (kv + q_and_out) * element


def bench_paged_attention(batch: int, context_len: int, num_heads: int = 32, num_kv_heads: int = 4,
                          head_dim: int = 64, block_size: int = 16, dtype=torch.bfloat16,
                          num_kv_splits: int | None = None, query_len: int = 1, tile_n: int | None = None,
                          device: str = "cuda") -> dict:
    """Time of one Triton paged-attention launch over ``batch`` sequences of ``context_len`` cached tokens.

    ``query_len`` new tokens per sequence (1 = decode). Returns the settings, the number of KV
    splits the wrapper used, milliseconds and GB/s.
    """
    import triton.testing

    from . import paged_attention
    from .paged_attention import launch_plan

    case = make_case([query_len] * batch, [context_len] * batch, block_size, num_heads, num_kv_heads, head_dim,
                     dtype=dtype, device=device, spare_blocks=0)
    config, grid, splits = launch_plan(case.query, num_kv_heads, batch, query_len, case.max_seq_len,
                                       num_kv_splits, tile_n)
    ms = triton.testing.do_bench(lambda: paged_attention(*case.attention_args(), num_kv_splits=num_kv_splits,
                                                         tile_n=tile_n))
    moved = _bytes_moved(batch, context_len + query_len, query_len, num_heads, num_kv_heads, head_dim, dtype)
    return dict(kernel="triton paged", batch=batch, context_len=context_len, query_len=query_len,
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                dtype=str(dtype).replace("torch.", ""), num_kv_splits=splits, block_m=config.block_m,
                tile_n=config.tile_n, programs=grid[0] * grid[1] * grid[2], ms=ms, gb_per_s=moved / ms / 1e6)


def bench_sdpa(batch: int, context_len: int, num_heads: int = 32, num_kv_heads: int = 4, head_dim: int = 64,
               dtype=torch.bfloat16, device: str = "cuda") -> dict:
    """Time of torch SDPA for one decode token per sequence over a contiguous cache of ``context_len + 1`` keys."""
    import torch.nn.functional as F
    import triton.testing

    seq_len = context_len + 1
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, num_heads, 1, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, num_kv_heads, seq_len, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn_like(k)
    ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    moved = _bytes_moved(batch, seq_len, 1, num_heads, num_kv_heads, head_dim, dtype)
    return dict(kernel="torch sdpa (contiguous)", batch=batch, context_len=context_len, query_len=1,
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=None,
                dtype=str(dtype).replace("torch.", ""), num_kv_splits=None, ms=ms, gb_per_s=moved / ms / 1e6)


DECODE_SHAPES = [(1, 1024), (1, 32768), (8, 4096), (64, 1024), (64, 4096), (256, 2048)]


def run_decode_suite(num_heads: int = 32, num_kv_heads: int = 4, head_dim: int = 64, dtype=torch.bfloat16) -> list[dict]:
    """TinyLlama's heads by default: each decode shape with the split heuristic, without splits, and SDPA."""
    rows = []
    for batch, context_len in DECODE_SHAPES:
        heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        rows.append(bench_paged_attention(batch, context_len, **heads))
        rows.append(bench_paged_attention(batch, context_len, **heads, num_kv_splits=1))
        rows.append(bench_sdpa(batch, context_len, **heads))
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'kernel':26} {'batch':>5} {'context':>7} {'splits':>6} {'ms':>8} {'GB/s':>7}"]
    for r in rows:
        lines.append(f"{r['kernel']:26} {r['batch']:5d} {r['context_len']:7d} {str(r['num_kv_splits']):>6} "
                     f"{r['ms']:8.4f} {r['gb_per_s']:7.0f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--llama-8b-heads", action="store_true", help="32 query / 8 KV heads of 128 instead of TinyLlama's")
    args = parser.parse_args(argv)
    heads = dict(num_heads=32, num_kv_heads=8, head_dim=128) if args.llama_8b_heads else {}
    rows = run_decode_suite(**heads)
    print(format_rows(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
