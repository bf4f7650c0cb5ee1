"""Big steps on a float copy of the block matrices (``cpu/big_step_weights.py``, ``big_step_weights``).

A copy holds the blocks' own values, steps below its row count keep the blocks exactly, and steps at or
above it read the copy (shown by a broken copy, which the check catches). The start-up choice: the verdict
from made-up timings, the timing's turns, and the setting. Then the accuracy rule a copy must pass to be
chosen by default, shown failing for a copy rounded to fp8, and the engine's tokens with it.
"""

from __future__ import annotations

import pytest
import torch
from test_integer_blocks import PARITY, teacher_forced_rows, within_the_rule
from torch import nn

from lifeofprompt.cpu import big_step_weights as copies
from lifeofprompt.cpu import block_calibration
from lifeofprompt.model.block_formats import quantize
from lifeofprompt.model.quantized_linear import QuantizedLinear, block_product


def one_matrix(out_features: int = 96, in_features: int = 80, fmt: str = "q4_1") -> nn.Module:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3)) * 0.05
    return nn.ModuleDict({"proj": QuantizedLinear(quantize(weight, fmt))})


def bf16_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """How far a product of ``x`` and ``weights`` both rounded to bf16 (8-bit mantissas, fp32 sums) may be from
    the fp32 product: each factor errs by at most 2^-8 of itself, plus fp32's summation."""
    return (x.abs() @ weights.abs().T) * (2 * 2.0**-8 + 2.0**-20 * x.shape[-1]) + 1e-6


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("form", ["bfloat16", "float32"])
def test_a_copy_holds_the_blocks_values_and_only_big_steps_read_it(fmt, form):
    model = one_matrix(fmt=fmt)
    layer = model["proj"]
    assert copies.copy_bytes(model, form) == 96 * 80 * copies.FORMS[form].itemsize
    assert copies.make_copies(model, form, from_rows=8) == copies.copy_bytes(model, form)
    assert torch.equal(layer.big_step_copy, layer.blocks.dequantize(copies.FORMS[form]))
    assert copies.describe(model) == f"{form} from 8 rows"
    weights = layer.blocks.dequantize()
    for rows in (1, 7, 8, 33):
        x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows))
        out = layer(x)
        if rows < 8:
            assert torch.equal(out, block_product(x, layer.blocks, x.dtype))  # the blocks, untouched
            continue
        expected = torch.mm(x.to(copies.FORMS[form]), layer.big_step_copy.t()).float()
        assert torch.allclose(out, expected, rtol=0, atol=1e-6)
        assert ((out - x @ weights.T).abs() <= bf16_bound(x, weights)).all()
    copies.drop_copies(model)
    assert layer.big_step_copy is None and copies.copies_bytes(model) == 0 and copies.describe(model) == "none"


def test_the_check_catches_a_copy_with_a_row_out_of_place():
    model = one_matrix()
    layer = model["proj"]
    copies.make_copies(model, "bfloat16", from_rows=1)
    layer.big_step_copy[[0, 1]] = layer.big_step_copy[[1, 0]]
    x = torch.randn(16, 80, generator=torch.Generator().manual_seed(0))
    weights = layer.blocks.dequantize()
    assert not ((layer(x) - x @ weights.T).abs() <= bf16_bound(x, weights)).all()


def test_the_lm_head_keeps_its_blocks(gguf):
    model, _ = gguf
    layers = copies.copy_layers(model)
    assert len(layers) == 4 * model.config.num_layers and model.lm_head not in layers
    per_layer = sum(m.in_features * m.out_features for m in layers[:4])
    assert copies.copy_bytes(model, "bfloat16") == 2 * per_layer * model.config.num_layers


def test_forms_that_fit_the_memory():
    model = one_matrix()  # 15,360 bytes in bf16, 30,720 in fp32
    assert copies.forms_that_fit(model, None) == ["bfloat16", "float32"]
    assert copies.forms_that_fit(model, 4 * 30_720) == ["bfloat16", "float32"]
    assert copies.forms_that_fit(model, 4 * 30_000) == ["bfloat16"]
    assert copies.forms_that_fit(model, 4 * 15_000) == []
    assert copies.available_memory() is None or copies.available_memory() > 0


# ----------------------------------------------------------------------------- the start-up choice


def medians(blocks: list[float], copy: list[float]) -> dict:
    rows = block_calibration.BIG_STEP_ROWS
    return {"blocks": dict(zip(rows, blocks)), "bfloat16": dict(zip(rows, copy))}


def test_the_verdict_takes_the_copy_from_where_it_wins_at_every_bigger_step():
    # BIG_STEP_ROWS: 16, 32, 64, 128, 256
    verdict = block_calibration.big_step_verdict
    assert verdict(medians([1, 2, 4, 8, 16], [2, 3, 3, 5, 7])) == {"form": "bfloat16", "from_rows": 64}
    assert verdict(medians([1, 2, 4, 8, 16], [0.5, 3, 3, 9, 7])) == {"form": "bfloat16", "from_rows": 256}
    assert verdict(medians([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 8])) == {"form": "bfloat16", "from_rows": 16}
    assert verdict(medians([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 17])) == {"form": None, "from_rows": None}
    both = medians([1, 2, 4, 8, 16], [2, 3, 3, 5, 7]) | {
        "float32": dict(zip(block_calibration.BIG_STEP_ROWS, [0.9, 1, 1, 1, 6]))
    }
    assert verdict(both) == {"form": "float32", "from_rows": 16}  # the fastest at the biggest step wins


def test_the_timing_takes_turns_and_frees_the_copies(gguf, monkeypatch, one_thread):
    from lifeofprompt.model.attention import PagedKVCache

    model, _ = gguf
    monkeypatch.setattr(block_calibration, "BIG_STEP_ROWS", (2, 5))
    monkeypatch.setattr(block_calibration, "BIG_STEP_ROUNDS", 2)
    seen, forward = [], type(model).forward

    def spy(self, *args, **kwargs):
        seen.append((len(args[0]), copies.describe(self)))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    answer, why, record = block_calibration.big_step_choice(
        model, ["bfloat16"], PagedKVCache.for_model(model.config, 4, 16, model.dtype, "cpu")
    )
    one_round = [(2, "none"), (2, "bfloat16 from 1 rows"), (5, "none"), (5, "bfloat16 from 1 rows")]
    assert seen == one_round * 3  # a warm-up round, then two timed
    assert copies.copies_bytes(model) == 0
    assert set(answer) == {"form", "from_rows"} and "a 5-row step took" in why
    assert all(len(record["seconds"][way][rows]) == 2 for way in ("blocks", "bfloat16") for rows in (2, 5))


def test_the_setting_is_checked_and_auto_is_the_blocks_when_pinned(gguf, monkeypatch):
    from lifeofprompt import LLM
    from lifeofprompt.errors import ConfigError

    model, tokenizer = gguf
    with pytest.raises(ConfigError, match="big_step_weights='fp16' is not one of"):
        LLM(model, tokenizer=tokenizer, big_step_weights="fp16")
    log = lambda llm: [line for line in llm.engine.startup_log if line.startswith("big steps")]  # noqa: E731
    llm = LLM(model, tokenizer=tokenizer, cpu_tuning="linear", num_kv_blocks=16)  # auto, pinned
    assert log(llm) == ["big steps' layer matrices: the blocks at every size: the pinned path times nothing"]
    assert copies.copies_bytes(model) == 0
    llm = LLM(model, tokenizer=tokenizer, cpu_tuning="linear", num_kv_blocks=16, big_step_weights="bfloat16")
    assert log(llm) == ["big steps' layer matrices (+ 202.5 MiB): bfloat16 from 64 rows, as asked"]
    llm = LLM(model, tokenizer=tokenizer, cpu_tuning="linear", num_kv_blocks=16, big_step_weights="blocks")
    assert copies.copies_bytes(model) == 0  # the earlier engine's copies are not kept
    assert log(llm) == ["big steps' layer matrices: the blocks at every size: as asked"]


def test_auto_makes_no_copy_that_would_take_over_a_quarter_of_the_free_memory(gguf, monkeypatch):
    from lifeofprompt.cpu.speedups import CpuSpeedups
    from lifeofprompt.engine.config import EngineConfig

    model, _ = gguf
    monkeypatch.setattr(copies, "available_memory", lambda: 4 * 2**20 * 202)  # bf16 needs 202.5 MiB
    monkeypatch.setattr(block_calibration, "big_step_choice", lambda *args: pytest.fail("timed"))
    speedups = CpuSpeedups(model, EngineConfig(model, cpu_tuning="auto"))
    why = speedups.choose_big_step_weights()
    assert why == "the blocks at every size: a bfloat16 copy (202.5 MiB) would take over a quarter of the memory free"
    assert copies.copies_bytes(model) == 0


# ----------------------------------------------------------------------------- accuracy and tokens


def test_a_bf16_copy_moves_the_storys_margins_within_the_rule_and_an_fp8_one_does_not(gguf, one_thread):
    """The quick form of the rule, every row of the story's 201 through the copy (measured 0.25; fp8 1.6)."""
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, margin_shift

    model, tokenizer = gguf
    copies.drop_copies(model)
    reference = teacher_forced_rows(model, tokenizer, prompts=3)
    copies.make_copies(model, "bfloat16", from_rows=1)
    try:
        assert margin_shift(teacher_forced_rows(model, tokenizer, prompts=3), reference) <= MARGIN_SHIFT
        for module in copies.copy_layers(model):
            module.big_step_copy = module.big_step_copy.float().to(torch.float8_e4m3fn).to(torch.bfloat16)
        assert margin_shift(teacher_forced_rows(model, tokenizer, prompts=3), reference) > MARGIN_SHIFT
    finally:
        copies.drop_copies(model)


@pytest.mark.slow
def test_a_bf16_copy_passes_the_accuracy_rule(gguf):
    """All 778 teacher-forced rows of the parity prompts and the long text's 4,891 tokens through the copy,
    against the blocks' float products. Measured: 0.22 and +0.01%."""
    from lifeofprompt.lessons.agreement import margin_shift
    from lifeofprompt.lessons.perplexity import long_evaluation_text, perplexity

    model, tokenizer = gguf
    text = long_evaluation_text()
    copies.drop_copies(model)
    rows, ppl = teacher_forced_rows(model, tokenizer), perplexity(model, tokenizer, text)
    copies.make_copies(model, "bfloat16", from_rows=1)
    try:
        shift, copied = margin_shift(teacher_forced_rows(model, tokenizer), rows), perplexity(model, tokenizer, text)
    finally:
        copies.drop_copies(model)
    assert len(rows) == sum(len(tokenizer.encode(p)) + len(t) - 1 for p, t in PARITY.items())
    assert within_the_rule(shift, copied, ppl), (shift, copied / ppl - 1)


def test_the_engine_decodes_with_a_bf16_copy_as_with_the_blocks(gguf, story_ids, monkeypatch):
    """Every step of two rows or more (the three prompts' prefill, their decodes) through the copy."""
    from lifeofprompt import LLM, SamplingParams
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, assert_greedy_agrees, teacher_forced_logits, top2_margins

    model, tokenizer = gguf
    monkeypatch.setattr(copies, "ASKED_FROM_ROWS", 2)
    params = SamplingParams(max_tokens=16, temperature=0)
    runs = {}
    for kind in ("blocks", "bfloat16"):
        llm = LLM(model, tokenizer=tokenizer, cpu_tuning="linear", big_step_weights=kind, num_kv_blocks=64)
        assert (copies.copies_bytes(model) > 0) == (kind == "bfloat16")
        outputs = llm.generate([{"prompt_token_ids": i} for i in story_ids], params, use_tqdm=False)
        runs[kind] = [o.outputs[0].token_ids for o in outputs]
    copies.drop_copies(model)
    margins = [top2_margins(teacher_forced_logits(model, p, r)) for p, r in zip(story_ids, runs["blocks"])]
    assert_greedy_agrees(runs["bfloat16"], runs["blocks"], margins, MARGIN_SHIFT, min_steps=24)


@pytest.fixture(scope="module")
def gguf():
    from lifeofprompt import load_model

    return load_model("smollm2-135m", quantization="gguf")
