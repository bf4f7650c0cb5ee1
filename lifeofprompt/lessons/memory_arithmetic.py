"""Chapter 05's memory arithmetic beyond what the engine needs to size its pool.

The engine's own part is ``engine/memory.py``: bytes per token and per block, and ``plan_memory``, the
share-out of a device's memory it runs at start-up. Here is what the chapter adds around it: the models
it sizes beyond the story's two (Llama-3.1-8B, and a 13B whose cache is near a megabyte per token),
one conversation's cache, how many blocks and requests a budget holds, the host swap pool vLLM logs
as "CPU blocks" (an engine that swaps has one; ours recomputes instead), and the activation workspace
measured on a GPU.
"""

from __future__ import annotations

import torch

from ..engine.config import DEFAULT_STEP_TOKENS, EngineConfig
from ..engine.memory import MemoryPlan, blocks_for_tokens, kv_bytes_per_block, kv_bytes_per_token
from ..errors import ConfigError
from ..model.config import ModelConfig
from ..units import GiB

# meta-llama/Llama-2-13b-hf: 40 layers and no grouped-query attention (40 KV heads of 128), the
# kind of model whose cache is near a megabyte per token. Shapes from its config.json.
LLAMA_2_13B = ModelConfig(
    name="meta-llama/Llama-2-13b-hf",
    vocab_size=32000,
    hidden_size=5120,
    intermediate_size=13824,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    max_position_embeddings=4096,
)

# meta-llama/Llama-3.1-8B, for the memory arithmetic of the article "Serving is a memory problem" (no weights
# needed): chapter 05's cache and land, chapter 15's devices.
LLAMA_3_1_8B = ModelConfig(
    name="meta-llama/Llama-3.1-8B",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_ids=(128001,),
)

VLLM_SWAP_BYTES = 4 * GiB  # vLLM's default host swap space (``swap_space``), which its log counts as CPU blocks


def kv_bytes_for_tokens(config: ModelConfig, dtype, num_tokens: int, kv_dtype: str = "auto") -> int:
    """The cache of one conversation of ``num_tokens`` tokens (exact, not rounded up to blocks), its keys and
    values stored as ``kv_dtype`` (``kv_cache_dtype``: "auto" is ``dtype``)."""
    if num_tokens < 0:
        raise ConfigError(f"num_tokens must be >= 0, got {num_tokens}")
    return kv_bytes_per_token(config, dtype, kv_dtype) * num_tokens


def num_blocks_for_bytes(
    kv_pool_bytes: int, config: ModelConfig, dtype, block_size: int = EngineConfig.block_size, kv_dtype: str = "auto"
) -> int:
    """Whole blocks that fit in ``kv_pool_bytes`` (a pool's size for a memory budget)."""
    return max(0, int(kv_pool_bytes) // kv_bytes_per_block(config, dtype, block_size, kv_dtype))


def max_concurrent_requests(
    kv_pool_bytes: int,
    config: ModelConfig,
    dtype,
    context_len: int,
    block_size: int = EngineConfig.block_size,
    kv_dtype: str = "auto",
) -> int:
    """Requests of ``context_len`` tokens whose caches fit the pool at once (each holds whole blocks)."""
    if context_len <= 0:
        raise ConfigError(f"context_len must be >= 1, got {context_len}")
    blocks = num_blocks_for_bytes(kv_pool_bytes, config, dtype, block_size, kv_dtype)
    return blocks // blocks_for_tokens(context_len, block_size)


def cpu_blocks(plan: MemoryPlan, swap_bytes: int = VLLM_SWAP_BYTES) -> int:
    """The "CPU blocks" of vLLM's start-up log: whole blocks of ``plan``'s size in a host swap pool."""
    if swap_bytes < 0:
        raise ConfigError(f"swap_bytes must be >= 0, got {swap_bytes}")
    return int(swap_bytes) // plan.bytes_per_block


@torch.no_grad()
def measure_activation_bytes(model, num_tokens: int = DEFAULT_STEP_TOKENS) -> int:
    """Peak memory a forward over ``num_tokens`` rows allocates beyond what was there (CUDA only)."""
    from ..model.attention import NoCacheMetadata

    device = model.device
    if device.type != "cuda":
        raise ConfigError("measure_activation_bytes needs a CUDA device; on the CPU use estimate_activation_bytes")
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device)
    meta = NoCacheMetadata.for_lengths([num_tokens], device=device, last_rows_only=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model(ids, torch.arange(num_tokens, device=device), meta)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# ----------------------------------------------------------------------------- readings of a plan


def unusable(plan: MemoryPlan) -> int:
    """What the utilization fraction leaves to other processes and fragmentation."""
    return plan.total - plan.usable


def kv_tokens(plan: MemoryPlan) -> int:
    """Tokens the GPU blocks hold, all sequences together."""
    return plan.num_gpu_blocks * plan.block_size


def max_concurrency(plan: MemoryPlan, context_len: int) -> int:
    """Requests of ``context_len`` tokens whose caches fit the GPU blocks at once."""
    if context_len <= 0:
        raise ConfigError(f"context_len must be >= 1, got {context_len}")
    return plan.num_gpu_blocks // blocks_for_tokens(context_len, plan.block_size)
