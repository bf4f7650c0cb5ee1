"""Tiny random Llamas for tests: one with SmolLM2's head layout, for the tensor-parallel tests (and their
subprocesses; it lives in ``lifeofprompt/lessons/tiny_models.py``, since notebook 15 runs it too), and
``build_tiny_model``, for the engine's and the server's plumbing.
"""

from __future__ import annotations

import torch

from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.lessons.tiny_models import TINY_SMOLLM2_LAYOUT, tiny_model  # noqa: F401 (the tests import them from here)


def assert_parallel_agrees(parallel_model, full_model, prompts, tokens, reference_tokens, min_fraction: float = 0.9):
    """``tokens`` (a parallel engine's) are the single engine's ``reference_tokens`` wherever the
    reference's fp32 top-2 margin beats twice the measured logit difference between the two models
    (teacher-forced on the reference tokens), with at least ``min_fraction`` of the steps decided.
    Returns the measured difference."""
    reference = [teacher_forced_logits(full_model, p, t) for p, t in zip(prompts, reference_tokens)]
    candidate = [teacher_forced_logits(parallel_model, p, t) for p, t in zip(prompts, reference_tokens)]
    difference = max((a - b).abs().max().item() for a, b in zip(reference, candidate))
    assert difference < FP32_TOLERANCE  # the logits agree, not just the argmax
    tolerance = 2 * difference  # a margin moves by at most twice that
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

    config = ModelConfig(
        name="tiny-random",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.5)
    model.source, model.is_random = "tiny random test model", True
    return model.eval(), ByteTokenizer(config.vocab_size)
