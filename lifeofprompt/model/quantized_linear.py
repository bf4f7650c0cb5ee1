"""Layers whose weights stay as GGUF blocks (``block_formats.py``): a linear layer and a tied embedding.

A decode step's matrix products read each weight once, so keeping Q4_1 blocks (5 bits a weight)
instead of fp32 (32 bits) cuts the bytes a token costs about six-fold. The blocks are turned into
numbers only inside the product:

* a few rows on a CPU (decode, verify, a short prompt chunk): the compiled block kernel
  (``block_kernels.py``), which unpacks each block in registers and multiplies it into every row;
* a few rows on a GPU: the Triton kernel (``kernels/block_matmul.py``), which does the same per tile;
* many rows (a long prompt chunk), or where no kernel is built: a tile of output rows is
  dequantized at a time and multiplied by the ordinary float product (``DEQUANTIZE_ROWS`` rows, so
  the float copy of the whole matrix is never made);
* big steps on a CPU that multiplies floats much faster than it unpacks blocks (AMX): a bf16 or fp32
  copy of the matrix, where the engine made one (``cpu/big_step_weights.py``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .block_formats import BlockWeight, weight_tensors

DEQUANTIZE_ROWS = 4096  # output rows dequantized at a time on the fallback path
CPU_DEQUANTIZE_ROWS = 1024  # the same with the compiled dequantization (block_kernels.dequantize_rows)
KERNEL_MAX_ROWS = 16  # activation rows up to which the block kernels beat dequantize-and-multiply


class QuantizedLinear(nn.Module):
    """``x @ W.T`` (no bias) with ``W`` kept as blocks; the result has ``x``'s dtype."""

    def __init__(self, blocks: BlockWeight):
        super().__init__()
        self.format = blocks.format
        self.in_features, self.out_features = blocks.in_features, blocks.out_features
        self.register_buffer("quants", blocks.quants)
        self.register_buffer("scales", blocks.scales)
        self.register_buffer("mins", blocks.mins)
        self.interleaved = None  # the blocks re-laid for integer products on a CPU (cpu/interleaved_blocks.py)
        self.big_step_copy = None  # the weights as floats, for steps of big_step_rows rows or more (a CPU)
        self.big_step_rows = None

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` casts every floating-point buffer; the blocks' fp16 scales must stay fp16."""
        dtypes = {name: t.dtype for name, t in self._buffers.items() if t is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            self._buffers[name] = self._buffers[name].to(dtype)
        if self.quants.device.type != "cpu":
            self.interleaved = self.big_step_copy = None  # CPU copies: a GPU reads the planes
        return self

    @property
    def blocks(self) -> BlockWeight:
        return BlockWeight(self.format, self.quants, self.scales, self.mins, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.big_step_copy is not None and rows.shape[0] >= self.big_step_rows:
            copy = self.big_step_copy
            out = torch.mm(rows.to(copy.dtype), copy.t()).to(x.dtype)
        elif self.interleaved is not None and block_kernel(rows, self.blocks) is not None:
            from ..cpu.interleaved_blocks import integer_linear

            out = integer_linear(rows, self.interleaved).to(x.dtype)
        else:
            out = block_product(rows, self.blocks, x.dtype)
        return out.reshape(*shape[:-1], self.out_features)


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from blocks: only the rows of the asked ids are dequantized.

    A tied model (SmolLM2) shares the blocks with its ``QuantizedLinear`` LM head, as the GGUF does
    (one ``token_embd`` tensor for both).
    """

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.head = [head]  # a list, so the head's buffers are not registered (and counted) twice
        self.register_buffer("like", torch.empty(0, dtype=dtype), persistent=False)  # follows model.to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        flat = ids.reshape(-1)
        rows = head.blocks.permute_rows(flat).dequantize(self.like.dtype)
        return rows.reshape(*ids.shape, head.in_features)


def block_product(x: torch.Tensor, blocks: BlockWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [M, in] @ W.T`` for a block matrix ``W``: a block kernel for few rows, else tiles dequantized."""
    kernel = block_kernel(x, blocks)
    if kernel is not None:
        return kernel(x, blocks).to(out_dtype)
    return dequantized_product(x, blocks, out_dtype)


def block_kernel(x: torch.Tensor, blocks: BlockWeight):
    """The compiled or Triton kernel that takes this product, or None for the dequantizing fallback."""
    if torch.is_grad_enabled() or x.shape[0] > (cpu_kernel_rows() if x.is_cpu else KERNEL_MAX_ROWS):
        return None
    if x.is_cpu:
        from ..cpu.block_kernels import blocks_kernel_available, blocks_linear

        return blocks_linear if blocks_kernel_available() else None
    if x.is_cuda:
        from ..kernels.block_matmul import block_matmul

        return block_matmul
    return None


ROW_COUNTS_TIMED = (16, 64, 256, 1024)  # activation rows at which the CPU's two ways are timed


@functools.cache
def cpu_kernel_rows() -> int:
    """The most activation rows the CPU's block kernel takes: timed once per machine against dequantizing tiles into
    BLAS (``kernel_row_limit``), since which is faster for a prompt chunk depends on the CPU's vector units."""
    from ..cpu.block_kernels import blocks_kernel_available

    return kernel_row_limit() if blocks_kernel_available() else KERNEL_MAX_ROWS


def kernel_row_limit() -> int:
    """The largest of ``ROW_COUNTS_TIMED`` up to which the block kernel beat dequantize-then-multiply on a
    3072 x 576 Q4_1 matrix (SmolLM2's gate_up), never below ``KERNEL_MAX_ROWS``; cached per machine.
    (On the AVX-512 EPYC the kernel won at every count, 1,024 rows included, at one thread and two.)"""
    from ..cpu.block_kernels import SOURCE, blocks_linear
    from ..cpu.linear_calibration import cached_answer, machine_key
    from ..cpu.native_build import source_digest
    from .block_formats import quantize

    def measure():
        blocks = quantize(torch.randn(3072, 576, generator=torch.Generator().manual_seed(0)) * 0.02, "q4_1")
        limit, seconds = KERNEL_MAX_ROWS, {}
        products = {
            "kernel": lambda x: blocks_linear(x, blocks),
            "dequantize": lambda x: dequantized_product(x, blocks, x.dtype),
        }
        for rows in ROW_COUNTS_TIMED:
            x = torch.randn(rows, 576)
            times = {name: second_call_seconds(product, x) for name, product in products.items()}
            seconds[rows] = times
            if times["kernel"] > times["dequantize"]:
                break
            limit = rows
        return limit, f"the block kernel up to {limit} rows", dict(seconds=seconds)

    key = dict(machine_key(), version=1, what="block kernel vs dequantize-then-BLAS, by rows")
    key["source"] = source_digest(SOURCE)  # a changed kernel is timed again
    return int(cached_answer(key, measure)[0])


def second_call_seconds(product, x: torch.Tensor) -> float:
    """How long ``product(x)`` takes once its first call (kernel build, first-touch of memory) is behind it."""
    import time

    product(x)
    start = time.perf_counter()
    product(x)
    return time.perf_counter() - start


def dequantized_product(x: torch.Tensor, blocks: BlockWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """The product a tile of output rows at a time: each tile dequantized into ``x``'s dtype, then ``x @ tile.T``.

    On a CPU with the compiled kernel and fp32 ``x``, a tile of ``CPU_DEQUANTIZE_ROWS`` rows is
    dequantized in one pass (``block_kernels.dequantize_rows``) into one scratch buffer reused by every
    tile, and multiplied by BLAS straight into its columns of the result. Elsewhere (a GPU, another
    dtype, no C compiler) torch dequantizes ``DEQUANTIZE_ROWS`` rows at a time.
    """
    if x.is_cpu and blocks.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        from ..cpu.block_kernels import dequantize_kernel, dequantize_rows

        if dequantize_kernel() is not None:
            out = torch.empty(x.shape[0], blocks.out_features, dtype=torch.float32)
            tile_rows = min(CPU_DEQUANTIZE_ROWS, blocks.out_features)
            scratch = torch.empty(tile_rows * blocks.in_features, dtype=torch.float32)
            for first in range(0, blocks.out_features, tile_rows):
                last = min(first + tile_rows, blocks.out_features)
                tile = dequantize_rows(blocks, first, last, out=scratch)
                torch.mm(x, tile.t(), out=out[:, first:last])
            return out.to(out_dtype)
    out = torch.empty(x.shape[0], blocks.out_features, dtype=out_dtype, device=x.device)
    for first in range(0, blocks.out_features, DEQUANTIZE_ROWS):
        last = min(first + DEQUANTIZE_ROWS, blocks.out_features)
        tile = blocks.dequantize(x.dtype, first, last)
        out[:, first:last] = (x @ tile.t()).to(out_dtype)
    return out


# ----------------------------------------------------------------------------- swapping layers in


LAYER_MATRICES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@torch.no_grad()
def use_blocks(model: nn.Module, layer_blocks: list[dict[str, BlockWeight]], head: BlockWeight) -> None:
    """Replace every layer's four matrices and the LM head (and a tied embedding) by block layers.

    ``layer_blocks[i]`` maps ``LAYER_MATRICES`` names to layer ``i``'s blocks. The activations keep
    the dtype of the model's norms (fp32 on a CPU, bf16 or fp16 on a GPU).
    """
    dtype = model.norm.weight.dtype
    for layer, blocks in zip(model.layers, layer_blocks, strict=True):
        for name in LAYER_MATRICES:
            parent, attr = name.split(".")
            setattr(getattr(layer, parent), attr, QuantizedLinear(blocks[name].to(model.norm.weight.device)))
    model.lm_head = QuantizedLinear(head.to(model.norm.weight.device))
    if model.config.tie_word_embeddings:
        model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)


def quantize_model(model: nn.Module, fmt: str) -> nn.Module:
    """Quantize a float model's matrices at load, per block of 32, in GGUF's ``fmt`` layout (in place).

    The four matrices of every layer and the LM head become blocks; a tied embedding shares the
    head's blocks; an untied embedding stays in floats (a step reads only its few rows).
    """
    from .block_formats import quantize

    layers = [
        {name: quantize(layer.get_submodule(name).weight, fmt) for name in LAYER_MATRICES} for layer in model.layers
    ]
    use_blocks(model, layers, quantize(model.lm_head.weight, fmt))
    model.quantization = fmt
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all the model's weights: its float parameters and its block matrices (``weight_tensors``)."""
    return sum(t.numel() * t.element_size() for t in weight_tensors(model))


def describe_weights(model: nn.Module) -> str:
    """``"Q4_1 x 210, Q8_0 x 1 (embedding and LM head), float32 x 61"``: how the model holds its weights."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            counts[module.format.upper()] = counts.get(module.format.upper(), 0) + 1
    floats = sum(1 for _ in model.parameters())
    parts = [f"{kind} matrices x {n}" for kind, n in sorted(counts.items())]
    return ", ".join(parts + [f"{str(model.dtype).removeprefix('torch.')} tensors x {floats}"])
