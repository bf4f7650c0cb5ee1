"""Fused element-wise kernels for the decode step: residual add + RMSNorm, rotary, SiLU × up.

At batch 1 a decode step reads every weight once and does little else, so the small
element-wise ops between the matrix products start to matter. Written as torch ops,
RMSNorm is a cast, a square, a mean, an add, an rsqrt, two multiplies and two more casts;
rotary is a cast, a chunk, six multiplies/adds, a concat and a cast. On an H200 the
TinyLlama step spent 1.17 ms of 2.7 ms in about 55 such kernels per layer, each reading and
writing the whole activation. Each kernel here reads its inputs once and writes its output
once, so a layer needs five launches (two norms, one rotary, one SiLU × up, and the final
norm folded into the next layer's first):

    normed, residual = rms_norm(hidden, w_in), hidden          # first layer only
    attn_out = attention(rotary_qk(qkv_view, cos, sin), ...)
    normed, residual = add_rms_norm(attn_out, residual, w_post)
    mlp_out = down(silu_mul(gate_up(normed)))
    normed, residual = add_rms_norm(mlp_out, residual, w_next)  # next layer's input norm, or the final norm

Every kernel rounds exactly where the torch code in ``lifeofprompt.model.layers`` rounds (math in
fp32, a cast to the activation dtype at the same points), so in fp32 the results agree to
the last bits and in bf16 they differ by at most a rounding step now and then. Each has a
torch reference (``*_reference`` in ``tests/fused_reference.py``, apart so that this file needs
nothing from the model that imports it), built from the model's own code where there is any.
All of them read no tensor values on the host, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import check_device
from .tiles import cdiv, next_power_of_2

SILU_BLOCK = 1024  # columns of gate/up per program: a TinyLlama row (5632) is 6 programs


# ----------------------------------------------------------------------------- RMSNorm (+ residual add)


@triton.jit
def rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_out,
    stride_x,
    stride_residual,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """One program per row: (optionally) ``residual += x``, then RMSNorm of the sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # torch's `hidden + out` in bf16 adds in fp32 and rounds: the norm sees the rounded sum.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / HIDDEN  # padding columns loaded as 0
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask)
    out = weight.to(tl.float32) * normed.to(tl.float32)  # HF order: cast first, then scale
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t`` as ``[rows, hidden]`` without a copy (a copy would lose an in-place residual update)."""
    assert t.shape[-1] == hidden, f"last dimension {t.shape[-1]} is not the weight's {hidden}"
    assert t.stride(-1) == 1, "the hidden dimension must be contiguous"
    return t if t.dim() == 2 else t.view(-1, hidden)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_device(x)
    hidden = weight.shape[0]
    assert weight.dim() == 1 and weight.is_contiguous(), "weight must be a contiguous [hidden] vector"
    assert weight.dtype == x.dtype, f"weight {weight.dtype} and activations {x.dtype} differ"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype"
    rows = _rows(x, hidden)
    res_rows = rows if residual is None else _rows(residual, hidden)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](
            out,
            rows,
            res_rows,
            weight,
            out.stride(0),
            rows.stride(0),
            res_rows.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=next_power_of_2(hidden),
            ADD_RESIDUAL=residual is not None,
            num_warps=4 if hidden <= 2048 else 8,
        )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` into a new contiguous tensor of ``x``'s shape and dtype.

    Same numbers as ``lifeofprompt.model.llama.RMSNorm``: ``weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)``.
    ``x`` may have any row stride; its last dimension must be contiguous.
    """
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` **in place**, then RMSNorm of the new residual: returns ``(normed, residual)``.

    The decoder's ``hidden = hidden + sublayer(norm(hidden))`` followed by the next norm, in one
    launch. ``residual`` is the same tensor object that was passed in, now holding the sum
    (rounded to its dtype, as torch's add rounds it); ``normed`` is a new contiguous tensor.
    ``x`` is only read. Both may have any row stride; the last dimension must be contiguous.
    """
    return _launch_rms_norm(x, residual, weight, eps), residual


# ----------------------------------------------------------------------------- rotary embedding


@triton.jit
def rotary_kernel(
    qk_ptr,
    cos_ptr,
    sin_ptr,
    stride_row,
    stride_head,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    """One program per token: every head of its row rotated by the row's angles, in place."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HALF_PADDED)
    cos = tl.load(cos_ptr + row * stride_cos + dims, mask=dims < HALF)[None, :]  # shared by all heads
    sin = tl.load(sin_ptr + row * stride_sin + dims, mask=dims < HALF)[None, :]
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    first_ptrs = qk_ptr + row * stride_row + heads[:, None] * stride_head + dims[None, :]
    first = tl.load(first_ptrs, mask=mask).to(tl.float32)  # x[..., :half]
    second = tl.load(first_ptrs + HALF, mask=mask).to(tl.float32)  # x[..., half:]
    tl.store(first_ptrs, (first * cos - second * sin).to(qk_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptrs + HALF, (second * cos + first * sin).to(qk_ptr.dtype.element_ty), mask=mask)


def _angle_rows(t: torch.Tensor, num_rows: int, half: int) -> torch.Tensor:
    if t.dim() == 3:  # [T, 1, half] (RotaryEmbedding.at) -> [T, half], a view
        assert t.shape[1] == 1, f"cos/sin rows {tuple(t.shape)} should broadcast over heads as [T, 1, half]"
        t = t[:, 0]
    assert t.shape == (num_rows, half), f"cos/sin rows {tuple(t.shape)}, expected ({num_rows}, {half})"
    assert t.dtype == torch.float32, "cos/sin must be fp32 (RotaryEmbedding's table)"
    return t if t.stride(-1) == 1 else t.contiguous()


def rotary_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``qk [T, heads, head_dim]`` **in place** by ``cos``/``sin`` rows; returns ``qk`` itself.

    Same numbers as ``RotaryEmbedding.rotate(qk, (cos, sin))`` (half-split layout, fp32 math,
    one cast back). ``qk`` is typically the query and key heads of the fused qkv projection,
    ``qkv[:, :q_size + kv_size].view(T, heads_q + heads_kv, head_dim)``: any row and head
    stride, contiguous ``head_dim``. ``cos``/``sin`` are fp32 ``[T, 1, head_dim/2]`` (what
    ``RotaryEmbedding.at`` returns) or ``[T, head_dim/2]``.
    """
    check_device(qk)
    num_rows, num_heads, head_dim = qk.shape
    assert head_dim % 2 == 0 and qk.stride(-1) == 1, "head_dim must be even and contiguous"
    half = head_dim // 2
    cos, sin = _angle_rows(cos, num_rows, half), _angle_rows(sin, num_rows, half)
    if num_rows:
        rotary_kernel[(num_rows,)](
            qk,
            cos,
            sin,
            qk.stride(0),
            qk.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_HEADS=num_heads,
            HALF=half,
            HEADS_PADDED=next_power_of_2(num_heads),
            HALF_PADDED=next_power_of_2(half),
        )
    return qk


# ----------------------------------------------------------------------------- SiLU × up


@triton.jit
def silu_mul_kernel(
    out_ptr,
    gate_up_ptr,
    stride_out,
    stride_in,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, j): columns ``j*BLOCK ..`` of ``silu(gate) * up`` for one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + cols, mask=mask).to(tl.float32)
    # torch's `silu(gate) * up` in bf16 rounds twice: silu's result, then the product. So do we.
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2*I]`` (gate first): a new contiguous ``[T, I]``, same dtype.

    Out of place (the output is half the input). ``gate_up`` may have any row stride; its
    last dimension must be contiguous.
    """
    check_device(gate_up)
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"expected [T, 2*I], got {tuple(gate_up.shape)}"
    assert gate_up.stride(-1) == 1, "the last dimension must be contiguous"
    num_rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, next_power_of_2(intermediate))
    if num_rows:
        silu_mul_kernel[(num_rows, cdiv(intermediate, block))](
            out,
            gate_up,
            out.stride(0),
            gate_up.stride(0),
            INTERMEDIATE=intermediate,
            BLOCK=block,
        )
    return out
