"""The GGUF block product (``kernels/block_matmul.py``) compiled for the GPU: bf16 at TinyLlama-1.1B's shapes.

Run on the GPU machine with ``python -m pytest tests/gpu -q``; skipped without CUDA (the CPU
interpreter runs fp32/fp16 cases at small shapes in ``tests/test_block_matmul.py``).

* Every matrix of TinyLlama (qkv 2560×2048, o 2048×2048, gate_up 11264×2048, down 2048×5632, LM head
  32000×2048) in Q8_0 and Q4_1, for 1 row (multiply and sum), 4 and 16 rows (``tl.dot``), against the
  dequantized weights multiplied in fp32: within ``2^-8·S + 2^-8·|ref|`` elementwise, ``S = |x| @ |w|.T``
  (a bf16 rounding of each weight, 2^-9 relative, which the one-row path skips and the reference
  makes, plus the output's rounding, with a factor 2 of margin), and no further from the fp32 product
  than torch's own bf16 product of the dequantized weights (cuBLAS) is, give or take 10%.
* The product captured in a CUDA graph and replayed on new activations.
* ``quantize_model`` on the random TinyLlama: its logits against the same model with the dequantized
  weights as ordinary bf16 matrices, both next to an fp32 copy of those weights. With random weights the
  top logits are nearly tied, so the greedy tokens must agree only where the fp32 winner leads by more
  than twice the bf16 model's typical error (at least 99% of those rows), and the quantized model may be
  at most twice as far from fp32 as the bf16 one.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from lifeofprompt.lessons.flops import matrix_shapes
from lifeofprompt.model.config import TINYLLAMA_1_1B

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU; the CPU interpreter runs fp32/fp16 checks in tests/test_block_matmul.py",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: these tests compile the kernels for the GPU",
    ),
]

CUDA = "cuda"
FORMATS = ["q8_0", "q4_1"]
TINYLLAMA = matrix_shapes(TINYLLAMA_1_1B)  # qkv 2560 x 2048, o, gate_up 11264 x 2048, down, head 32000 x 2048
BF16_SCALE = 2.0**-8


def _kernel():
    from lifeofprompt.kernels import block_matmul

    from lifeofprompt import kernels

    assert not kernels.INTERPRETED
    return block_matmul


def _blocks(out_features, in_features, fmt, seed):
    from lifeofprompt.model.block_formats import quantize

    gen = torch.Generator(device=CUDA).manual_seed(seed)
    weight = torch.randn(out_features, in_features, device=CUDA, generator=gen) * 0.02
    return quantize(weight.to(torch.bfloat16), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(TINYLLAMA))
def test_bf16_at_tinyllama_shapes(poison_allocations, name, fmt):
    import block_reference  # tests/block_reference.py

    from lifeofprompt.model.block_formats import dequantize

    bm = _kernel()
    out_features, in_features = TINYLLAMA[name]
    blocks = _blocks(out_features, in_features, fmt, seed=len(name))
    w32, w16 = dequantize(blocks, torch.float32), dequantize(blocks, torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    for rows in (1, 4, 16):
        x = torch.randn(rows, in_features, device=CUDA, generator=gen).to(torch.bfloat16)
        out = bm.block_matmul(x, blocks)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        expected = x.float() @ w16.float().t()
        size = x.float().abs() @ w16.float().abs().t()
        excess = (out.float() - expected).abs() - BF16_SCALE * (size + expected.abs())
        assert excess.max().item() <= 0, f"{name} {fmt} rows={rows}: {int((excess > 0).sum())} outputs out of bound"
        truth = x.float() @ w32.t()
        kernel_error = (out.float() - truth).pow(2).mean().sqrt().item()
        torch_error = (block_reference.reference(x, blocks).float() - truth).pow(2).mean().sqrt().item()
        assert kernel_error <= 1.1 * torch_error + 1e-6, (
            f"{name} {fmt} rows={rows}: {kernel_error:.3g} vs {torch_error:.3g}"
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_and_tile_choices_agree(fmt):
    """Every split and tile width gives the same numbers up to the order of the fp32 sums."""
    bm = _kernel()
    blocks = _blocks(2048, 5632, fmt, seed=3)
    x = torch.randn(1, 5632, device=CUDA).to(torch.bfloat16)
    base = bm.block_matmul(x, blocks, split_k=1).float()
    for options in (dict(split_k=2), dict(split_k=8), dict(block_n=64), dict(block_n=16, block_k=64)):
        out = bm.block_matmul(x, blocks, **options).float()
        assert (out - base).abs().max().item() <= 2 * BF16_SCALE * base.abs().max().item(), options


def test_block_product_replays_in_a_cuda_graph():
    bm = _kernel()
    blocks = {fmt: _blocks(2048, 5632, fmt, seed=4) for fmt in FORMATS}
    x = torch.randn(1, 5632, device=CUDA).to(torch.bfloat16)

    def step():
        return [bm.block_matmul(x, b) for b in blocks.values()]  # split-K on: two launches each

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        x.copy_(torch.randn(1, 5632, device=CUDA).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        for out, expected in zip(outs, step(), strict=True):
            assert torch.equal(out, expected)


# ----------------------------------------------------------------------------- the whole model


def _with_dequantized_weights(model, fmt, dtype):
    """A copy of ``model`` in ``dtype`` with every matrix ``dequantize(quantize(w))``: what ``quantize_model`` reads."""
    from lifeofprompt.model.block_formats import dequantize, quantize
    from lifeofprompt.model.quantized_linear import LAYER_MATRICES

    twin = copy.deepcopy(model).to(dtype)
    pairs = [
        (layer.get_submodule(n), orig.get_submodule(n))
        for layer, orig in zip(twin.layers, model.layers)
        for n in LAYER_MATRICES
    ]
    with torch.no_grad():
        for mine, theirs in [*pairs, (twin.lm_head, model.lm_head)]:
            mine.weight.copy_(dequantize(quantize(theirs.weight, fmt), dtype))
    return twin


def _logits(model, prompts):
    """Logits of every row of each prompt, one prompt (at most 16 rows: the block kernels) per forward."""
    with torch.no_grad():
        return torch.cat([model(ids[None]).float()[0] for ids in prompts])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_tinyllama_picks_the_dequantized_models_tokens(fmt):
    from lifeofprompt import load_model
    from lifeofprompt.model.quantized_linear import QuantizedLinear, quantize_model

    _kernel()
    model, _ = load_model("tinyllama-1.1b-random", device=CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    lengths = [1] * 8 + [2, 5, 9, 16, 16]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), device=CUDA, generator=gen) for n in lengths]
    exact = _logits(_with_dequantized_weights(model, fmt, torch.float32), prompts)
    plain = _logits(_with_dequantized_weights(model, fmt, torch.bfloat16), prompts)
    quantize_model(model, fmt)
    assert isinstance(model.lm_head, QuantizedLinear) and model.quantization == fmt
    blocks = _logits(model, prompts)
    del model
    torch.cuda.empty_cache()
    assert torch.isfinite(blocks).all()
    err_blocks, err_plain = (blocks - exact).abs(), (plain - exact).abs()
    top2 = exact.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * err_plain.amax(dim=-1).median()
    agree = (blocks.argmax(-1) == plain.argmax(-1))[decisive].float().mean().item()
    print(
        f"{fmt}: max err blocks {err_blocks.max().item():.4f}, bf16 {err_plain.max().item():.4f}; "
        f"decisive rows {decisive.float().mean().item():.2f}, agreement there {agree:.3f}"
    )
    assert err_blocks.max().item() <= 2 * err_plain.max().item() + 0.02
    assert err_blocks.mean().item() <= 1.5 * err_plain.mean().item() + 1e-3
    assert decisive.float().mean().item() >= 0.3
    assert agree >= 0.99
