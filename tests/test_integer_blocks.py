"""Integer products on GGUF blocks (``cpu/interleaved_blocks.py``, ``cpu/integer_kernels.h``).

The kernel is held to a reference that computes the same thing in float64 (the same two int8 digits
of x per block, the same integers of the weights), so only fp32 rounding may separate them, and every
check of that kind is shown to catch a wrong scale, a swapped sign and a mislaid row. Each instruction
path runs where this CPU has it (AVX-512 VNNI natively; AVX-VNNI, AVX2 and plain C through builds for
those targets). Then the C step and the engine with integer products, and the accuracy rule that lets
``block_activations="auto"`` choose them: top-2 margins and the long text's perplexity.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lifeofprompt.cpu import interleaved_blocks as ib
from lifeofprompt.env import cpu_flags
from lifeofprompt.lessons.agreement import assert_argmax_agrees
from lifeofprompt.model.block_formats import dequantize, quantize

pytestmark = pytest.mark.skipif(ib.integer_path() is None, reason="no C compiler: no block kernels")

# (out, in, rows of x): whole and ragged blocks, widths below one block, 1 to 9 rows (tiles of 4 and their rest)
SHAPES = [(16, 32, 1), (48, 576, 1), (64, 100, 3), (32, 1536, 5), (16, 33, 9), (96, 7, 2), (160, 64, 4)]


def random_case(fmt: str, out: int, n: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, n, generator=g) * 0.05 + 0.01 * torch.randn(out, 1, generator=g)
    x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g) * 4  # rows of unlike sizes
    x[:, ::7] *= 10  # a few large activations, as LLMs have
    return quantize(weight, fmt), x


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor, blocks) -> None:
    """``y`` is the integer product of ``x`` and ``blocks`` up to fp32 rounding: within 1e-5 of the sum of the
    terms' sizes (``|x| @ |W|.T``) of the float64 reference."""
    reference = ib.integer_product_reference(x, blocks)
    size = x.double().abs() @ dequantize(blocks, torch.float64).abs().T
    error = (y.double() - reference).abs()
    worst = (error / (size + 1e-6)).max().item()
    assert (error <= 1e-5 * size + 1e-6).all(), f"off the reference by {worst:.3g} of the terms' size"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_integer_product_is_the_reference_s(fmt, shape, one_thread):
    blocks, x = random_case(fmt, *shape, seed=sum(shape))
    y = ib.integer_linear(x, ib.interleave(blocks))
    assert y.shape == (shape[2], shape[0])
    assert_matches_reference(y, x, blocks)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_integer_product_errs_by_the_digits_alone(fmt, one_thread):
    """Against the exact product of x and the dequantized weights: within what rounding x to its digits
    allows (``activation_error_bound``), and far closer than one int8 digit would be."""
    blocks, x = random_case(fmt, 64, 576, 4, seed=3)
    y = ib.integer_linear(x, ib.interleave(blocks)).double()
    exact = x.double() @ dequantize(blocks, torch.float64).T
    bound = ib.activation_error_bound(x, blocks)
    assert ((y - exact).abs() <= bound + 1e-5).all()
    assert (y - exact).abs().max() < bound.max() / 4  # rounding errors cancel: measured ~1/20 of the bound


def test_the_compiled_digits_are_the_references(one_thread):
    x = torch.randn(5, 200) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [1.0]])
    x[4, 17] = 1e4  # one block dominated by one value
    got, want = ib.kernel_digits(x), ib.quantize_activations(x)
    assert torch.equal(got.hi, want.hi) and torch.equal(got.lo, want.lo) and torch.equal(got.scale, want.scale)
    assert (got.values().abs()[3] == 0).all()  # a row of zeros stays zeros (no division by zero)
    padded = torch.nn.functional.pad(x.double(), (0, 24))
    assert ((got.values() - padded).abs() <= got.scale.double().repeat_interleave(32, 1)).all()


BROKEN = {
    "a wrong scale": lambda b: ib.InterleavedBlocks(
        b.format,
        b.quants,
        b.scales * torch.tensor(1.0, dtype=torch.float16).add(torch.arange(16) == 5),
        b.mins,
        b.in_features,
        b.out_features,
    ),
    "a swapped sign": lambda b: ib.InterleavedBlocks(
        b.format,
        b.quants ^ 0x80 if b.format == "q8_0" else b.quants,
        b.scales,
        -b.mins if b.mins is not None else None,
        b.in_features,
        b.out_features,
    ),
    "a mislaid row": lambda b: ib.InterleavedBlocks(
        b.format,
        b.quants.view(b.quants.shape[0], b.quants.shape[1], -1, 16, 4).roll(1, dims=3).reshape(b.quants.shape),
        b.scales,
        b.mins,
        b.in_features,
        b.out_features,
    ),
}


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_reference_check_catches_a_broken_layout(fmt, broken, one_thread):
    blocks, x = random_case(fmt, 48, 96, 3, seed=11)
    y = ib.integer_linear(x, BROKEN[broken](ib.interleave(blocks)))
    with pytest.raises(AssertionError, match="off the reference"):
        assert_matches_reference(y, x, blocks)


def test_a_layout_that_cannot_be_relaid_is_refused():
    blocks, _ = random_case("q4_1", 24, 64, 1, seed=0)
    with pytest.raises(ValueError, match="groups of 16"):
        ib.interleave(blocks)


# ----------------------------------------------------------------------------- each instruction path

PATHS = {  # -march target -> (the path it builds, the CPU flags it needs)
    "alderlake": ("avx-vnni", {"avx2", "avx_vnni", "fma", "f16c", "bmi2"}),
    "x86-64-v3": ("avx2", {"avx2", "fma", "f16c", "bmi2"}),
    "x86-64": ("portable", set()),
}
PATH_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_integer_blocks import SHAPES, assert_matches_reference, random_case
from lifeofprompt.cpu import interleaved_blocks as ib
for fmt in ("q8_0", "q4_1"):
    for shape in SHAPES:
        blocks, x = random_case(fmt, *shape, seed=sum(shape))
        assert_matches_reference(ib.integer_linear(x, ib.interleave(blocks)), x, blocks)
print(json.dumps(ib.integer_path()))
"""


def test_this_cpus_own_build_takes_its_widest_path():
    flags = cpu_flags()
    if {"avx512_vnni", "avx512bw"} <= flags:
        assert ib.integer_path() == "avx512-vnni"
    elif "avx2" in flags:
        assert ib.integer_path() in ("avx-vnni", "avx2")


@pytest.mark.slow
@pytest.mark.parametrize("march", list(PATHS))
def test_each_instruction_path_computes_the_reference_s_product(march, tmp_path):
    """A build for another target (``LIFEOFPROMPT_NATIVE_MARCH``) runs that target's path in a fresh process."""
    path, needs = PATHS[march]
    if not needs <= cpu_flags() or not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip(f"this CPU cannot run the {path} path")
    env = dict(os.environ, LIFEOFPROMPT_NATIVE_MARCH=march, OMP_NUM_THREADS="1")
    script = PATH_SCRIPT.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == path


# ----------------------------------------------------------------------------- the C step and the engine


@pytest.fixture(scope="module")
def gguf():
    from lifeofprompt import load_model

    return load_model("smollm2-135m", quantization="gguf")


@torch.no_grad()
def step_logits(model, way: str) -> torch.Tensor:
    """Logits of one made-up step (three prompts of 7, 4 and 9 tokens) through the C step or the torch layers."""
    from lifeofprompt.cpu import c_step
    from lifeofprompt.model.attention import PagedKVCache, synthetic_step

    cache = PagedKVCache.for_model(model.config, 8, 16, model.dtype, "cpu")
    step = synthetic_step(model, cache, [7, 4, 9])
    with c_step.running(model, None if way == "torch" else c_step.CStep.only(c_step.ROW_MAJOR)):
        return model(*step)


def test_the_c_step_with_integer_products_is_the_torch_layers_with_them(gguf, one_thread, monkeypatch):
    """The C step makes the same digits of each layer's input as the torch layers' products do, so the two agree
    up to fp32 order; and both differ from float products (the integer kernel was used)."""
    model, _ = gguf
    monkeypatch.setattr("lifeofprompt.model.quantized_linear.cpu_kernel_rows", lambda: 64)
    ib.drop_interleaved(model)
    floats = step_logits(model, "c-step")
    ib.interleave_model(model)
    try:
        c, torch_layers = step_logits(model, "c-step"), step_logits(model, "torch")
    finally:
        ib.drop_interleaved(model)
    assert (c - torch_layers).abs().max() < 1e-2  # measured ~1e-4
    assert 1e-4 < (c - floats).abs().max() < 0.5
    # either differs from the other by under 1e-2, so each must pick the other's token where that leads by 2e-2
    assert_argmax_agrees(c, torch_layers, tolerance=2e-2, min_decided=3)  # one row a prompt: all 3 decided


def test_the_engine_decodes_with_integer_products_as_with_float_ones(gguf, story_ids):
    from lifeofprompt import LLM, SamplingParams
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, assert_greedy_agrees, teacher_forced_logits, top2_margins

    model, tokenizer = gguf
    params = SamplingParams(max_tokens=16, temperature=0)
    runs, lines = {}, {}
    for kind in ("float", "integer"):
        llm = LLM(model, tokenizer=tokenizer, cpu_tuning="c-step", block_activations=kind, num_kv_blocks=64)
        lines[kind] = [line for line in llm.engine.startup_log if "products with block matrices" in line]
        outputs = llm.generate([{"prompt_token_ids": i} for i in story_ids], params, use_tqdm=False)
        runs[kind] = [o.outputs[0].token_ids for o in outputs]
    assert "integer (" in lines["integer"][0] and "re-laid" in lines["integer"][0]
    assert lines["float"] == ["products with block matrices: float, as asked"]
    ib.drop_interleaved(model)
    margins = [top2_margins(teacher_forced_logits(model, p, r)) for p, r in zip(story_ids, runs["float"])]
    assert_greedy_agrees(runs["integer"], runs["float"], margins, MARGIN_SHIFT, min_steps=24)


def test_block_activations_is_checked_and_auto_is_float_when_pinned(gguf):
    from lifeofprompt import LLM
    from lifeofprompt.errors import ConfigError

    with pytest.raises(ConfigError, match="block_activations='int8' is not one of"):
        LLM(gguf[0], tokenizer=gguf[1], block_activations="int8")
    llm = LLM(gguf[0], tokenizer=gguf[1], cpu_tuning="linear", num_kv_blocks=16)  # auto, pinned
    assert ib.interleaved_bytes(gguf[0]) == 0
    assert any("float: the pinned linear path times nothing" in line for line in llm.engine.startup_log)


# ----------------------------------------------------------------------------- the accuracy rule

PARITY = json.loads((Path(__file__).parent / "data" / "engine_parity_smollm2.json").read_text())["tokens"]


@torch.no_grad()
def teacher_forced_rows(model, tokenizer, prompts: int | None = None) -> torch.Tensor:
    """Logits of every parity prompt followed by its pinned greedy tokens, one uncached forward: 778 rows for
    all of them, 201 for the story's three."""
    from lifeofprompt.model.attention import NoCacheMetadata

    seqs = [tokenizer.encode(p) + tokens[:-1] for p, tokens in list(PARITY.items())[:prompts]]
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.tensor([i for s in seqs for i in range(len(s))])
    return model(ids, positions, NoCacheMetadata.for_lengths([len(s) for s in seqs]))


def emulated_activations(levels: int):
    """``QuantizedLinear.forward`` with x rounded per block of 32 to ``levels`` steps each side of zero and
    multiplied by the dequantized weights: 127 is llama.cpp's int8 activations (one digit), 7 int4."""

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).float()
        blocks = torch.nn.functional.pad(rows, (0, -rows.shape[1] % 32)).reshape(rows.shape[0], -1, 32)
        step = blocks.abs().amax(-1, keepdim=True) / levels
        rounded = torch.where(step > 0, torch.round(blocks / step.clamp_min(1e-30)), 0.0) * step
        weights = self.__dict__.setdefault("_dequantized", self.blocks.dequantize())
        return (rounded.flatten(1)[:, : self.in_features] @ weights.T).reshape(*x.shape[:-1], self.out_features)

    return forward


def within_the_rule(shift: float, perplexity: float, reference: float) -> bool:
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, PERPLEXITY_SHIFT

    return shift <= MARGIN_SHIFT and abs(perplexity / reference - 1) <= PERPLEXITY_SHIFT


def test_integer_products_move_the_storys_margins_far_less_than_the_rule_allows(gguf, monkeypatch, one_thread):
    """The quick form of the rule: the story's 201 rows (measured 0.005; bf16 0.36)."""
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, margin_shift

    model, tokenizer = gguf
    monkeypatch.setattr("lifeofprompt.model.quantized_linear.cpu_kernel_rows", lambda: 10**9)  # every row
    ib.drop_interleaved(model)
    reference = teacher_forced_rows(model, tokenizer, prompts=3)
    ib.interleave_model(model)
    try:
        shift = margin_shift(teacher_forced_rows(model, tokenizer, prompts=3), reference)
    finally:
        ib.drop_interleaved(model)
    assert shift <= MARGIN_SHIFT / 10, shift


@pytest.mark.slow
def test_integer_products_pass_the_accuracy_rule_and_one_int8_digit_does_not(gguf, monkeypatch):
    """The rule that lets ``block_activations="auto"`` choose integer products, on all 778 teacher-forced rows of
    the parity prompts and the 4,891 tokens of the long text, against float products (the dequantized weights
    exactly). Measured: two digits 0.0096 and -0.001%; one digit (llama.cpp's activations) 0.75 and +0.24%,
    refused by the margins; int4 activations 10.3 and +111%, refused by both (their perplexity taken on the
    short text, where it is as clear)."""
    from lifeofprompt.lessons.agreement import margin_shift
    from lifeofprompt.lessons.perplexity import long_evaluation_text, perplexity
    from lifeofprompt.model.quantized_linear import QuantizedLinear

    model, tokenizer = gguf
    text = long_evaluation_text()
    assert len(tokenizer.encode(text)) >= 4096
    monkeypatch.setattr("lifeofprompt.model.quantized_linear.cpu_kernel_rows", lambda: 10**9)  # every row
    ib.drop_interleaved(model)
    rows, ppl, short = (
        teacher_forced_rows(model, tokenizer),
        perplexity(model, tokenizer, text),
        perplexity(model, tokenizer),
    )
    ib.interleave_model(model)
    try:
        integer = margin_shift(teacher_forced_rows(model, tokenizer), rows), perplexity(model, tokenizer, text)
    finally:
        ib.drop_interleaved(model)
    assert within_the_rule(*integer, ppl), integer
    monkeypatch.setattr(QuantizedLinear, "forward", emulated_activations(127))
    one_digit = margin_shift(teacher_forced_rows(model, tokenizer), rows)
    assert one_digit > 0.5 and not within_the_rule(one_digit, ppl, ppl)
    monkeypatch.setattr(QuantizedLinear, "forward", emulated_activations(7))
    assert not within_the_rule(0.0, perplexity(model, tokenizer), short)  # the short text shows it as well


def test_the_start_up_timing_takes_turns_in_runs_and_frees_the_copies(gguf, monkeypatch):
    """Integer and float products are timed in runs taken in turns (a run's warm-up absorbs the switch), and the
    re-laid copies are freed after: the caller keeps them or not by the verdict."""
    from lifeofprompt.cpu import block_calibration

    seen = []

    def step_seconds(model, way):
        seen.append(ib.interleaved_bytes(model) > 0)
        return 0.010 if seen[-1] else 0.020

    monkeypatch.setattr(block_calibration, "step_seconds", step_seconds)
    faster, why, record = block_calibration.integer_products_faster(gguf[0], "row-major")
    assert seen == [True, False] * block_calibration.INTEGER_TURNS
    assert faster and "10.00 ms with integer products, 20.00 ms with float ones" in why
    assert ib.interleaved_bytes(gguf[0]) == 0 and len(record["seconds"]["integer"]) == 3
