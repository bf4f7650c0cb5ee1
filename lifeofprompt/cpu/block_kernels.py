"""The compiled CPU product for block matrices (``block_kernels.c``), called through ctypes.

A decode step multiplies a few rows by every weight once, so its cost is reading the weights.
Kept as GGUF blocks (``block_formats.py``), a weight costs fewer bytes: Q4_1 reads 5 bits a
weight (16 bytes of nibbles, an fp16 scale and an fp16 minimum per 32) instead of fp32's 32,
Q8_0 8.5 bits. That saving is only worth having if the product reads the blocks themselves:
dequantizing a matrix to floats first writes and reads the 32 bits a weight again.

So the kernel unpacks each block in registers: the 16 bytes of a Q4_1 block become two vectors
of floats (a mask and a shift split the nibbles, a conversion makes them floats, one multiply-add
per vector applies ``d`` and ``m``), which are multiplied straight into the rows of x. Each
unpacked block serves a whole tile of rows of x (up to 8), as the fp32 kernel ``row_kernels.h``
tiles rows, so the unpacking is paid once per tile and the multiply-adds once per row.

Two other ways were measured on SmolLM2's shapes and dropped (``block_kernels.h`` says by how much):
the identity ``sum_i x_i (d q_i + m) = d * sum_i x_i q_i + m * sum_i x_i`` (x times the integers,
each block's sum scaled once) was no faster for one row and slower for more; llama.cpp's int8
activations on these planes were faster for one row only. The integer products that did pay, on
blocks re-laid for them, are ``interleaved_blocks.py``'s; this kernel is ``block_activations="float"``.

It is built by ``native_build.py`` (once per machine, into the cache folder) with the CPU's own
vector width; where no C compiler is found, ``blocks_kernel_available`` is False and the layers
dequantize a tile of rows at a time instead (``quantized_linear.py``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..model.block_formats import BlockWeight
from .native_build import c_function

SOURCE = Path(__file__).with_name("block_kernels.c")
FORMAT_CODES = {"q8_0": 2, "q4_1": 3}  # block_kernels.h's FORMAT_Q8_0, FORMAT_Q4_1


# The products' C signature (blocks_times_weight, and integer_blocks_times_weight in interleaved_blocks.py):
# x, m, n, format, quants, scales, mins, out, y, threads -> 0, or -1 where its scratch could not be allocated.
PRODUCT_ARGS = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long] + [ctypes.c_void_p] * 3
PRODUCT_ARGS += [ctypes.c_long, ctypes.c_void_p, ctypes.c_int]


@functools.cache
def blocks_kernel():
    """The compiled ``blocks_times_weight`` function, or None where it cannot be built here."""
    return c_function(SOURCE, "blocks_times_weight", PRODUCT_ARGS, ctypes.c_int)


def blocks_kernel_available() -> bool:
    """Whether the block kernel is built for this machine (built on the first call, then cached)."""
    return blocks_kernel() is not None


def blocks_linear(x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor:
    """``x @ W.T`` for ``x [M, in]`` on the CPU and a block matrix ``W``: fp32 ``[M, out]``.

    The kernel reads fp32 rows (another float dtype is converted first: the rows are few, the
    weights many). Runs on ``torch.get_num_threads()`` OpenMP threads; ctypes releases the GIL meanwhile.
    """
    kernel = blocks_kernel()
    if kernel is None:
        raise RuntimeError("the block kernel is not available on this machine (no C compiler, or its build failed)")
    if not x.is_floating_point() or x.dim() != 2 or x.shape[1] != blocks.in_features:
        raise ValueError(f"expected float x [M, {blocks.in_features}], got {x.dtype} {tuple(x.shape)}")
    planes = [t.contiguous() if t is not None else None for t in (blocks.quants, blocks.scales, blocks.mins)]
    out_features = blocks.quants.shape[0]  # a row of blocks per output
    failure = "the block kernel could not allocate its copy of x"
    return run_product(kernel, FORMAT_CODES[blocks.format], x, planes, out_features, failure)


def run_product(kernel, code: int, x: torch.Tensor, planes: list, out_features: int, failure: str) -> torch.Tensor:
    """One call of a compiled product (``PRODUCT_ARGS``): x as contiguous fp32 ``[M, in]`` times the matrix whose
    ``planes`` (quants, scales, mins or None) are stored as format ``code``, into a new fp32 ``[M, out]``, on
    ``torch.get_num_threads()`` OpenMP threads; ``MemoryError(failure)`` where its scratch could not be had."""
    x = x.to(torch.float32).contiguous()
    quants, scales, mins = planes
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    failed = kernel(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        code,
        quants.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr() if mins is not None else None,
        out_features,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(failure)
    return out


@functools.cache
def dequantize_kernel():
    """The compiled ``dequantize_rows`` function, or None where it cannot be built here."""
    args = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    return c_function(
        SOURCE, "dequantize_rows", args + [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int], ctypes.c_int
    )


def dequantize_rows(
    blocks: BlockWeight, first: int = 0, last: int | None = None, out: torch.Tensor | None = None, padded: bool = False
) -> torch.Tensor:
    """Rows ``first .. last - 1`` of a CPU block matrix as fp32 ``[rows, width]``, in one compiled pass.

    The floats are bit for bit ``blocks.dequantize(torch.float32, first, last)`` (``d * q``, or
    ``d * q`` then ``+ m``, each rounded: no fused multiply-add). ``width`` is ``in_features``, or
    with ``padded`` the row's whole blocks (``blocks_per_row * 32``: a ragged last block's padding
    included). ``out``: a contiguous fp32 tensor of at least ``rows * width`` elements to write into
    (a scratch buffer reused across tiles); the result is then a view of its front. Runs on
    ``torch.get_num_threads()`` OpenMP threads.
    """
    kernel = dequantize_kernel()
    if kernel is None:
        raise RuntimeError("the block kernel is not available on this machine (no C compiler, or its build failed)")
    last = blocks.out_features if last is None else last
    if not 0 <= first <= last <= blocks.out_features:
        raise ValueError(f"rows {first}..{last} are not within the matrix's {blocks.out_features}")
    if not blocks.quants.is_cpu:
        raise ValueError("dequantize_rows reads CPU tensors only")
    width = blocks.blocks_per_row * 32 if padded else blocks.in_features
    rows = last - first
    if out is None:
        out = torch.empty(rows, width, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < rows * width:
        raise ValueError(f"out must be a contiguous fp32 tensor of at least {rows * width} elements")
    planes = [t.contiguous() for t in blocks.tensors()]
    quants, scales = planes[0], planes[1]
    mins = planes[2] if blocks.mins is not None else None
    failed = kernel(
        FORMAT_CODES[blocks.format],
        quants.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr() if mins is not None else None,
        blocks.in_features,
        first,
        last,
        out.data_ptr(),
        width,
        torch.get_num_threads(),
    )
    if failed:
        raise ValueError(f"dequantize_rows refused format {blocks.format!r} or width {width}")
    return out.reshape(-1)[: rows * width].view(rows, width)
