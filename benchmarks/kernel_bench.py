"""Speed of the paged-attention kernel on a GPU, and of torch SDPA over a contiguous cache.

Decode attention is memory-bound: each step reads every cached key and value once. So the
figure that matters is achieved bandwidth, ``bytes moved / time``, with bytes = K and V of
every token of every sequence + the query rows read + the output rows written. The torch
baseline is ``scaled_dot_product_attention`` over a contiguous ``[B, kv_heads, L, D]`` cache
of the same lengths (no block table, no paging): what paging costs or saves shows directly.

    python benchmarks/kernel_bench.py --out results.json    # on a GPU

Timings use ``triton.testing.do_bench_cudagraph``: the mean of a CUDA graph of many calls, so host
launch overhead is left out, as in the engine's graph-captured decode steps. The L2 (about
60 MB on an H200) is not flushed: shapes whose K/V fit in it read partly from cache.
"""

from __future__ import annotations

import argparse
import json

import torch

from lifeofprompt.lessons.paged_cases import make_case


def _bytes_moved(
    batch: int, seq_len: int, query_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    kv = 2 * batch * seq_len * num_kv_heads * head_dim
    q_and_out = 2 * batch * query_len * num_heads * head_dim
    return (kv + q_and_out) * element


def _time_ms(fn) -> float:
    """Mean GPU time of ``fn`` replayed in a CUDA graph (as the engine's decode steps run: no launch gaps)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=20)


def paged_case(
    batch: int,
    context_len: int,
    query_len: int = 1,
    num_heads: int = 32,
    num_kv_heads: int = 4,
    head_dim: int = 64,
    block_size: int = 16,
    dtype=torch.bfloat16,
    device: str = "cuda",
):
    return make_case(
        [query_len] * batch,
        [context_len] * batch,
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype=dtype,
        device=device,
        spare_blocks=0,
    )


def bench_paged_attention(
    batch: int,
    context_len: int,
    num_heads: int = 32,
    num_kv_heads: int = 4,
    head_dim: int = 64,
    block_size: int = 16,
    dtype=torch.bfloat16,
    num_kv_splits: int | None = None,
    query_len: int = 1,
    device: str = "cuda",
    case=None,
    **tuning,
) -> dict:
    """GPU time of one Triton paged-attention call over ``batch`` sequences of ``context_len`` cached tokens.

    ``query_len`` new tokens per sequence (1 = decode). ``tuning`` may hold ``tile_n``,
    ``block_m``, ``num_warps``, ``num_stages``. Returns the settings, the KV splits used,
    milliseconds and GB/s. Pass ``case`` to reuse one batch across settings.
    """
    from lifeofprompt.kernels import paged_attention
    from lifeofprompt.kernels.paged_attention import launch_plan

    case = case or paged_case(
        batch, context_len, query_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    config, grid, splits = launch_plan(
        case.query,
        num_kv_heads,
        batch,
        query_len,
        case.max_seq_len,
        num_kv_splits,
        tuning.get("tile_n"),
        tuning.get("block_m"),
    )
    ms = _time_ms(lambda: paged_attention(*case.attention_args(), num_kv_splits=num_kv_splits, **tuning))
    moved = _bytes_moved(batch, context_len + query_len, query_len, num_heads, num_kv_heads, head_dim, dtype)
    return dict(
        kernel="triton paged",
        batch=batch,
        context_len=context_len,
        query_len=query_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype).replace("torch.", ""),
        num_kv_splits=splits,
        block_m=config.block_m,
        tile_n=config.tile_n,
        num_warps=tuning.get("num_warps"),
        num_stages=tuning.get("num_stages"),
        programs=grid[0] * grid[1] * grid[2],
        ms=ms,
        gb_per_s=moved / ms / 1e6,
    )


def bench_sdpa(
    batch: int,
    context_len: int,
    num_heads: int = 32,
    num_kv_heads: int = 4,
    head_dim: int = 64,
    dtype=torch.bfloat16,
    query_len: int = 1,
    device: str = "cuda",
) -> dict:
    """GPU time of torch SDPA over a contiguous cache: one decode token per sequence over ``context_len + 1``
    keys, or (``context_len`` 0) a causal prompt of ``query_len`` tokens."""
    import torch.nn.functional as F

    if query_len > 1 and context_len:
        raise ValueError("the SDPA baseline covers decode (query_len 1) and whole prompts (context_len 0)")
    seq_len = context_len + query_len
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, num_heads, query_len, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, num_kv_heads, seq_len, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn_like(k)
    causal = query_len > 1
    ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    moved = _bytes_moved(batch, seq_len, query_len, num_heads, num_kv_heads, head_dim, dtype)
    return dict(
        kernel="torch sdpa (contiguous)",
        batch=batch,
        context_len=context_len,
        query_len=query_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=None,
        dtype=str(dtype).replace("torch.", ""),
        num_kv_splits=None,
        ms=ms,
        gb_per_s=moved / ms / 1e6,
    )


DECODE_SHAPES = [(1, 1024), (1, 32768), (8, 4096), (64, 1024), (64, 4096), (256, 2048)]
TINYLLAMA = dict(num_heads=32, num_kv_heads=4, head_dim=64)
LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def run_decode_suite(
    num_heads: int = 32, num_kv_heads: int = 4, head_dim: int = 64, dtype=torch.bfloat16
) -> list[dict]:
    """TinyLlama's heads by default: each decode shape with the split heuristic, without splits, and SDPA."""
    rows = []
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    for batch, context_len in DECODE_SHAPES:
        case = paged_case(batch, context_len, 1, **heads, dtype=dtype)
        rows.append(bench_paged_attention(batch, context_len, **heads, dtype=dtype, case=case))
        rows.append(bench_paged_attention(batch, context_len, **heads, dtype=dtype, case=case, num_kv_splits=1))
        rows.append(bench_sdpa(batch, context_len, **heads, dtype=dtype))
        del case
        torch.cuda.empty_cache()
    return rows


def sweep(dtype=torch.bfloat16) -> list[dict]:
    """Tile, warp, stage and split settings over decode and prefill shapes, to choose the defaults."""
    import itertools

    rows = []
    decode = [
        (1, 32768, TINYLLAMA),
        (8, 4096, TINYLLAMA),
        (64, 4096, TINYLLAMA),
        (256, 2048, TINYLLAMA),
        (64, 4096, LLAMA_8B),
    ]
    for batch, context_len, heads in decode:
        case = paged_case(batch, context_len, 1, **heads, dtype=dtype)
        for tile_n, num_warps, num_stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
            rows.append(
                bench_paged_attention(
                    batch,
                    context_len,
                    **heads,
                    dtype=dtype,
                    case=case,
                    num_kv_splits=1,
                    tile_n=tile_n,
                    num_warps=num_warps,
                    num_stages=num_stages,
                )
            )
        for splits in (None, 4, 8, 16, 32, 64) if batch <= 8 else (None, 2):
            rows.append(
                bench_paged_attention(batch, context_len, **heads, dtype=dtype, case=case, num_kv_splits=splits)
            )
        rows.append(bench_sdpa(batch, context_len, **heads, dtype=dtype))
        del case
        torch.cuda.empty_cache()
    batch, query_len = 4, 1024
    case = paged_case(batch, 0, query_len, **TINYLLAMA, dtype=dtype)
    for block_m, tile_n, num_warps in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8)):
        rows.append(
            bench_paged_attention(
                batch,
                0,
                **TINYLLAMA,
                dtype=dtype,
                case=case,
                query_len=query_len,
                block_m=block_m,
                tile_n=tile_n,
                num_warps=num_warps,
            )
        )
    rows.append(bench_sdpa(batch, 0, **TINYLLAMA, dtype=dtype, query_len=query_len))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        f"{'kernel':24} {'batch':>5} {'ctx':>6} {'q':>5} {'kvh':>3} {'D':>4} {'split':>5} {'bm':>4} {'tn':>4} "
        f"{'w':>2} {'st':>2} {'ms':>8} {'GB/s':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['kernel'][:24]:24} {r['batch']:5d} {r['context_len']:6d} {r['query_len']:5d} "
            f"{r['num_kv_heads']:3d} {r['head_dim']:4d} {str(r['num_kv_splits']):>5} {str(r.get('block_m')):>4} "
            f"{str(r.get('tile_n')):>4} {str(r.get('num_warps')):>2} {str(r.get('num_stages')):>2} "
            f"{r['ms']:8.4f} {r['gb_per_s']:6.0f}"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--llama-8b-heads", action="store_true", help="32 query / 8 KV heads of 128 instead of TinyLlama's"
    )
    parser.add_argument("--sweep", action="store_true", help="tile/warp/stage/split settings instead of the suite")
    args = parser.parse_args(argv)
    if args.sweep:
        rows = sweep()
    else:
        rows = run_decode_suite(**(LLAMA_8B if args.llama_8b_heads else TINYLLAMA))
    print(format_rows(rows), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
