"""Weights kept as blocks: the embedded GGUF read as stored, float checkpoints quantized at load, the setting.

The GGUF's blocks and the dequantized fp32 folder hold the same numbers (transformers made the
folder from this file), so the first test demands equality, not closeness. The forwards then
differ only in the order fp32 sums run, which the margin rule of ``lessons/agreement.py`` covers.
"""

from __future__ import annotations

import pytest
import torch

from lifeofprompt import LLM, ConfigError, SamplingParams, load_model
from lifeofprompt.engine.config import EngineConfig, quantization_to_load
from lifeofprompt.lessons.agreement import BF16_TOLERANCE, assert_argmax_agrees
from lifeofprompt.model.quantized_linear import (
    LAYER_MATRICES,
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_model,
    weight_bytes,
)
from lifeofprompt.story import STORY_PROMPTS


@pytest.fixture(scope="module")
def gguf_model():
    return load_model("smollm2-135m", quantization="gguf")


def test_the_gguf_blocks_are_the_dequantized_folders_weights_exactly(gguf_model, smollm2):
    blocks, floats = gguf_model[0], smollm2[0]
    for i in (0, 13, 29):
        for name in LAYER_MATRICES:
            got = blocks.layers[i].get_submodule(name).blocks.dequantize()
            assert torch.equal(got, floats.layers[i].get_submodule(name).weight), (i, name)
        assert torch.equal(blocks.layers[i].input_layernorm.weight, floats.layers[i].input_layernorm.weight)
    assert torch.equal(blocks.lm_head.blocks.dequantize(), floats.lm_head.weight)
    assert isinstance(blocks.embed_tokens, QuantizedEmbedding)  # the tied table, read as blocks for both


def quantized_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every block matrix in ``model`` (a tied embedding counted once, with its head)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))


def test_the_gguf_model_holds_the_files_bytes(gguf_model):
    model = gguf_model[0]
    formats = {m.format for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert formats == {"q4_1", "q8_0"} and model.lm_head.format == "q8_0"
    assert 96_000_000 < quantized_weight_bytes(model) < 96_700_000  # the file's 96.6 MB, less its norms
    assert weight_bytes(model) < 0.2 * 538_000_000  # the fp32 copy's bytes


def test_block_forward_matches_the_dequantized_fp32_forward(gguf_model, smollm2, story_ids, one_thread):
    """Same numbers, other summation order: the argmax must agree wherever fp32's margin is clear of bf16's."""
    blocks, floats = gguf_model[0], smollm2[0]
    with torch.no_grad():
        for ids in story_ids:
            x = torch.tensor([ids])
            want, got = floats(x)[0], blocks(x)[0]
            assert (got - want).abs().max() < 1e-2 * want.abs().max()
            assert_argmax_agrees(got, want, BF16_TOLERANCE, min_decided=1)


def test_model_to_a_dtype_keeps_the_blocks_scales_in_fp16():
    model, _ = load_model("smollm2-135m", quantization="gguf")
    model.to(torch.bfloat16)
    head = model.lm_head
    assert head.scales.dtype == torch.float16 and head.quants.dtype == torch.int8 and model.dtype == torch.bfloat16
    assert model.embed_tokens(torch.tensor([1, 2])).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantize_at_load_swaps_every_matrix_and_keeps_the_rest(fmt):
    from tiny_models import build_tiny_model

    model = build_tiny_model()[0]
    before = {n: p.clone() for n, p in model.named_parameters() if "norm" in n}
    quantize_model(model, fmt)
    matrices = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(matrices) == 4 * model.config.num_layers + 1 and {m.format for m in matrices} == {fmt}
    for name, value in before.items():
        assert torch.equal(dict(model.named_parameters())[name], value)
    assert model.quantization == fmt


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(quantization="q5_0"), "'q8_0' or 'q4_1'"),
        (dict(model="tinyllama-1.1b-random", quantization="gguf"), "'q8_0' or 'q4_1'"),
        (dict(quantization="q8_0", tensor_parallel_size=2), "one process"),
    ],
)
def test_a_bad_quantization_is_a_config_error_before_anything_loads(settings, message, monkeypatch):
    import lifeofprompt.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(ConfigError, match=message) as raised:
        LLM(**settings)
    assert raised.value.param == "quantization"


def test_none_means_floats_and_auto_is_timed_only_where_the_cpu_is_tuned():
    assert EngineConfig.from_settings(quantization=None).quantization is None  # vLLM's None, not "the default"
    assert EngineConfig.from_settings().quantization == "auto"
    assert quantization_to_load(EngineConfig.from_settings(cpu_tuning="linear")) is None
    assert quantization_to_load(EngineConfig.from_settings(cpu_tuning="auto")) == "auto"
    assert quantization_to_load(EngineConfig.from_settings(cpu_tuning="auto", quantization="q8_0")) == "q8_0"


@pytest.mark.slow
def test_the_engine_on_blocks_says_so_and_decodes_the_story(one_thread):
    llm = LLM("smollm2-135m", quantization="gguf", cpu_tuning="off", log_stats=False)
    log = "\n".join(llm.engine.startup_log)
    assert "GGUF's own blocks" in log and "Q4_1 matrices x 120" in log and "quantization gguf (as asked)" in log
    assert llm.engine.resolved.quantization == "gguf"  # frozen with the other choices
    outputs = llm.generate(STORY_PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)


@pytest.mark.parametrize("blocks_s, floats_s, chosen", [(0.010, 0.020, "gguf"), (0.030, 0.020, None)])
def test_auto_keeps_the_blocks_only_where_they_timed_faster(blocks_s, floats_s, chosen, monkeypatch, tmp_path):
    from lifeofprompt.cpu import block_calibration
    from lifeofprompt.model.loader import resolve_quantization

    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))  # a fresh cache: measured, not read
    monkeypatch.setattr(block_calibration, "fastest_float_step", lambda model, others=(): (floats_s, [blocks_s]))
    monkeypatch.setattr("lifeofprompt.cpu.interleaved_blocks.integer_on_offer", lambda model: False)
    monkeypatch.setattr("lifeofprompt.model.loader.load_weights", lambda *a: (None, None))
    quantization, why = resolve_quantization("smollm2-135m", torch.device("cpu"), "auto")
    assert quantization == chosen and f"{blocks_s * 1e3:.1f} ms with the GGUF's blocks" in why
    assert resolve_quantization("tinyllama-1.1b-random", torch.device("cpu"), "auto")[0] is None


def test_the_calibrations_runs_take_turns_step_by_step(monkeypatch):
    """GGUF blocks against fp32 is decided by medians taken in alternation: a burst of load from elsewhere
    then slows every run alike, where timing one run after the other could hand the verdict to the burst."""
    from lifeofprompt.cpu import block_calibration

    calls = []

    class Fake:
        cpu_step = None

        def __init__(self, name):
            self.name = name

        def __call__(self, *inputs):  # the way it runs: its C step's layout while timed, else the torch layers
            calls.append((self.name, self.cpu_step.unmeasured if self.cpu_step else "torch"))

    monkeypatch.setattr(block_calibration, "one_row_step", lambda model: ())
    monkeypatch.setattr("lifeofprompt.cpu.huge_pages.move_weights_to_huge_pages", lambda model: None)
    runs = [(Fake("fp32"), "packed"), (Fake("fp32"), "torch"), (Fake("blocks"), "row-major")]
    seconds = block_calibration.interleaved_step_seconds(runs)
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    rounds = block_calibration.ROUNDS + 2
    assert calls == [("fp32", "packed"), ("fp32", "torch"), ("blocks", "row-major")] * rounds


def dequantized_twin(model):
    """A float copy of a block model: every ``QuantizedLinear`` replaced by a ``Linear`` of its dequantized weights."""
    import copy

    from lifeofprompt.model.linear import Linear

    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = Linear(module.in_features, module.out_features, bias=False)
            linear.weight.data = module.blocks.dequantize()
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, attr, linear)
    if isinstance(twin.embed_tokens, QuantizedEmbedding):
        twin.embed_tokens = torch.nn.Embedding.from_pretrained(twin.lm_head.weight)
    return twin


def test_the_engine_on_the_c_step_with_blocks_decodes_the_fp32_engines_tokens(gguf_model, smollm2, story_ids):
    """Same weights, another summation order: greedy tokens equal up to the first step within bf16's margin."""
    from lifeofprompt.lessons.agreement import assert_greedy_agrees, teacher_forced_logits, top2_margins

    params = SamplingParams(max_tokens=16, temperature=0)
    runs = {}
    for name, (model, tokenizer) in {"blocks": gguf_model, "fp32": smollm2}.items():
        llm = LLM(model, tokenizer=tokenizer, cpu_tuning="c-step", num_kv_blocks=64, max_num_seqs=4, log_stats=False)
        assert llm.engine.runner.speedups.c_step_rows >= 3  # the story's three decodes go through the C step
        runs[name] = [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in story_ids], params)
        ]
    margins = [top2_margins(teacher_forced_logits(smollm2[0], p, r)) for p, r in zip(story_ids, runs["fp32"])]
    assert_greedy_agrees(runs["blocks"], runs["fp32"], margins, BF16_TOLERANCE, min_steps=24)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_tinyllama_quantized_at_load_decodes_as_its_dequantized_twin(fmt):
    """TinyLlama's shapes (random weights) through the engine's C step on blocks, against the same blocks dequantized
    to fp32: only the summation order differs, so fp32's tolerance applies (``agreement.FP32_TOLERANCE``)."""
    from lifeofprompt.lessons.agreement import FP32_TOLERANCE, teacher_forced_logits

    llm = LLM("tinyllama-1.1b-random", quantization=fmt, cpu_tuning="c-step", num_kv_blocks=16, log_stats=False)
    model = llm.engine.model
    assert model.lm_head.format == fmt and "RANDOM" in model.source
    prompt = llm.engine.tokenizer.encode("hi my name is")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0))
    tokens = out[0].outputs[0].token_ids
    reference = teacher_forced_logits(dequantized_twin(model), prompt, tokens)
    assert_argmax_agrees(tokens, reference, FP32_TOLERANCE, min_decided=4)
