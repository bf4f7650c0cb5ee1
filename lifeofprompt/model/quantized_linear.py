"""Layers whose weights stay as GGUF blocks (``block_formats.py``): a linear layer and a tied embedding.

A decode step's matrix products read each weight once, so keeping Q4_1 blocks (5 bits a weight)
instead of fp32 (32 bits) cuts the bytes a token costs about six-fold. The blocks are turned into
numbers only inside the product:

* a few rows on a CPU (decode, verify, a short prompt chunk): the compiled block kernel
  (``cpu_blocks.py``), which unpacks each block in registers and multiplies it into every row;
* a few rows on a GPU: the Triton kernel (``kernels/block_matmul.py``), which does the same per tile;
* many rows (a long prompt chunk), or where no kernel is built: a tile of output rows is
  dequantized at a time and multiplied by the ordinary float product (``DEQUANTIZE_ROWS`` rows, so
  the float copy of the whole matrix is never made).
"""

from __future__ import annotations

import torch
from torch import nn

from .block_formats import BlockWeight

DEQUANTIZE_ROWS = 4096  # output rows dequantized at a time on the fallback path
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

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` casts every floating-point buffer; the blocks' fp16 scales must stay fp16."""
        dtypes = {name: t.dtype for name, t in self._buffers.items() if t is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            self._buffers[name] = self._buffers[name].to(dtype)
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
    if x.shape[0] > KERNEL_MAX_ROWS or torch.is_grad_enabled():
        return None
    if x.is_cpu:
        from .cpu_blocks import blocks_kernel_available, blocks_linear

        return blocks_linear if blocks_kernel_available() else None
    if x.is_cuda:
        from ..kernels.block_matmul import block_matmul

        return block_matmul
    return None


def dequantized_product(x: torch.Tensor, blocks: BlockWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """The product a tile of output rows at a time: each tile dequantized into ``x``'s dtype, then ``x @ tile.T``."""
    out = torch.empty(x.shape[0], blocks.out_features, dtype=out_dtype, device=x.device)
    for first in range(0, blocks.out_features, DEQUANTIZE_ROWS):
        last = min(first + DEQUANTIZE_ROWS, blocks.out_features)
        tile = blocks.dequantize(x.dtype, first, last)
        out[:, first:last] = (x @ tile.t()).to(out_dtype)
    return out


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of every block matrix in ``model`` (a tied embedding counted once, with its head)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))


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
    """Bytes of all the model's weights: its float parameters and its block matrices."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + quantized_weight_bytes(model)


def describe_weights(model: nn.Module) -> str:
    """``"Q4_1 x 210, Q8_0 x 1 (embedding and LM head), float32 x 61"``: how the model holds its weights."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            counts[module.format.upper()] = counts.get(module.format.upper(), 0) + 1
    floats = sum(1 for _ in model.parameters())
    parts = [f"{kind} matrices x {n}" for kind, n in sorted(counts.items())]
    return ", ".join(parts + [f"{str(model.dtype).removeprefix('torch.')} tensors x {floats}"])
