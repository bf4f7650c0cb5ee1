"""Matrix products straight from GGUF blocks (Q8_0, Q4_1) for a few activation rows: W8A16 and W4A16.

Why bother: a decode step at batch 1 multiplies one row of activations by every weight matrix of
the model, so it reads every weight once and does two flops per weight it reads. The GPU's
arithmetic units sit idle; the step's time is the time it takes to *read* the weights, and the
floor is ``bytes of weights ÷ memory bandwidth``. In bf16 a weight is 16 bits. A Q8_0 block keeps
32 weights in 34 bytes (8.5 bits a weight) and a Q4_1 block in 20 bytes (5 bits), so the floor
falls about 1.9× and 3.2×, *if* the product reads the blocks as they are. Dequantizing the whole
matrix to bf16 first and then multiplying would read the blocks, write 16 bits a weight and read
them again: slower than never quantizing at all.

So each program of this kernel takes a tile of output features (``BLOCK_N`` rows of the weight
matrix) and walks along their inputs a tile of whole 32-weight blocks at a time (``BLOCK_K``
weights). For each step it loads the quants, the blocks' scales (and, for Q4_1, their minimums),
turns them into numbers in registers (``d * q`` or ``d * q + m``) and multiplies them into the
activations, accumulating in fp32. The float weights exist only in registers, one tile at a time.

Two ways to do the multiply, chosen by the number of activation rows ``M``:

* **one row** (the decode step): a multiply and a sum along the tile's inputs, in fp32 on the
  ordinary cores. ``tl.dot`` needs at least 16 rows, so one row would be padded to 16 and the
  dequantized tile would have to be moved into the tensor cores' operand layout (through shared
  memory): 15/16 of that work thrown away, for no fewer bytes read. The weight stays the exact
  fp32 ``d * q (+ m)`` here, never rounded to the activations' dtype.
* **2 to 16 rows** (a few decode rows, speculative verification, a short prompt chunk): ``tl.dot``
  on a 16-row tile (rows past ``M`` masked), the dequantized tile rounded to the activations'
  dtype first, exactly as ``dequantize(blocks, x.dtype)`` then ``x @ w.T`` does. Every row reuses
  the weight tile once it is in registers, so 16 rows cost about the bytes of one.

A Q4_1 byte holds two weights of one block: weight ``j`` in its low four bits and weight ``j + 16``
in its high four. Rather than interleave the nibbles back into order, the kernel keeps them as two
tiles (all low nibbles, all high nibbles) and loads the activations in the matching order, two
products per step.

When the output tiles alone give too few programs to keep every SM busy (``o_proj``'s 2048
outputs are 128 tiles of 16 on a 132-SM H200), the inputs are split too (**split-K**): ``split_k``
programs share each output tile, each walks its own stretch of blocks and writes fp32 partial
sums, and a second small kernel adds them and rounds once. No atomics, so results are the same
from run to run. All grid sizes come from shapes, never from tensor values, so the products can
be captured in CUDA graphs.

Without a GPU the kernels run in Triton's interpreter (see ``kernels/triton_mode.py``), where fp32
and fp16 are exact but bf16 ``tl.dot`` is not; ``reference`` is the torch product to compare with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lifeofprompt.model.block_formats import BLOCK, BlockWeight

from .paged_attention import check_device
from .tiles import cdiv, is_power_of_2, next_power_of_2

DOT_ROWS = 16  # the smallest tl.dot tile: 2..16 activation rows are padded up to it
ROW_BYTES_PER_STEP = 128  # quant bytes of one weight row loaded per step: 128 weights of Q8_0, 256 of Q4_1
PROGRAMS_PER_SM = 4  # split-K until the grid has about this many programs per SM
MAX_SPLIT_K = 8
REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction


# ----------------------------------------------------------------------------- dequantizing one tile


@triton.jit
def _q8_0_tile(quants_ptr, scales_ptr, n, n_ok, k0, quant_cols, stride_q, stride_s, BLOCK_K: tl.constexpr):
    """Weights ``k0 .. k0 + BLOCK_K`` of rows ``n`` as fp32 ``d * q``, and their input columns."""
    cols = k0 + tl.arange(0, BLOCK_K)
    ok = n_ok[:, None] & (cols < quant_cols)[None, :]
    q = tl.load(quants_ptr + n[:, None] * stride_q + cols[None, :], mask=ok, other=0)
    d = tl.load(scales_ptr + n[:, None] * stride_s + (cols // 32)[None, :], mask=ok, other=0.0)
    return q.to(tl.float32) * d.to(tl.float32), cols


@triton.jit
def _q4_1_tiles(quants_ptr, scales_ptr, mins_ptr, n, n_ok, k0, quant_cols, stride_q, stride_s, BLOCK_K: tl.constexpr):
    """Weights ``k0 .. k0 + BLOCK_K`` of rows ``n`` as two fp32 tiles ``d * q + m``, low and high nibbles,
    and the input columns of the low tile (the high tile's are 16 further on)."""
    j = tl.arange(0, BLOCK_K // 2)  # byte of this step: block j // 16, weights j % 16 and j % 16 + 16
    byte = k0 // 2 + j
    ok = n_ok[:, None] & (byte < quant_cols)[None, :]
    packed = tl.load(quants_ptr + n[:, None] * stride_q + byte[None, :], mask=ok, other=0)
    block = (byte // 16)[None, :]
    d = tl.load(scales_ptr + n[:, None] * stride_s + block, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(mins_ptr + n[:, None] * stride_s + block, mask=ok, other=0.0).to(tl.float32)
    low = (packed & 0x0F).to(tl.float32) * d + m
    high = (packed >> 4).to(tl.float32) * d + m
    cols = k0 + (j // 16) * 32 + j % 16
    return low, high, cols


@triton.jit
def _accumulate(acc, x_ptr, w, cols, rows, rows_ok, in_features, stride_x, USE_DOT: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N] += x[rows, cols] @ w.T`` for one dequantized tile ``w [BLOCK_N, cols]``."""
    ok = rows_ok[:, None] & (cols < in_features)[None, :]  # the ragged last block: x is only in_features long
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if USE_DOT:
        w = w.to(x_ptr.dtype.element_ty)  # the reference's rounding: dequantize to x's dtype, then multiply
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:  # one row: [BLOCK_N, BLOCK_K] * [1, BLOCK_K], summed along the inputs
        acc += tl.sum(w * x.to(tl.float32), axis=1)[None, :]
    return acc


# ----------------------------------------------------------------------------- the kernels


@triton.jit
def block_matmul_kernel(
    out_ptr,
    partial_ptr,
    x_ptr,
    quants_ptr,
    scales_ptr,
    mins_ptr,
    num_rows,
    out_features,
    in_features,
    quant_cols,
    tiles_per_split,
    stride_x,
    stride_out,
    stride_q,
    stride_s,
    Q4_1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """Program (n tile, m tile, split): outputs ``n`` of rows ``m``, from the split's stretch of K tiles."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_ok, rows_ok = n < out_features, rows < num_rows
    n64 = n.to(tl.int64)  # row offsets of the LM head's quants pass 2^31 bytes in big models
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(in_features, BLOCK_K))
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        if Q4_1:
            low, high, cols = _q4_1_tiles(
                quants_ptr, scales_ptr, mins_ptr, n64, n_ok, k0, quant_cols, stride_q, stride_s, BLOCK_K
            )
            acc = _accumulate(acc, x_ptr, low, cols, rows, rows_ok, in_features, stride_x, USE_DOT)
            acc = _accumulate(acc, x_ptr, high, cols + 16, rows, rows_ok, in_features, stride_x, USE_DOT)
        else:
            w, cols = _q8_0_tile(quants_ptr, scales_ptr, n64, n_ok, k0, quant_cols, stride_q, stride_s, BLOCK_K)
            acc = _accumulate(acc, x_ptr, w, cols, rows, rows_ok, in_features, stride_x, USE_DOT)
    ok = rows_ok[:, None] & n_ok[None, :]
    if not SPLIT:
        tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:  # partial sums [splits, num_rows, out_features], fp32
        flat = (split * num_rows + rows[:, None]).to(tl.int64) * out_features + n[None, :]
        tl.store(partial_ptr + flat, acc, mask=ok)


@triton.jit
def reduce_split_k_kernel(out_ptr, partial_ptr, numel, num_splits, BLOCK: tl.constexpr):
    """``out = sum over splits of partial``, rounded once to ``out``'s dtype (``out`` is contiguous)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        total += tl.load(partial_ptr + s * numel + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- tiles and launch


@dataclass(frozen=True)
class BlockTiles:
    """The compile-time tile shapes and the split of one launch."""

    block_m: int  # activation rows per program: 1 (multiply and sum) or 16 (tl.dot)
    block_n: int  # output features per program
    block_k: int  # weights of a row per step: whole 32-weight blocks, a power of 2
    split_k: int  # programs sharing one output tile, each with its own stretch of K tiles
    tiles_per_split: int  # K tiles each of them walks

    @property
    def use_dot(self) -> bool:
        return self.block_m > 1

    def check(self) -> None:
        if self.block_k < BLOCK or not is_power_of_2(self.block_k):
            raise ValueError(f"block_k={self.block_k}: a step takes whole 32-weight blocks, a power of 2 of them")
        if not is_power_of_2(self.block_n) or (self.use_dot and self.block_n < DOT_ROWS):
            raise ValueError(f"block_n={self.block_n}: a power of 2, at least 16 where tl.dot is used")
        if self.block_m not in (1, DOT_ROWS):
            raise ValueError(f"block_m={self.block_m}: 1 (no dot) or {DOT_ROWS} (tl.dot)")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_tiles(
    rows: int,
    blocks: BlockWeight,
    num_sms: int | None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
) -> BlockTiles:
    """Tiles for ``rows`` activation rows times ``blocks``; the arguments given override the defaults.

    ``block_k``: 128 quant bytes of a row per step (128 Q8_0 weights, 256 Q4_1), fewer when the row is
    shorter. ``block_n``: 32 output features, 16 when 32 leaves SMs idle. ``split_k``: enough splits
    for ``PROGRAMS_PER_SM`` programs per SM (at most ``MAX_SPLIT_K``); never in the interpreter
    (``num_sms`` None), where only an explicit ``split_k`` splits.
    """
    padded_k = blocks.blocks_per_row * BLOCK
    block_m = 1 if rows == 1 else DOT_ROWS
    row_tiles = cdiv(rows, block_m)
    if block_k is None:
        per_step = ROW_BYTES_PER_STEP * (2 if blocks.format == "q4_1" else 1)
        block_k = min(per_step, max(BLOCK, next_power_of_2(padded_k)))
    if block_n is None:
        few = num_sms is not None and cdiv(blocks.out_features, 32) * row_tiles < num_sms
        block_n = 16 if few else 32
    k_tiles = cdiv(blocks.in_features, block_k)
    if split_k is None:
        programs = cdiv(blocks.out_features, block_n) * row_tiles
        split_k = 1 if num_sms is None else min(MAX_SPLIT_K, cdiv(PROGRAMS_PER_SM * num_sms, programs))
    tiles_per_split = max(1, cdiv(k_tiles, max(1, min(split_k, k_tiles))))
    tiles = BlockTiles(block_m, block_n, block_k, max(1, cdiv(k_tiles, tiles_per_split)), tiles_per_split)
    tiles.check()
    return tiles


def block_matmul(
    x: torch.Tensor,
    blocks: BlockWeight,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``x [M, in_features] @ W.T`` for the block matrix ``W [out_features, in_features]``: ``[M, out]`` in x's dtype.

    ``x`` is fp32, fp16 or bf16 on the blocks' device, any row stride (the last dimension is made
    contiguous); meant for small ``M`` (decode rows: 1 to 16), though any ``M`` is correct.
    ``block_n``, ``block_k``, ``split_k`` and ``num_warps`` override the defaults (benchmarks, tests).
    """
    check_device(x)
    assert x.dim() == 2 and x.shape[1] == blocks.in_features, f"x {tuple(x.shape)} for {blocks.in_features} inputs"
    assert x.device == blocks.device, f"x on {x.device}, blocks on {blocks.device}"
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, out_features = x.shape[0], blocks.out_features
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    num_sms = _num_sms(x.device.index or 0) if x.is_cuda else None
    tiles = choose_tiles(rows, blocks, num_sms, block_n, block_k, split_k)
    partial = out
    if tiles.split_k > 1:
        partial = torch.empty(tiles.split_k, rows, out_features, dtype=torch.float32, device=x.device)
    _launch(out, partial, x, blocks, tiles, num_warps)
    if tiles.split_k > 1:
        numel = rows * out_features
        reduce_split_k_kernel[(cdiv(numel, REDUCE_BLOCK),)](out, partial, numel, tiles.split_k, BLOCK=REDUCE_BLOCK)
    return out


def _launch(out, partial, x, blocks: BlockWeight, tiles: BlockTiles, num_warps: int | None) -> None:
    grid = (cdiv(blocks.out_features, tiles.block_n), cdiv(x.shape[0], tiles.block_m), tiles.split_k)
    scales, quants = blocks.scales, blocks.quants
    assert quants.stride(-1) == 1 and scales.stride(-1) == 1, "the blocks' planes must be contiguous along a row"
    mins = blocks.mins if blocks.mins is not None else scales  # Q8_0 has none: never read
    assert mins.stride() == scales.stride(), "scales and mins must share one layout"
    block_matmul_kernel[grid](
        out,
        partial,
        x,
        quants,
        scales,
        mins,
        x.shape[0],
        blocks.out_features,
        blocks.in_features,
        quants.shape[1],
        tiles.tiles_per_split,
        x.stride(0),
        out.stride(0),
        quants.stride(0),
        scales.stride(0),
        Q4_1=blocks.format == "q4_1",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT=tiles.split_k > 1,
        USE_DOT=tiles.use_dot,
        **({} if num_warps is None else {"num_warps": num_warps}),
    )
