"""The decoder's small ops: RMSNorm (with the residual add), rotary embeddings, SiLU × up.

Each is written once in plain torch, the reference every faster form is held to. On a GPU each op
calls its fused Triton kernel itself (``kernels/fused.py``: one launch where torch's eager ops take
a dozen), so the model's loop (``llama.py``) is written once and never asks which way to run.
``fused_kernels("on" | "off")`` overrides that choice for a block of code: the CPU tests run the
kernels in Triton's interpreter with ``"on"``, and the GPU benchmark times the same step with
``"off"``.

``RMSNorm(x, residual)`` carries the residual stream as nano-vllm's decoder does: it adds ``x``
to the residual and normalises the sum in one op, so a layer's last residual add happens in the
next layer's first norm (the last layer's in the final norm).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
from torch import nn

_fused_mode = "auto"  # "auto": fused kernels on CUDA tensors where Triton is installed


@contextlib.contextmanager
def fused_kernels(mode: str):
    """Run the ops' fused Triton kernels ``"on"`` every device (the CPU through Triton's interpreter),
    ``"off"``, or ``"auto"`` (on a GPU), for the code inside the block."""
    global _fused_mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"fused_kernels takes 'auto', 'on' or 'off', not {mode!r}")
    before, _fused_mode = _fused_mode, mode
    try:
        yield
    finally:
        _fused_mode = before


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_fused(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs its fused Triton kernel."""
    if _fused_mode != "auto":
        return _fused_mode == "on"
    return x.is_cuda and triton_installed()


def fused():
    """``kernels/fused.py``, imported when an op first runs fused (the CPU's torch path never needs Triton)."""
    from ..kernels import fused as module

    return module


class RMSNorm(nn.Module):
    """Scale each row to unit root-mean-square, then by a learned weight (computed in fp32).

    ``norm(x)`` returns the normalised rows; ``norm(x, residual)`` first adds ``x`` to the residual
    stream and returns ``(normalised sum, sum)``. The fused kernel adds in place.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_fused(x):
            if residual is None:
                return fused().rms_norm(x, self.weight, self.eps)
            return fused().add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self.normalise(x)
        residual = residual + x
        return self.normalise(residual), residual

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The torch form, the reference the fused kernel matches."""
        if x.dtype == torch.float32 and hasattr(nn.functional, "rms_norm"):
            # One fused call, the same numbers as the spelled-out form below (torch >= 2.4).
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SiluAndMul(nn.Module):
    """SwiGLU's activation on the fused gate/up output ``[T, 2 * I]`` (gate first): ``silu(gate) * up``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if use_fused(gate_up):
            return fused().silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotate query/key pairs by an angle proportional to the token's position (RoPE, half-split layout).

    The cos/sin table is computed once for every position; a forward looks up its rows once
    (``at``) and every layer rotates its queries and keys together with them (``rotate_qk``).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [max_positions, head_dim / 2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _apply(self, fn, recurse=True):
        """``model.to(device)`` moves the table; ``model.to(torch.bfloat16)`` does not round it: the
        angles stay fp32 in every dtype (``rotate``, the fused Triton kernel and the C step all compute
        in fp32), so every loader, every shard of a split model and every rank hold the same table."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` rows of these positions, shaped ``[T, 1, head_dim / 2]`` to broadcast over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x``: ``[T, heads, head_dim]``; returns it rotated, same dtype (the torch form, the reference)."""
        cos, sin = cos_sin
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.to(x.dtype)

    @staticmethod
    def rotate_qk(qk: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``rotate`` as the layers call it: the fused kernel rotates the fused qkv output in place."""
        if use_fused(qk):
            return fused().rotary_qk(qk, *cos_sin)
        return RotaryEmbedding.rotate(qk, cos_sin)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` by its rows' ``positions``."""
        return self.rotate(x, self.at(positions))
