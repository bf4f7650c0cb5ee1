"""How the KV pool stores keys and values (``kv_cache_dtype``, vLLM's name): in fewer bytes than the activations.

A decode step at a long context reads the whole sequence's keys and values from the pool, every layer:
at 4,096 tokens SmolLM2's fp32 cache is 180 MiB a step, twice its GGUF weights. Stored in fewer bytes,
the step reads fewer (chapter 06's lesson, applied to the cache). Each form is written when the rows
enter the pool and read back where attention uses them; nothing keeps a float copy of the pool.

* ``"auto"``: the activations' dtype (fp32 on a CPU, bf16 on a GPU);
* ``"bfloat16"`` / ``"float16"``: 2 bytes a value, rounded on the way in;
* ``"q8_0"``: llama.cpp's blocks of 32 values along a head's dimension, each one fp16 scale
  (its largest magnitude over 127) and 32 int8 numbers: 34 bytes for 32 values, 8.5 bits a value;
* ``"fp8"``: e4m3 (1 byte: 3 bits of mantissa, values up to 448) with one scale per layer for keys and
  one for values, calibrated at start-up on the shipped text (``engine/model_runner.py: fp8_scales``), so
  that each layer's largest magnitude there lands near 448 (vLLM's default scale is 1.0).

A layer's keys (or values) are a plain tensor ``[num_blocks, block_size, kv_heads, head_dim]`` for the
float forms, and a ``BlockPool`` (the codes and their scales, the same indexing) for ``q8_0`` and ``fp8``:
``write`` quantizes rows into their slots, ``index_select`` gathers whole blocks and dequantizes them.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "q8_0", "fp8")
FLOAT_FORMS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
Q8_BLOCK = 32  # values per q8_0 scale, along the head dimension
FP8_MAX = 448.0  # e4m3's largest finite value


def value_bytes(kv_dtype: str) -> float:
    """Bytes one key or value takes in the pool in a form other than "auto" (whose bytes are the activations'
    dtype's, ``engine/memory.py: dtype_bytes``): 34/32 for q8_0."""
    return {"bfloat16": 2, "float16": 2, "q8_0": (Q8_BLOCK + 2) / Q8_BLOCK, "fp8": 1}[kv_dtype]


def check_kv_dtype(kv_dtype: str, head_dim: int, device_type: str, backend: str) -> None:
    """A ``ConfigError`` naming the form and the ones this device and attention backend serve, if it cannot."""
    served = {"triton": ("auto",)}.get(backend, KV_CACHE_DTYPES)  # the Triton kernels read the activations' dtype
    if kv_dtype not in served:
        raise ConfigError(
            f"kv_cache_dtype={kv_dtype!r} is not served by the {backend} attention backend on {device_type}: "
            f"use one of {', '.join(served)}",
            param="kv_cache_dtype",
        )
    if kv_dtype == "q8_0" and head_dim % Q8_BLOCK:
        raise ConfigError(
            f"kv_cache_dtype='q8_0' needs a head dimension that is a multiple of {Q8_BLOCK} (this model's: "
            f"{head_dim}); use 'bfloat16' or 'fp8'",
            param="kv_cache_dtype",
        )


class BlockPool:
    """One layer's keys or values as codes and scales: ``codes [num_blocks, block_size, kv_heads, head_dim]``
    (int8 for q8_0, float8_e4m3fn for fp8) and ``scales`` (q8_0: fp16 ``[..., head_dim / 32]``; fp8: a
    0-d float32 tensor). It answers the few calls attention makes of a pool tensor."""

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor):
        self.kind, self.codes, self.scales = kind, codes, scales

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what it reads back as

    def write(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize ``rows [T, kv_heads, head_dim]`` into the token slots ``slots [T]``."""
        codes, scales = quantize(self.kind, rows.float(), self.scales)
        as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731 (no fp8 copy on CPU)
        as_bytes(self.codes).view(-1, *self.codes.shape[2:]).index_copy_(0, slots, as_bytes(codes))
        if self.kind == "q8_0":
            self.scales.view(-1, *self.scales.shape[2:]).index_copy_(0, slots, scales)

    def index_select(self, dim: int, blocks: torch.Tensor) -> torch.Tensor:
        """Whole blocks, dequantized to fp32: ``[len(blocks), block_size, kv_heads, head_dim]``."""
        codes = self.codes.index_select(dim, blocks)
        scales = self.scales.index_select(dim, blocks) if self.kind == "q8_0" else self.scales
        return dequantize(self.kind, codes, scales)


def quantize(kind: str, rows: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rows [..., head_dim]`` as codes, with q8_0's new scales (fp8's ``scale`` is the layer's, given)."""
    if kind == "fp8":
        return (rows / scale.clamp_min(1e-30)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None
    blocks = rows.reshape(*rows.shape[:-1], -1, Q8_BLOCK)
    scales = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    steps = scales.float()
    codes = torch.where(steps > 0, torch.round(blocks / steps.clamp_min(1e-30)), 0.0).clamp(-127, 127)
    return codes.to(torch.int8).reshape(rows.shape), scales.squeeze(-1)


def dequantize(kind: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``codes``: fp8 times its layer's scale, q8_0 times each block's."""
    if kind == "fp8":
        return codes.float() * scales
    blocks = codes.float().reshape(*codes.shape[:-1], -1, Q8_BLOCK) * scales.float().unsqueeze(-1)
    return blocks.reshape(codes.shape)
