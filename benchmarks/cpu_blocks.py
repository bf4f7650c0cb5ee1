"""How fast the CPU multiplies a few rows by block matrices (Q4_1, Q8_0) against fp32 weights.

For each of SmolLM2-135M's matrix shapes it times ``x [M, in] @ W.T`` with ``W`` kept as blocks, with
float products (``lifeofprompt.cpu.block_kernels``) and with integer ones on the blocks re-laid for them
(``lifeofprompt.cpu.interleaved_blocks``: x made two int8 digits per block inside the call), and with
``W`` as fp32 through the rowwise kernel (``lifeofprompt.cpu.row_kernels``), and prints milliseconds and
the bytes each read per second.
A model's worth of copies of each layer matrix (one per layer) is cycled through, so the weights
come from memory, as in a real step, not from a cache that holds one matrix. The compiled functions
are called directly, with their inputs and outputs made once, so the times are the kernels' own
(the Python wrappers add ~10 us a call, as much as a small matrix takes).

    python benchmarks/cpu_blocks.py                      # rows 1 and 4, torch's thread count
    python benchmarks/cpu_blocks.py --rows 1 2 4 8 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from lifeofprompt.cpu import interleaved_blocks
from lifeofprompt.cpu.block_kernels import FORMAT_CODES, blocks_kernel
from lifeofprompt.cpu.row_kernels import rows_kernel
from lifeofprompt.env import cpu_label
from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.model.block_formats import quantize


def shapes(config, layer_format: str) -> list[tuple[str, int, int, str, int]]:
    """``(name, out, in, block format, copies)`` for each matrix a step reads; the LM head is Q8_0, once."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    layers = config.num_layers
    return [
        ("q, o", h, h, layer_format, layers),
        ("k, v", kv, h, layer_format, layers),
        ("qkv", qkv, h, layer_format, layers),
        ("gate, up", i, h, layer_format, layers),
        ("gate_up", 2 * i, h, layer_format, layers),
        ("down", h, i, layer_format, layers),
        ("lm_head", config.vocab_size, h, "q8_0", 1),
    ]


def best_pass(calls, reps: int) -> float:
    """Seconds per call for a pass over ``calls`` (best of ``reps`` passes after a warm-up)."""
    best = float("inf")
    for _ in range(reps + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - start)
    return best / len(calls)


def block_calls(blocks, x, y, threads: int, integer: bool = False) -> list:
    """One call of the compiled block kernel per matrix, ``y = x @ W.T`` (``integer``: the integer kernel, on
    re-laid blocks)."""
    kernel, (m, n) = blocks_kernel(), x.shape
    codes = FORMAT_CODES
    if integer:
        kernel, codes = interleaved_blocks.integer_kernel(), interleaved_blocks.FORMAT_CODES
    return [
        functools.partial(
            kernel,
            x.data_ptr(),
            m,
            n,
            codes[b.format],
            b.quants.data_ptr(),
            b.scales.data_ptr(),
            b.mins.data_ptr() if b.mins is not None else None,
            b.out_features,
            y.data_ptr(),
            threads,
        )
        for b in blocks
    ]


def rows_calls(weights, x, y, threads: int) -> list:
    """One call of the compiled fp32 rowwise kernel per matrix, ``y = x @ W.T``."""
    kernel, (m, n) = rows_kernel(), x.shape
    return [
        functools.partial(kernel, x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, w.shape[0], threads) for w in weights
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--format", default="q4_1", choices=["q4_1", "q8_0"], help="the layer matrices' format")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if blocks_kernel() is None or rows_kernel() is None:
        print("the compiled kernels are not available here (no C compiler?)")
        return 1
    torch.set_num_threads(args.threads)
    path = interleaved_blocks.integer_path()
    print(f"{cpu_label()}, {args.threads} thread(s), integer path {path}; ms per matrix and GB/s of the bytes read")
    generator = torch.Generator().manual_seed(0)
    for name, out, inner, fmt, copies in shapes(SMOLLM2_135M, args.format):
        floats = [torch.randn(out, inner, generator=generator) * 0.05 for _ in range(copies)]
        blocks = [quantize(w, fmt) for w in floats]
        relaid = [interleaved_blocks.interleave(b) for b in blocks]
        block_bytes, float_bytes = blocks[0].nbytes, floats[0].numel() * 4
        for rows in args.rows:
            x, y = torch.randn(rows, inner, generator=generator), torch.empty(rows, out)
            b = best_pass(block_calls(blocks, x, y, args.threads), args.reps)
            i = best_pass(block_calls(relaid, x, y, args.threads, integer=True), args.reps)
            f = best_pass(rows_calls(floats, x, y, args.threads), args.reps)
            print(
                f"{name:>8} {out:>5}x{inner:<5} M={rows:<2} {fmt}"
                f" float {b * 1e3:7.3f} ms {block_bytes / b / 1e9:5.1f} GB/s"
                f"  integer {i * 1e3:7.3f} ms {block_bytes / i / 1e9:5.1f} GB/s ({b / i:3.1f}x)"
                f"   fp32 {f * 1e3:7.3f} ms {float_bytes / f / 1e9:5.1f} GB/s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
