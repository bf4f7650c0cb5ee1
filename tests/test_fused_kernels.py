"""Fused element-wise kernels (``kernels/fused.py``) against the model's torch code, on the CPU interpreter.

Shapes are drawn from a seeded generator: token counts 1, 3, 17 and random ones; SmolLM2
(hidden 576, 9+3 heads, I = 1536) and TinyLlama (hidden 2048, 32+4 heads, I = 5632) sizes
plus odd ones that are not powers of two (masking); inputs that are slices of wider buffers
(row stride != row length). fp32 and fp16 only: the interpreter rounds fp32 -> bf16 its own
way (it disagrees with torch by a bf16 step), so bf16 runs in ``tests/gpu``.

Tolerances: fp32 atol = rtol = 2e-6 (the kernels do the same fp32 operations as torch; only
the order of the RMSNorm sum and numpy's ``exp`` differ; observed <= 3e-7 relative);
fp16 atol 1e-5, rtol 2e-3 (two fp16 rounding steps, 2 × 2^-10: a step in the intermediate cast,
scaled by the weight or ``up``, plus one in the final cast), and at least 99%
of elements bit-identical, which holds only if the kernel casts to fp16 at the same points as
torch (observed: all of them for the norms, 99.97% for SiLU × up). The residual sum must match
exactly, and so must the fp32 rotary: they are the same additions and products.
Every output the wrappers allocate starts as NaN (``poison_allocations``), so an element a
kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # find it without importing it: lifeofprompt.kernels must be first
    pytest.skip("Triton is not installed", allow_module_level=True)
import fused_reference  # noqa: E402  (tests/fused_reference.py)
from lifeofprompt.kernels import fused  # noqa: E402

from lifeofprompt import kernels  # noqa: E402
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_argmax_agrees  # noqa: E402
from lifeofprompt.model.layers import RotaryEmbedding, fused_kernels  # noqa: E402

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(
        torch.cuda.is_available() and not kernels.INTERPRETED,
        reason="CPU interpreter tests; on a GPU machine run tests/gpu",
    ),
]

TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.float16: dict(atol=1e-5, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]
SMOLLM2 = dict(hidden=576, heads=(9, 3), intermediate=1536)
TINYLLAMA = dict(hidden=2048, heads=(32, 4), intermediate=5632)


def _token_counts(rng):
    return [1, 3, 17, rng.randint(2, 24)]


def _strided(rows: int, cols: int, dtype, gen, scale=1.0, extra=0):
    """A ``[rows, cols]`` slice of a wider buffer when ``extra`` > 0 (row stride ``cols + extra``)."""
    buffer = torch.randn(rows, cols + extra, generator=gen) * scale
    return buffer.to(dtype)[:, extra : extra + cols] if extra else buffer.to(dtype)


def norm_cases(seed=0):
    rng = random.Random(seed)
    cases = []
    for i, tokens in enumerate(_token_counts(rng)):
        hidden = [SMOLLM2["hidden"], TINYLLAMA["hidden"], rng.randrange(33, 700, 2) + 1, 64][i]  # one odd size
        cases.append(
            dict(
                tokens=tokens,
                hidden=hidden,
                eps=rng.choice([1e-5, 1e-6]),
                scale=rng.choice([0.02, 1.0, 30.0]),
                extra=rng.choice([0, 0, 7, 64]),
                seed=rng.randrange(1 << 30),
            )
        )
    return cases


def rotary_cases(seed=1):
    rng = random.Random(seed)
    # Llama-8B's heads, and head_dim 48 whose half (24) is not a power of 2 (masked)
    heads_dims = [(*SMOLLM2["heads"], 64), (*TINYLLAMA["heads"], 64), (32, 8, 128), (5, 1, 48)]
    return [
        dict(tokens=tokens, heads_q=hq, heads_kv=hkv, head_dim=d, seed=rng.randrange(1 << 30))
        for tokens, (hq, hkv, d) in zip(_token_counts(rng), heads_dims)
    ]


def silu_cases(seed=2):
    rng = random.Random(seed)
    sizes = [SMOLLM2["intermediate"], TINYLLAMA["intermediate"], rng.randrange(100, 1100) | 1, 1024]
    return [
        dict(tokens=tokens, intermediate=i, extra=rng.choice([0, 0, 16]), seed=rng.randrange(1 << 30))
        for tokens, i in zip(_token_counts(rng), sizes)
    ]


def assert_matches(out, expected):
    """Within the dtype's tolerance, and in fp16 rounded where torch rounds: at most 1% of elements a step off."""
    torch.testing.assert_close(out, expected, **TOLERANCE[out.dtype])
    if out.dtype != torch.float32:
        identical = (out == expected).float().mean().item()
        assert identical >= 0.99, f"only {identical:.2%} of elements identical: it rounds elsewhere than torch"


def _id(case):
    return "-".join(f"{k}{v}" for k, v in case.items() if k != "seed")


def _weight(hidden, dtype, gen):
    return (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", norm_cases(), ids=_id)
def test_rms_norm_matches_model(poison_allocations, case, dtype):
    gen = torch.Generator().manual_seed(case["seed"])
    x = _strided(case["tokens"], case["hidden"], dtype, gen, case["scale"], case["extra"])
    weight = _weight(case["hidden"], dtype, gen)
    before = x.clone()
    out = fused.rms_norm(x, weight, case["eps"])
    expected = fused_reference.rms_norm_reference(x, weight, case["eps"])
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert_matches(out, expected)
    assert torch.equal(x, before), "rms_norm must not write its input"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", norm_cases(seed=10), ids=_id)
def test_add_rms_norm_adds_in_place_then_normalises(poison_allocations, case, dtype):
    gen = torch.Generator().manual_seed(case["seed"])
    x = _strided(case["tokens"], case["hidden"], dtype, gen, case["scale"], case["extra"])
    residual = _strided(case["tokens"], case["hidden"], dtype, gen, case["scale"], case["extra"])
    weight = _weight(case["hidden"], dtype, gen)
    x_before, residual_before = x.clone(), residual.clone()
    buffer = residual._base if residual._base is not None else residual  # the wider buffer it is a slice of
    buffer_before = buffer.clone()
    expected, expected_sum = fused_reference.add_rms_norm_reference(x, residual, weight, case["eps"])

    out, new_residual = fused.add_rms_norm(x, residual, weight, case["eps"])
    assert new_residual is residual, "the residual is updated in place and returned"
    assert torch.equal(residual, expected_sum), "the sum is rounded to the dtype exactly like torch's add"
    assert not torch.equal(residual, residual_before)
    assert torch.equal(x, x_before), "x is only read"
    assert_matches(out, expected)
    outside = torch.ones(buffer.shape[-1], dtype=torch.bool)
    outside[case["extra"] : case["extra"] + case["hidden"]] = False
    assert torch.equal(buffer[:, outside], buffer_before[:, outside]), "columns outside the slice are untouched"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", rotary_cases(), ids=_id)
def test_rotary_qk_rotates_the_qkv_slice_in_place(poison_allocations, case, dtype):
    tokens, hq, hkv, head_dim = case["tokens"], case["heads_q"], case["heads_kv"], case["head_dim"]
    gen = torch.Generator().manual_seed(case["seed"])
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)  # q | k | v, as the projection
    qk = qkv[:, : (hq + hkv) * head_dim].view(tokens, hq + hkv, head_dim)  # row stride > heads * head_dim
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rotary.at(positions)
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    expected = fused_reference.rotary_qk_reference(qk, cos, sin)

    out = fused.rotary_qk(qk, cos, sin)
    assert out is qk
    if dtype == torch.float32:
        assert torch.equal(qk, expected), "the same fp32 products and sums as RotaryEmbedding.rotate"
    assert_matches(qk, expected)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before), "the value heads are not touched"


def test_rotary_qk_accepts_two_dimensional_angle_rows():
    gen = torch.Generator().manual_seed(3)
    qk = torch.randn(4, 6, 32, generator=gen)
    cos, sin = RotaryEmbedding(32, 64, 10000.0).at(torch.tensor([0, 5, 9, 63]))
    expected = fused_reference.rotary_qk_reference(qk, cos, sin)
    fused.rotary_qk(qk, cos[:, 0], sin[:, 0])
    assert torch.equal(qk, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", silu_cases(), ids=_id)
def test_silu_mul_matches_mlp(poison_allocations, case, dtype):
    gen = torch.Generator().manual_seed(case["seed"])
    gate_up = _strided(case["tokens"], 2 * case["intermediate"], dtype, gen, 4.0, case["extra"])
    before = gate_up.clone()
    out = fused.silu_mul(gate_up)
    expected = fused_reference.silu_mul_reference(gate_up)
    assert out.shape == (case["tokens"], case["intermediate"]) and out.dtype == dtype and out.is_contiguous()
    assert_matches(out, expected)
    assert torch.equal(gate_up, before)


def test_no_rows_launches_nothing():
    weight = torch.ones(576)
    x, residual = torch.empty(0, 576), torch.empty(0, 576)
    assert fused.rms_norm(x, weight, 1e-5).shape == (0, 576)
    out, res = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert out.shape == (0, 576) and res is residual
    qk = torch.empty(0, 12, 64)
    assert fused.rotary_qk(qk, torch.empty(0, 1, 32), torch.empty(0, 1, 32)) is qk
    assert fused.silu_mul(torch.empty(0, 3072)).shape == (0, 1536)


def test_three_dimensional_rows_keep_their_shape():
    gen = torch.Generator().manual_seed(4)
    x, residual = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    weight = _weight(64, torch.float32, gen)
    expected, expected_sum = fused_reference.add_rms_norm_reference(x, residual, weight, 1e-6)
    out, residual = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert torch.equal(residual, expected_sum)


def test_bad_inputs_are_refused():
    x = torch.randn(3, 64)
    with pytest.raises(AssertionError, match="weight"):
        fused.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-5)
    with pytest.raises(AssertionError, match="contiguous"):
        fused.rms_norm(torch.randn(64, 3).t(), torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="residual"):
        fused.add_rms_norm(x, torch.randn(3, 64, dtype=torch.float16), torch.ones(64), 1e-5)
    with pytest.raises(AssertionError, match="fp32"):
        fused.rotary_qk(torch.randn(3, 4, 64), torch.ones(3, 1, 32, dtype=torch.float16), torch.ones(3, 1, 32))
    with pytest.raises(AssertionError, match=r"\[T, 2\*I\]"):
        fused.silu_mul(torch.randn(3, 7))


# ----------------------------------------------------------------------------- wired into the model


@torch.no_grad()
def test_smollm2_forward_with_fused_kernels_matches_the_model(smollm2, story_ids, one_thread, monkeypatch):
    """All 30 SmolLM2 layers on the story's prompts (two sequences, 10 rows) with the fused kernels the
    layers call themselves (``model/layers.py``), each launched where the decoder loop needs it."""
    from lifeofprompt.model.attention import NoCacheMetadata

    model, _ = smollm2
    ids = story_ids[0] + story_ids[1]
    lengths = [len(story_ids[0]), len(story_ids[1])]
    input_ids = torch.tensor(ids)
    positions = torch.cat([torch.arange(n) for n in lengths])
    meta = NoCacheMetadata.for_lengths(lengths)
    expected = model.hidden_states(input_ids, positions, meta)
    launched = count_launches(monkeypatch)
    with fused_kernels("on"):  # what a GPU does by itself; here through Triton's interpreter
        hidden = model.hidden_states(input_ids, positions, meta)
    layers = model.config.num_layers
    # one norm in the first layer, two residual norms a layer after it (the last is the final norm)
    assert launched == dict(rms_norm=1, add_rms_norm=2 * layers, rotary_qk=layers, silu_mul=layers)
    torch.testing.assert_close(hidden, expected, atol=5e-5, rtol=1e-5)  # observed 1.1e-5 at values up to 31
    assert meta.logits_indices is None  # no-cache metadata: every row's next token
    logits = model.lm_head(expected)
    # every row's best token leads by 0.1 or more: far beyond the fused kernels' rounding, or another CPU's
    assert_argmax_agrees(model.lm_head(hidden), logits, FP32_TOLERANCE, min_decided=10)
    assert_argmax_agrees([29, 1038, 28, 2026, 29, 253, 9552, 1183, 281, 281], logits, FP32_TOLERANCE, min_decided=10)


def count_launches(monkeypatch) -> dict:
    """Count each fused kernel's calls from now on (the counts fill the returned dict)."""
    counts = {}
    for name in ("rms_norm", "add_rms_norm", "rotary_qk", "silu_mul"):
        real = getattr(fused, name)

        def counted(*args, _real=real, _name=name):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(fused, name, counted)
    return counts


def test_the_layers_run_torch_unless_asked(smollm2, story_ids, monkeypatch):
    """On a CPU tensor, with no override, the layers never launch a fused kernel."""
    from lifeofprompt.model.attention import NoCacheMetadata

    model, _ = smollm2
    launched = count_launches(monkeypatch)
    ids = story_ids[0]
    with torch.no_grad():
        model.hidden_states(torch.tensor(ids), torch.arange(len(ids)), NoCacheMetadata.for_lengths([len(ids)]))
    assert launched == {}
