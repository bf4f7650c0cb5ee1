"""What the KV cache costs, and how the GPU's memory is shared out (chapter 05; the engine sizes its pool here).

Every token a sequence has seen leaves one key and one value vector per KV head in every layer:

    bytes per token = 2 × layers × kv_heads × head_dim × bytes per element

The engine hands the cache out in *blocks* of ``block_size`` tokens. Before it takes any request
it splits the device's memory like land among tenants (``plan_memory``): the fraction it may use
(``gpu_memory_utilization``), minus the weights, minus the activation workspace of the largest
forward, leaves the KV pool; the pool divided by the bytes of one block is the number of "GPU
blocks" vLLM logs at start-up. The chapter's other arithmetic (a 13B model's cache, the host
swap pool vLLM also logs, the workspace measured on a GPU) is in ``lessons/memory_arithmetic.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError, OutOfMemoryError
from ..model.config import ModelConfig
from ..units import GiB, KiB, MiB, format_bytes  # noqa: F401 (the chapters read them here, beside the arithmetic)
from .config import DEFAULT_STEP_TOKENS, EngineConfig

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or a name such as ``"bf16"``, ``"bfloat16"``, ``"float32"``."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        dtype = _DTYPE_NAMES.get(name) or getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"unknown dtype {dtype!r}: give a torch dtype or a name like 'bf16', 'float32'", param="dtype"
        )
    return dtype.itemsize


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}", param="block_size")
    return block_size


# ----------------------------------------------------------------------------- per token, per block


def kv_bytes_per_token(config: ModelConfig, dtype, kv_dtype: str = "auto") -> int:
    """Key + value bytes one token leaves in every layer: ``2 × layers × kv_heads × head_dim × bytes``, the
    bytes a value those of ``kv_dtype`` (``model/kv_cache_formats.py``; "auto": ``dtype``'s, 34/32 for q8_0)."""
    from ..model.kv_cache_formats import value_bytes

    values = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    if kv_dtype == "auto":
        return values * dtype_bytes(dtype)
    return round(values * value_bytes(kv_dtype))


def kv_bytes_per_block(
    config: ModelConfig, dtype, block_size: int = EngineConfig.block_size, kv_dtype: str = "auto"
) -> int:
    """Bytes of one cache block: ``block_size`` tokens across all layers."""
    return kv_bytes_per_token(config, dtype, kv_dtype) * _check_block_size(block_size)


def blocks_for_tokens(num_tokens: int, block_size: int = EngineConfig.block_size) -> int:
    """Blocks a sequence of ``num_tokens`` tokens holds: its last block may be partly empty."""
    return math.ceil(num_tokens / _check_block_size(block_size))


# ----------------------------------------------------------------------------- the other tenants


def weight_bytes(config: ModelConfig, dtype) -> int:
    """Bytes of all parameters stored in ``dtype`` (tied embeddings counted once)."""
    return config.num_parameters() * dtype_bytes(dtype)


def estimate_activation_bytes(
    config: ModelConfig, dtype, num_tokens: int = DEFAULT_STEP_TOKENS, logits_rows: int = 256, score_copies: int = 0
) -> int:
    """A rough peak of the transient tensors of one forward over ``num_tokens`` rows (an *estimate*).

    Per row, the tensors alive inside one layer: the residual stream, its normed copy and the
    attention output (``3·hidden``), fused q/k/v, the context (``heads·head_dim``), gate/up and
    their product (``3·intermediate``); plus fp32 logits for ``logits_rows`` sampled rows.
    ``num_tokens`` plays vLLM's ``max_num_batched_tokens``, the largest step it profiles.

    A fused attention kernel never stores the ``heads × T × T`` scores (``score_copies=0``). An
    attention written as plain matrix products holds about three fp32 copies (scores, masked,
    softmax): on an H200, TinyLlama bf16 over 2,048 tokens measured 1.70 GB with our first torch
    path (written that way; it now calls torch's fused ``scaled_dot_product_attention``), against
    0.15 GB without and 1.76 GB with ``score_copies=3``. Measure on the real device when you can
    (``lessons/memory_arithmetic.py: measure_activation_bytes``; the engine's runner measures its own
    largest step); a CUDA context and CUDA graphs come on top.
    """
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_row = 3 * config.hidden_size + q_size + 2 * kv_size + q_size + 3 * config.intermediate_size
    scores = score_copies * config.num_heads * num_tokens * num_tokens * 4
    return num_tokens * per_row * dtype_bytes(dtype) + logits_rows * config.vocab_size * 4 + scores


# ----------------------------------------------------------------------------- the land


@dataclass(frozen=True)
class MemoryPlan:
    """How one device's memory is shared: ``total`` = unusable + weights + activations + KV pool."""

    total: int  # bytes the device reports
    usable: int  # total × gpu_memory_utilization
    weights: int
    activations: int
    activations_measured: bool  # True: measured on the device; False: estimated from the shapes
    kv_pool: int  # usable − weights − activations
    bytes_per_block: int
    num_gpu_blocks: int  # whole blocks in the KV pool ("GPU blocks" in vLLM's log)
    block_size: int = EngineConfig.block_size
    bytes_per_token: int = 0


def plan_memory(
    config: ModelConfig,
    dtype,
    total_memory: int,
    gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization,
    block_size: int = EngineConfig.block_size,
    weights: int | None = None,
    activations: int | None = None,
    activations_measured: bool = False,
    kv_dtype: str = "auto",
) -> MemoryPlan:
    """Share ``total_memory`` bytes out as vLLM does at start-up and count the KV blocks.

    ``weights`` defaults to the parameters in ``dtype``; ``activations`` to
    ``estimate_activation_bytes`` (then ``activations_measured`` must stay False). Pass
    ``weights=0, activations=0, gpu_memory_utilization=1.0`` to size a pool from a plain
    KV budget. Raises ``ConfigError`` for settings out of range and ``OutOfMemoryError`` when
    the weights do not fit or not one block is left for the cache.
    """
    _check_block_size(block_size)
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}", param="gpu_memory_utilization"
        )
    if total_memory <= 0:
        raise ConfigError(f"total_memory must be > 0 bytes, got {total_memory}")
    if activations is None and activations_measured:
        raise ConfigError("activations_measured=True needs the measured activations= value")
    weights = weight_bytes(config, dtype) if weights is None else int(weights)
    activations = estimate_activation_bytes(config, dtype) if activations is None else int(activations)
    usable = int(total_memory * gpu_memory_utilization)
    if weights > usable:
        raise OutOfMemoryError(
            f"the weights of {config.name} ({weights / GiB:.2f} GiB) do not fit in {usable / GiB:.2f} GiB "
            f"({gpu_memory_utilization:.0%} of {total_memory / GiB:.2f} GiB): use a larger device, a smaller "
            "dtype, or a higher gpu_memory_utilization"
        )
    per_block = kv_bytes_per_block(config, dtype, block_size, kv_dtype)
    kv_pool = usable - weights - activations
    if kv_pool < per_block:
        raise OutOfMemoryError(
            f"no KV block left: {usable / GiB:.2f} GiB usable − {weights / GiB:.2f} GiB weights − "
            f"{activations / GiB:.2f} GiB activations leaves {max(kv_pool, 0) / MiB:.1f} MiB, and one block of "
            f"{block_size} tokens needs {per_block / MiB:.2f} MiB"
        )
    return MemoryPlan(
        total=int(total_memory),
        usable=usable,
        weights=weights,
        activations=activations,
        activations_measured=activations_measured,
        kv_pool=kv_pool,
        bytes_per_block=per_block,
        num_gpu_blocks=kv_pool // per_block,
        block_size=block_size,
        bytes_per_token=kv_bytes_per_token(config, dtype, kv_dtype),
    )
