"""The torch product the block-matrix kernel (``kernels/block_matmul.py``) is compared with.

Its tests (``test_block_matmul.py``, ``gpu/test_block_matmul_gpu.py``) use it; the engine multiplies by
the blocks through the kernel or ``model/quantized_linear.py``, never through this.
"""

from __future__ import annotations

import torch

from lifeofprompt.model.block_formats import BlockWeight, dequantize


def reference(x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor:
    """The torch product to compare with: the blocks dequantized to ``x``'s dtype, then ``x @ w.T``."""
    return x @ dequantize(blocks, x.dtype).t()
