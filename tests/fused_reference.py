"""The torch references of the fused kernels (``fused.py``), built from the model's own modules.

The tests (``test_fused_kernels.py``, ``gpu/test_fused_kernels_gpu.py``) compare every fused kernel
with these: the model's own modules are the reference, so the package itself needs no second copy.
"""

from __future__ import annotations

import torch

from lifeofprompt.model.layers import RMSNorm, RotaryEmbedding


def _rms_norm_module(weight: torch.Tensor, eps: float):
    norm = RMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@torch.no_grad()
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's own ``RMSNorm`` module with this weight, in its torch form (on a GPU the module itself
    would call the fused kernel under test)."""
    return _rms_norm_module(weight, eps).normalise(x)


@torch.no_grad()
def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: ``(RMSNorm(residual + x), residual + x)``, as the decoder layer computes them."""
    summed = residual + x
    return rms_norm_reference(summed, weight, eps), summed


def rotary_qk_reference(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Out of place: ``RotaryEmbedding.rotate`` from the model."""
    return RotaryEmbedding.rotate(qk, (cos, sin))


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP``'s activation: ``silu(gate) * up`` in the activations' dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
