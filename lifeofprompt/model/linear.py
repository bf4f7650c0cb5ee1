"""The model's matrix products: ``nn.Linear`` with two CPU paths that read weights faster.

A decode step multiplies a handful of rows ``x [M, in]`` by every weight ``W [out, in]``: the
work is tiny and the cost is reading ``W``. On the CPU, ``x @ W.T`` (what ``nn.Linear`` and
transformers run) goes to a BLAS routine tuned for big matrices. Measured on this project's
2-core AVX-512 machine at one thread, over SmolLM2's 120 layer matrices (425 MB of fp32), it
reads weights at 11.5 GB/s for ``M = 1`` and 6-9 GB/s for ``M = 2``-``8``, while a plain
``tensor.sum()`` reads memory at ~27 GB/s. Two other routes give the same numbers up to
floating-point summation order (``benchmarks/cpu_linear.py`` measures all three; the table is
in ``benchmarks/NOTES.md``):

* **one or two rows**: ask for the transpose, ``(W @ x.T).T``. BLAS then walks ``W`` row by
  row against a skinny ``x.T`` at ~17 GB/s. A single row is doubled: the two-column kernel is
  the fast one, and two dot products per weight row cost no more memory traffic than one.
* **three rows or more**: oneDNN (the CPU kernel library inside torch) reorders each weight
  *once* into the blocked layout its kernels read fastest; products of 3 to 256 rows then
  take 0.4-0.85× the time of ``x @ W.T``. The engine's model runner prepacks on the CPU
  (``prepack_cpu_weights``); the packed copy takes as much memory again as the weights and
  must be rebuilt if they change.

GPUs (cuBLAS chooses well), training (no autograd through the packed product) and torch
builds without oneDNN use ``nn.Linear`` unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

FEW_ROWS = 2     # up to this many rows take the (W @ x.T).T path on the CPU


def onednn_available() -> bool:
    """Whether this torch build can prepack linear weights (x86 and ARM CPU builds can)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a few rows ``x [M, in]``, computed as ``(weight @ x.T).T``."""
    rows = x.shape[0]
    if rows == 1:
        x = x.expand(2, -1).contiguous()
    return (weight @ x.t())[:, :rows].t().contiguous()


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) with the CPU paths above; ``prepack()`` turns the oneDNN one on."""

    packed: torch.Tensor | None = None

    def prepack(self) -> int:
        """Reorder the weight for oneDNN (CPU, fp32, no bias); returns the bytes of the packed copy (0 if none).

        Only fp32 is packed: that is what was measured, and oneDNN's bf16 kernels need CPU
        instructions (AVX-512 BF16, AMX) that not every machine has.
        """
        if (self.bias is not None or not self.weight.is_cpu or self.weight.dtype != torch.float32
                or not onednn_available()):
            self.packed = None
            return 0
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dim() == 2 and self.bias is None:
            if x.shape[0] <= FEW_ROWS:
                return few_rows_linear(x, self.weight)
            if self.packed is not None and not torch.is_grad_enabled():
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return super().forward(x)


def prepack_cpu_weights(model: nn.Module, enabled: bool = True) -> int:
    """Prepack every ``Linear`` of a CPU model; returns the extra bytes the packed copies take.

    ``enabled=False`` drops packed copies instead (to save their memory), returning 0.
    """
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    if not enabled:
        for module in linears:
            module.packed = None
        return 0
    return sum(module.prepack() for module in linears)
