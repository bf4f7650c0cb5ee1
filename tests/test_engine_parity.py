"""Greedy parity with transformers' ``generate`` (EOS ignored), through ``LLM.generate``.

The embedded SmolLM2-135M on the CPU in fp32: the story's three prompts and eight more, 64 new
tokens each, all in ONE batch (so they share every decode step). transformers' tokens for all
eleven are pinned in ``tests/data/engine_parity_smollm2.json`` with the top-2 margin of every
step (made by ``tests/data/make_engine_parity.py``, one prompt at a time); transformers runs
live here for the story's three prompts, so the pin itself stays checked without paying 700
reference forwards on every test run.

Two different computations (ours batched and paged, transformers one prompt at a time; and
whatever kernels this CPU runs) agree up to rounding, so the tokens must be equal up to the
first step where transformers' best token led by no more than that rounding: from a near tie
on, either continuation is right (``lifeofprompt.lessons.agreement.assert_greedy_agrees``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lifeofprompt.lessons.agreement import (
    FP32_TOLERANCE,
    assert_argmax_agrees,
    assert_greedy_agrees,
    teacher_forced_logits,
    top2_margins,
)
from lifeofprompt.lessons.reference import hf_greedy
from lifeofprompt.story import STORY_PROMPTS

PROMPTS = [
    *STORY_PROMPTS,
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
ALL_STEPS = NEW_TOKENS * len(PROMPTS)


pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def engine_outputs(smollm2):
    from lifeofprompt import LLM, SamplingParams

    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=16, log_stats=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    steps = [r for r in llm.engine.step_records]
    return outputs, steps


@pytest.mark.slow
def test_one_batch_for_all_prompts(engine_outputs):
    outputs, steps = engine_outputs
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NEW_TOKENS] * len(PROMPTS)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    # every prompt was prefilled in the first step and all decoded together afterwards
    assert steps[0].num_seqs == len(PROMPTS)
    assert len(steps) == NEW_TOKENS


def test_the_pin_holds_its_margins():
    assert PINNED["new_tokens"] == NEW_TOKENS and list(PINNED["tokens"]) == PROMPTS == list(PINNED["margins"])
    assert all(len(PINNED["margins"][p]) == len(PINNED["tokens"][p]) == NEW_TOKENS for p in PROMPTS)
    # a handful of near ties among 704 steps, so the comparisons below see almost everything
    undecided = sum(m <= FP32_TOLERANCE for p in PROMPTS for m in PINNED["margins"][p])
    assert undecided <= 0.02 * ALL_STEPS, undecided


@pytest.mark.slow
def test_all_prompts_match_the_pinned_transformers_tokens(engine_outputs):
    outputs, _ = engine_outputs
    compared = assert_greedy_agrees(
        [o.outputs[0].token_ids for o in outputs],
        [PINNED["tokens"][p] for p in PROMPTS],
        [PINNED["margins"][p] for p in PROMPTS],
        FP32_TOLERANCE,
        min_steps=int(0.9 * ALL_STEPS),
    )
    assert compared[:3] == [NEW_TOKENS] * 3  # the story's prompts have no near tie in 64 steps


@pytest.mark.slow
def test_story_prompts_match_transformers_live(engine_outputs, smollm2, smollm2_reference):
    outputs, _ = engine_outputs
    _, tokenizer = smollm2
    live, margins = [], []
    for prompt, out in zip(PROMPTS[:3], outputs[:3]):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        live.append(hf_greedy(smollm2_reference, ids, NEW_TOKENS))
        margins.append(top2_margins(teacher_forced_logits(smollm2_reference, ids, live[-1])).tolist())
    ours = [o.outputs[0].token_ids for o in outputs[:3]]
    assert_greedy_agrees(ours, live, margins, FP32_TOLERANCE, min_steps=int(0.9 * 3 * NEW_TOKENS))
    # transformers on this CPU against transformers where the pin was made
    assert_greedy_agrees(
        live,
        [PINNED["tokens"][p] for p in PROMPTS[:3]],
        [PINNED["margins"][p] for p in PROMPTS[:3]],
        FP32_TOLERANCE,
        min_steps=int(0.9 * 3 * NEW_TOKENS),
    )


def test_margins_are_those_of_the_reference(smollm2, smollm2_reference):
    """The pinned margins are what transformers computes (to rounding): a stale file cannot decide steps."""
    _, tokenizer = smollm2
    prompt = PROMPTS[-1]
    logits = teacher_forced_logits(smollm2_reference, tokenizer.encode(prompt), PINNED["tokens"][prompt])
    assert_argmax_agrees(PINNED["tokens"][prompt], logits, FP32_TOLERANCE, min_decided=NEW_TOKENS - 4)
    torch.testing.assert_close(top2_margins(logits), torch.tensor(PINNED["margins"][prompt]), atol=1e-3, rtol=0)
