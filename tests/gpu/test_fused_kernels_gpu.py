"""The fused element-wise kernels (``kernels/fused.py``) compiled for the GPU: bf16 first, large shapes, CUDA graphs.

Run on the GPU machine with ``python -m pytest tests/gpu -q``; skipped without CUDA (the CPU
interpreter runs fp32/fp16 cases in ``tests/test_fused_kernels.py``).

Tolerances: bf16 rtol 1.6e-2 and fp16 rtol 2e-3, two rounding steps (2 × 2^-7, 2 × 2^-10
relative): an fp32-level difference can flip the intermediate cast by a step, which the
weight or ``up`` scales before the final cast rounds again. fp32 rtol 1e-5: the GPU's fast
``exp``/``rsqrt`` and fused multiply-adds differ from torch's in the last fp32 bits. atol 1e-5
throughout, for rotary results that cancel to almost zero. In bf16/fp16 at least 99% of
elements must also be bit-identical to torch's: the kernels round to the activation dtype
exactly where the model's torch code does, so only an fp32-level difference that lands on a
rounding boundary may flip a bit. The residual sum must be identical everywhere.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU; the CPU interpreter runs the same checks in tests/test_fused_kernels.py",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set: these tests compile the kernels for the GPU",
    ),
]

TOLERANCE = {
    torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
    torch.float16: dict(atol=1e-5, rtol=2e-3),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CUDA = "cuda"


def _fused():
    from lifeofprompt.kernels import fused

    from lifeofprompt import kernels

    assert not kernels.INTERPRETED
    return fused


def _references():
    import fused_reference  # tests/fused_reference.py

    return fused_reference


def assert_matches(out, expected):
    torch.testing.assert_close(out, expected, **TOLERANCE[out.dtype])
    if out.dtype != torch.float32:
        identical = (out == expected).float().mean().item()
        assert identical >= 0.99, f"only {identical:.2%} of elements identical: it rounds elsewhere than torch"


def _randn(*shape, dtype, gen, scale=1.0, extra=0):
    """On the GPU; a slice of a wider buffer (row stride ``shape[-1] + extra``) when ``extra`` > 0."""
    buffer = (torch.randn(*shape[:-1], shape[-1] + extra, generator=gen) * scale).to(CUDA, dtype)
    return buffer[..., extra:] if extra else buffer


def _weight(hidden, dtype, gen):
    return (1 + 0.3 * torch.randn(hidden, generator=gen)).to(CUDA, dtype)


# Randomized (seeded) shapes: the CPU file's sizes plus prefill-sized token counts and Llama-8B's hidden/heads.
_rng = random.Random(9)
TOKENS = [1, 3, 17, _rng.randint(20, 300), 4096]
NORM_CASES = [
    dict(tokens=t, hidden=h, extra=e, scale=s)
    for t, h, e, s in zip(
        TOKENS, [576, 2048, _rng.randrange(33, 3000, 2), 4096, 2048], [0, 64, 0, 7, 0], [1.0, 30.0, 0.02, 1.0, 3.0]
    )
]
ROTARY_CASES = [
    dict(tokens=t, heads_q=hq, heads_kv=hkv, head_dim=d)
    for t, (hq, hkv, d) in zip(TOKENS, [(9, 3, 64), (32, 4, 64), (5, 1, 48), (32, 8, 128), (32, 4, 64)])
]
SILU_CASES = [
    dict(tokens=t, intermediate=i, extra=e)
    for t, i, e in zip(TOKENS, [1536, 5632, _rng.randrange(100, 3000) | 1, 14336, 5632], [0, 16, 0, 0, 0])
]


def _id(case):
    return "-".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORM_CASES, ids=_id)
def test_rms_norm_and_add_rms_norm(poison_allocations, case, dtype):
    fused, refs = _fused(), _references()
    gen = torch.Generator().manual_seed(case["tokens"] * 7 + case["hidden"])
    shape = (case["tokens"], case["hidden"])
    x = _randn(*shape, dtype=dtype, gen=gen, scale=case["scale"], extra=case["extra"])
    residual = _randn(*shape, dtype=dtype, gen=gen, scale=case["scale"], extra=case["extra"])
    weight = _weight(case["hidden"], dtype, gen)
    assert_matches(fused.rms_norm(x, weight, 1e-5), refs.rms_norm_reference(x, weight, 1e-5))

    x_before = x.clone()
    expected, expected_sum = refs.add_rms_norm_reference(x, residual, weight, 1e-5)
    out, new_residual = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual is residual and torch.equal(residual, expected_sum)
    assert torch.equal(x, x_before)
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROTARY_CASES, ids=_id)
def test_rotary_qk_in_place(case, dtype):
    from lifeofprompt.model.layers import RotaryEmbedding

    fused, refs = _fused(), _references()
    tokens, hq, hkv, head_dim = case["tokens"], case["heads_q"], case["heads_kv"], case["head_dim"]
    gen = torch.Generator().manual_seed(tokens * 13 + hq)
    qkv = _randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, gen=gen)
    qk = qkv[:, : (hq + hkv) * head_dim].view(tokens, hq + hkv, head_dim)
    positions = torch.randint(0, 32768, (tokens,), generator=gen).to(CUDA)
    cos, sin = RotaryEmbedding(head_dim, 32768, 10000.0).to(CUDA).at(positions)
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    expected = refs.rotary_qk_reference(qk, cos, sin)
    assert fused.rotary_qk(qk, cos, sin) is qk
    assert_matches(qk, expected)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SILU_CASES, ids=_id)
def test_silu_mul(poison_allocations, case, dtype):
    fused, refs = _fused(), _references()
    gen = torch.Generator().manual_seed(case["tokens"] * 3 + case["intermediate"])
    gate_up = _randn(case["tokens"], 2 * case["intermediate"], dtype=dtype, gen=gen, scale=4.0, extra=case["extra"])
    out = fused.silu_mul(gate_up)
    assert out.shape == (case["tokens"], case["intermediate"]) and out.is_contiguous()
    assert_matches(out, refs.silu_mul_reference(gate_up))


def test_bf16_error_against_fp32_is_the_references():
    """TinyLlama decode shapes: each kernel's bf16 output is as close to the fp32 computation as torch's bf16 path."""
    from lifeofprompt.model.layers import RotaryEmbedding

    fused, refs = _fused(), _references()
    gen = torch.Generator().manual_seed(0)

    def rms(t):
        return float(t.float().pow(2).mean().sqrt())

    x, _ = _randn(64, 2048, dtype=torch.bfloat16, gen=gen), _randn(64, 2048, dtype=torch.bfloat16, gen=gen)
    weight = _weight(2048, torch.bfloat16, gen)
    qk = _randn(64, 36, 64, dtype=torch.bfloat16, gen=gen)
    cos, sin = RotaryEmbedding(64, 2048, 10000.0).to(CUDA).at(torch.arange(1000, 1064, device=CUDA))
    gate_up = _randn(64, 2 * 5632, dtype=torch.bfloat16, gen=gen, scale=4.0)
    checks = {
        "rms_norm": (
            fused.rms_norm(x, weight, 1e-5),
            refs.rms_norm_reference(x, weight, 1e-5),
            refs.rms_norm_reference(x.float(), weight.float(), 1e-5),
        ),
        "rotary": (
            fused.rotary_qk(qk.clone(), cos, sin),
            refs.rotary_qk_reference(qk, cos, sin),
            refs.rotary_qk_reference(qk.float(), cos, sin),
        ),
        "silu_mul": (
            fused.silu_mul(gate_up),
            refs.silu_mul_reference(gate_up),
            refs.silu_mul_reference(gate_up.float()),
        ),
    }
    for name, (out, reference, truth) in checks.items():
        kernel_error, reference_error = rms(out.float() - truth), rms(reference.float() - truth)
        assert kernel_error <= 1.05 * reference_error + 1e-6, f"{name}: {kernel_error:.3g}, torch {reference_error:.3g}"


def test_decode_kernels_replay_in_a_cuda_graph():
    """All four kernels on TinyLlama's decode shapes captured once, replayed on new inputs: no host sync inside."""
    from lifeofprompt.model.layers import RotaryEmbedding

    fused, refs = _fused(), _references()
    gen = torch.Generator().manual_seed(5)
    tokens, dtype = 8, torch.bfloat16
    x, residual = _randn(tokens, 2048, dtype=dtype, gen=gen), _randn(tokens, 2048, dtype=dtype, gen=gen)
    weight = _weight(2048, dtype, gen)
    qkv = _randn(tokens, 40 * 64, dtype=dtype, gen=gen)
    qk = qkv[:, : 36 * 64].view(tokens, 36, 64)
    rotary = RotaryEmbedding(64, 2048, 10000.0).to(CUDA)
    positions = torch.arange(tokens, device=CUDA)
    gate_up = _randn(tokens, 2 * 5632, dtype=dtype, gen=gen)

    def step():
        cos, sin = rotary.at(positions)
        first = fused.rms_norm(x, weight, 1e-5)
        normed, _ = fused.add_rms_norm(x, residual, weight, 1e-5)
        fused.rotary_qk(qk, cos, sin)
        return first, normed, fused.silu_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, normed, activated = step()

    for _ in range(3):
        for t in (x, residual, qkv, gate_up):
            t.copy_(torch.randn(t.shape, generator=gen).to(CUDA, dtype))
        positions.copy_(torch.randint(0, 2048, (tokens,), generator=gen).to(CUDA))
        expected_first = refs.rms_norm_reference(x, weight, 1e-5)
        expected_normed, expected_sum = refs.add_rms_norm_reference(x, residual, weight, 1e-5)
        expected_qk = refs.rotary_qk_reference(qk, *rotary.at(positions))
        expected_activated = refs.silu_mul_reference(gate_up)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(first, expected_first)
        assert_matches(normed, expected_normed)
        assert torch.equal(residual, expected_sum)
        assert_matches(qk, expected_qk)
        assert_matches(activated, expected_activated)
