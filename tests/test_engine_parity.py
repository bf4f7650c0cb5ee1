"""Greedy token-exact parity with transformers' ``generate`` (EOS ignored), through ``LLM.generate``.

The embedded SmolLM2-135M on the CPU in fp32: the story's three prompts and eight more, 64 new
tokens each, all in ONE batch (so they share every decode step). transformers' tokens for all
eleven are pinned in ``tests/data/engine_parity_smollm2.json`` (made with
``lifeofprompt.lessons.reference.hf_greedy``, one prompt at a time); transformers runs live here for the
story's three prompts, so the pin itself stays checked without paying 700 reference forwards
on every test run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifeofprompt.lessons.reference import hf_greedy

PROMPTS = [
    "hi my name is",
    "today is a beautiful summer day",
    "hello there",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "Translate to French: cheese",
    "The three primary colors are",
    "Q: What is the boiling point of water?\nA:",
    "Paged attention stores the KV cache in blocks so that",
]
NEW_TOKENS = 64

PINNED = json.loads((Path(__file__).parent / "data" / "engine_parity_smollm2.json").read_text())


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine_outputs(smollm2):
    from lifeofprompt import LLM, SamplingParams

    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=16, log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    steps = [r for r in llm.engine.step_records]
    return outputs, steps


def test_one_batch_for_all_prompts(engine_outputs):
    outputs, steps = engine_outputs
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NEW_TOKENS] * len(PROMPTS)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    # every prompt was prefilled in the first step and all decoded together afterwards
    assert len(steps[0].seqs) == len(PROMPTS)
    assert len(steps) == NEW_TOKENS


def test_all_prompts_match_the_pinned_transformers_tokens(engine_outputs):
    outputs, _ = engine_outputs
    assert PINNED["new_tokens"] == NEW_TOKENS and list(PINNED["tokens"]) == PROMPTS
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == PINNED["tokens"][prompt], prompt


def test_story_prompts_match_transformers_live(engine_outputs, smollm2, smollm2_reference):
    outputs, _ = engine_outputs
    _, tokenizer = smollm2
    for prompt, out in zip(PROMPTS[:3], outputs[:3]):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(smollm2_reference, ids, NEW_TOKENS), prompt
