"""Every greedy continuation that a test or a checked notebook cell compares exactly is decided.

Those comparisons set two computations side by side (a batch against one prompt, paged against
contiguous, prefix caching on against off, static against continuous batching, the server's
batches against ``LLM.generate``), or a pinned list against whatever kernels this CPU runs. Two
fp32 computations differ by rounding, under 1e-4 in a logit here; so an exact comparison is
sound exactly when, at every step, the best token leads the second by more than
``FP32_TOLERANCE``. This file checks that for each continuation compared exactly; a comparison
that includes a near tie uses ``lifeofprompt.lessons.agreement`` instead (tests/test_paged_model.py,
tests/test_engine.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifeofprompt.engine.llm import render_chat
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_argmax_agrees, teacher_forced_logits
from lifeofprompt.story import STORY_PROMPTS

PARITY = json.loads((Path(__file__).parent / "data" / "engine_parity_smollm2.json").read_text())
STORY = list(STORY_PROMPTS)
SEASIDE = (
    "You are a cheerful assistant for a small seaside town. Answer every question in one "
    "short, friendly sentence, and never make up facts you do not know.\n"
)

# (where it is compared, the prompt: text or a chat conversation, the greedy tokens)
CONTINUATIONS = [
    ("test_llm_api: LLM.chat", [{"role": "user", "content": "What is 2+2?"}], [504, 2988, 288, 451]),
    (
        "test_server: chat through the server's batches",
        [{"role": "user", "content": "hello there"}],
        [19556, 665, 17, 1073, 416, 339, 4237, 346],
    ),
    ("chapter 07: paged trace and generate_cached", "the weather is", [253, 1109, 970, 288, 820, 253, 1407, 327]),
    ("chapter 07: prefix caching on and off", SEASIDE + STORY[0], [1102, 6743, 1102, 6743]),
    ("chapter 07: prefix caching on and off", SEASIDE + STORY[1], [281, 260, 14339, 489]),
    ("chapter 07: prefix caching on and off", SEASIDE + STORY[2], [28, 198, 198, 57]),
    (
        "chapter 08: static and continuous batching",
        "the capital of france is",
        [216, 34, 33, 32, 32, 32, 32, 32, 32, 32, 32, 32],
    ),
    ("chapter 08: static and continuous batching", "once upon a time", [28, 339, 436]),
    (
        "chapter 08: static and continuous batching",
        "my favourite food is",
        [253, 3412, 282, 1062, 28, 339, 5248, 253, 2066, 10136, 282, 7423, 13964, 28],
    ),
    ("chapter 08: static and continuous batching", "the best way to learn is", [288, 1120, 351, 260, 10152]),
    (
        "chapter 08: static and continuous batching",
        "in the morning i",
        [446, 216, 33, 28, 260, 8746, 282, 2967, 253, 216],
    ),
]

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


def test_the_story_pins_are_decided_at_every_step():
    """The story's 64-token pins (transformers' margins): the first tokens of every story test and cell."""
    for prompt in STORY:
        margins = PARITY["margins"][prompt]
        assert len(margins) == 64 and min(margins) > FP32_TOLERANCE, (prompt, min(margins))


@pytest.mark.parametrize(
    "where, prompt, tokens",
    CONTINUATIONS,
    ids=[f"{where.split(':')[0]}-{k}" for k, (where, _, _) in enumerate(CONTINUATIONS)],
)
def test_other_continuations_are_decided_at_every_step(smollm2, where, prompt, tokens):
    model, tokenizer = smollm2
    ids = render_chat(tokenizer, prompt)[1] if isinstance(prompt, list) else tokenizer.encode(prompt)
    rows = teacher_forced_logits(model, ids, tokens)
    assert_argmax_agrees(tokens, rows, FP32_TOLERANCE, min_decided=len(tokens))
