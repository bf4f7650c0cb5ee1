"""What quantizing at load costs: perplexity on the shipped evaluation text, bounded per format.

Measured on 2026-12-03 (SmolLM2's fp32 weights, 436 tokens): fp32 29.50, bf16 29.57 (+0.2%),
Q8_0 29.52 (+0.04%), Q4_1 31.30 (+6.1%); the GGUF's own blocks give fp32's 29.50, being its weights.
The bounds leave room for other CPUs' summation orders, not for a broken format: a wrong scale or
nibble order sends perplexity into the hundreds or thousands.
"""

from __future__ import annotations

import pytest
import torch

from lifeofprompt import load_model
from lifeofprompt.lessons.perplexity import evaluation_text, perplexity
from lifeofprompt.model.block_formats import BlockWeight
from lifeofprompt.model.quantized_linear import QuantizedLinear


@pytest.fixture(scope="module")
def fp32_perplexity(smollm2):
    model, tokenizer = smollm2
    return perplexity(model, tokenizer)


def test_the_text_is_ours_and_long_enough(smollm2):
    assert 400 < len(smollm2[1].encode(evaluation_text())) < 600


# q8_0 (7 s) runs in the whole tier; q4_1 keeps the check in the quick tier
@pytest.mark.parametrize("fmt, bound", [pytest.param("q8_0", 1.01, marks=pytest.mark.slow), ("q4_1", 1.10)])
def test_quantizing_at_load_costs_at_most_a_bounded_share_of_perplexity(fmt, bound, fp32_perplexity, one_thread):
    model, tokenizer = load_model("smollm2-135m", dtype="float32", quantization=fmt)
    ratio = perplexity(model, tokenizer) / fp32_perplexity
    assert 0.99 < ratio < bound, f"{fmt}: perplexity x{ratio:.3f} of fp32's"


def test_the_perplexity_check_catches_a_broken_format(smollm2, fp32_perplexity, one_thread):
    model, tokenizer = load_model("smollm2-135m", dtype="float32", quantization="q4_1")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantizedLinear) and module.format == "q4_1":
                blocks = module.blocks
                swapped = (blocks.quants >> 4) | (blocks.quants << 4)  # nibbles the wrong way round
                module.quants.copy_(BlockWeight("q4_1", swapped, blocks.scales, blocks.mins, 0).quants)
    assert perplexity(model, tokenizer) / fp32_perplexity > 2.0


def test_gguf_blocks_have_the_dequantized_models_perplexity(fp32_perplexity, one_thread):
    model, tokenizer = load_model("smollm2-135m", quantization="gguf")
    assert perplexity(model, tokenizer) == pytest.approx(fp32_perplexity, rel=1e-3)
