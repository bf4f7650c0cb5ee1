"""A tiny random Llama with SmolLM2's head layout: the parallel engine's lessons and tests run on it.

2 layers, 9 query / 3 KV heads, intermediate 96 (divisible by 3 like SmolLM2's 1536), tied
embeddings, and a vocabulary of 320 that 3 does not divide, so the padded vocab shard runs too.
It splits exactly as SmolLM2-135M does (T ∈ {1, 3}, P ∈ {1, 2}) and steps in milliseconds.
``TINY_EVEN_LAYOUT`` (``tiny_even_model``) is its twin with 8 query / 4 KV heads, for T ∈ {1, 2, 4, 8}.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.config import ModelConfig
from ..model.llama import LlamaForCausalLM
from ..model.loader import ByteTokenizer

TINY_SMOLLM2_LAYOUT = ModelConfig(
    name="tiny-random-smollm2-layout",
    vocab_size=320,
    hidden_size=144,
    intermediate_size=96,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=16,
    rope_theta=100000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)

# The same size with even head counts (8 query / 4 KV heads, intermediate 128): it splits T ∈ {1, 2, 4, 8}
# (at 8, each KV head on two ranks), so the cost-model runs of benchmarks/NOTES.md can use T other than 3.
TINY_EVEN_LAYOUT = ModelConfig(
    name="tiny-random-even-layout",
    vocab_size=320,
    hidden_size=128,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    rope_theta=100000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def tiny_model(seed: int = 0, config: ModelConfig = TINY_SMOLLM2_LAYOUT) -> tuple[LlamaForCausalLM, ByteTokenizer]:
    """``(model, tokenizer)``: seeded N(0, 0.1) weights (norms 1), fp32 on the CPU."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                nn.init.normal_(param, std=0.1)
    model.source, model.is_random = f"{config.name} (RANDOM weights, seed {seed})", True
    return model, ByteTokenizer(config.vocab_size)


def tiny_even_model(seed: int = 0) -> tuple[LlamaForCausalLM, ByteTokenizer]:
    """``tiny_model`` with ``TINY_EVEN_LAYOUT`` (a factory for ``collective_bench.measure_engine``)."""
    return tiny_model(seed, TINY_EVEN_LAYOUT)
