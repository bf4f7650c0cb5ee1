"""Tiny random Llamas for tests: one with SmolLM2's head layout, for the tensor-parallel tests (and their
subprocesses), and ``build_tiny_model``, for the engine's and the server's plumbing.

2 layers, 9 query / 3 KV heads, intermediate 96 (divisible by 3 like SmolLM2's 1536), tied
embeddings, and a vocabulary of 320 that 3 does not divide, so the padded vocab shard runs too.
"""

from __future__ import annotations

import torch
from torch import nn

from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.model.config import ModelConfig
from lifeofprompt.model.llama import LlamaForCausalLM
from lifeofprompt.model.loader import ByteTokenizer

TINY_SMOLLM2_LAYOUT = ModelConfig(name="tiny-random-smollm2-layout", vocab_size=320, hidden_size=144,
                                  intermediate_size=96, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=16,
                                  rope_theta=100000.0, max_position_embeddings=512, tie_word_embeddings=True)


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


def assert_parallel_agrees(parallel_model, full_model, prompts, tokens, reference_tokens, min_fraction: float = 0.9):
    """``tokens`` (a parallel engine's) are the single engine's ``reference_tokens`` wherever the
    reference's fp32 top-2 margin beats twice the measured logit difference between the two models
    (teacher-forced on the reference tokens), with at least ``min_fraction`` of the steps decided.
    Returns the measured difference."""
    reference = [teacher_forced_logits(full_model, p, t) for p, t in zip(prompts, reference_tokens)]
    candidate = [teacher_forced_logits(parallel_model, p, t) for p, t in zip(prompts, reference_tokens)]
    difference = max((a - b).abs().max().item() for a, b in zip(reference, candidate))
    assert difference < FP32_TOLERANCE                              # the logits agree, not just the argmax
    tolerance = 2 * difference                                      # a margin moves by at most twice that
    margins = [top2_margins(r).tolist() for r in reference]
    steps = sum(len(t) for t in reference_tokens)
    assert sum(m > tolerance for ms in margins for m in ms) >= min_fraction * steps
    assert_greedy_agrees(tokens, reference_tokens, margins, tolerance, min_steps=int(min_fraction * steps))
    return difference


def build_tiny_model(max_position_embeddings: int = 512, seed: int = 0):
    """A 2-layer random Llama over the byte tokenizer (vocab 300): built in milliseconds, steps in
    about a millisecond; for tests of the engine's and the server's plumbing, not of the numbers."""
    from lifeofprompt.model.config import ModelConfig
    from lifeofprompt.model.llama import LlamaForCausalLM
    from lifeofprompt.model.loader import ByteTokenizer

    config = ModelConfig(name="tiny-random", vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=max_position_embeddings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.5)
    model.source, model.is_random = "tiny random test model", True
    return model.eval(), ByteTokenizer(config.vocab_size)
