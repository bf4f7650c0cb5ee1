"""The model's matrix products: ``nn.Linear`` with a CPU path for decode-sized batches.

A decode step multiplies a handful of rows ``x [M, in]`` by every weight ``W [out, in]``.
The work is tiny; the cost is reading ``W`` from memory once. On the CPU, the obvious
``x @ W.T`` (what ``nn.Linear`` and transformers do) hands that to a BLAS routine tuned for
big matrices: measured on this project's 2-core AVX-512 machine at one thread, it streams
fp32 weights at ~11 GB/s for ``M = 1`` and ~5 GB/s for ``M = 2``-``3``, while a plain
``tensor.sum()`` reads memory at ~24 GB/s. Asking for the same numbers the other way round,
``(W @ x.T).T``, reaches ~17 GB/s for ``M = 2``-``4`` (``benchmarks/cpu_linear.py`` re-measures
it on your machine; ``benchmarks/NOTES.md`` has the table). So for ``M ≤ 4`` rows on the CPU
this module computes ``W @ x.T`` instead, padding a single row to two (two dot products per
weight row cost no more memory traffic than one, and the two-column kernel is the fast one).

Same weights, same parameter names, same results up to floating-point summation order;
GPUs (cuBLAS picks well) and large batches (compute-bound either way) keep ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

SMALL_BATCH_ROWS = 4     # up to this many rows take the W @ x.T path on the CPU


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M ≤ SMALL_BATCH_ROWS, in]``, computed as ``(weight @ x.T).T``."""
    rows = x.shape[0]
    if rows == 1:
        x = x.expand(2, -1).contiguous()            # one row costs as much as two; two is the fast kernel
    out = weight @ x.t()                            # [out, max(M, 2)]
    return out[:, :rows].t().contiguous()


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) that takes the small-batch path for few rows of a CPU matrix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS and x.is_cpu and self.bias is None:
            return small_batch_linear(x, self.weight)
        return super().forward(x)
