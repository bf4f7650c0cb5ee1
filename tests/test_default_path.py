"""The embedded engine as users get it, ``LLM()`` with its defaults, checked token by token.

The rest of the suite pins one CPU matrix-product path (``conftest.py`` sets ``LIFEOFPROMPT_CPU_TUNING``),
so that its tokens never depend on a start-up timing; with a pinned path, ``quantization="auto"`` loads
floats. Users get ``cpu_tuning="auto"`` instead: the weights stay as the GGUF's blocks where a timed step
says they are faster, the C step takes the small steps where it wins, decode attention reads the pool in
C where that was faster. Here that engine, and the same engine with the blocks forced (so the block path is
checked even on a machine whose timing picks floats), must agree with the fp32 model, which holds the
same weights dequantized: the block kernels multiply fp32 activations by weights unpacked bit for bit, so
the two differ only in the order of their sums. Both the greedy tokens (under the margin rule) and each
step's top-2 margin (from the logprobs the engine returns) are compared.
"""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_argmax_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.story import STORY_PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.numerics]
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=["auto", "gguf"], ids=["as-users-get-it", "blocks-forced"])
def default_llm(request):
    """``LLM(quantization=...)``, everything else left to its default (the pinned path lifted)."""
    from lifeofprompt import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
        llm = LLM(quantization=request.param)
    yield llm
    llm.shutdown()


def top2_margin_of(entry: dict) -> float:
    """The best logprob minus the second best, from a step's logprobs (top 2 and the chosen token)."""
    best, second = sorted(entry.values(), reverse=True)[:2]
    return best - second


def test_the_default_engine_picks_what_the_fp32_model_picks(default_llm, smollm2):
    model, _ = smollm2
    resolved = default_llm.engine.resolved
    assert resolved.cpu is not None and resolved.cpu.tuning == "auto"
    if default_llm.engine.config.quantization == "gguf":
        assert resolved.quantization == "gguf"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    decided = 0
    for out in default_llm.generate(list(STORY_PROMPTS), params):
        ids = list(out.outputs[0].token_ids)
        reference = teacher_forced_logits(model, out.prompt_token_ids, ids)
        decided += assert_argmax_agrees(ids, reference, FP32_TOLERANCE, min_decided=0)
        ours = torch.tensor([top2_margin_of(entry) for entry in out.outputs[0].logprobs])
        moved = (ours - top2_margins(reference)).abs().max().item()
        assert moved < FP32_TOLERANCE, f"{out.prompt!r}: a top-2 margin moved by {moved:.3g}"
    assert decided >= 0.9 * len(STORY_PROMPTS) * MAX_TOKENS
