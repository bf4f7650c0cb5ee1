"""Fair chunked prefill: a long prompt takes at most ``long_prefill_token_threshold`` tokens of a step
while anyone else waits or runs, so a short request's first token comes the step after it arrives,
and its decodes go on beside the long prefill. Counted in steps, not seconds.

Before, running prompt chunks took the whole budget first: a short request waited for the whole
rest of the long prefill (18.6 s beside an 8,100-token prompt, against 0.09 s idle).
"""

from __future__ import annotations

import pytest

from tiny_models import build_tiny_model
from lifeofprompt.engine.llm_engine import MIN_FAIR_CHUNK, LLMEngine, fair_prefill_threshold
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import ConfigError

BUDGET = 256
LONG = [5 + (i * 7) % 250 for i in range(1000)]


@pytest.fixture(scope="module")
def model_2k():
    return build_tiny_model(max_position_embeddings=2048)


def engine(model_2k, **kwargs):
    model, tokenizer = model_2k
    return LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=160, max_num_batched_tokens=BUDGET, log_stats=False,
                     check_invariants=True, **kwargs)


def short_beside_long(eng) -> tuple[int, list[int]]:
    """The long prompt prefills alone for one step, then a short request arrives: the steps until
    the short one's first token, and the long prompt's chunk in each step until then."""
    eng.add_request("long", LONG, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    eng.add_request("short", [10, 11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    steps, chunks = 0, []
    while True:
        steps += 1
        outputs = {o.request_id: o for o in eng.step()}
        record = eng.step_records[-1]
        chunks += [r.num_tokens for r in record.scheduled if r.request_id == "long"]
        if "short" in outputs and outputs["short"].outputs[0].token_ids:
            break
        assert steps < 20
    return steps, chunks


def test_a_short_request_gets_its_first_token_the_next_step(model_2k):
    fair = engine(model_2k)
    assert fair.scheduler.long_prefill_token_threshold == BUDGET // 4 == 64
    steps, chunks = short_beside_long(fair)
    assert steps == 1 and chunks == [64], (steps, chunks)
    # and its decodes go on, one token a step, while the long prompt still prefills
    decoded = 0
    while fair.requests["long"].completions[0].seq.num_computed_tokens < len(LONG) - 64:
        outputs = {o.request_id: o for o in fair.step()}
        decoded += len(outputs["short"].outputs[0].new_token_ids) if "short" in outputs else 0
        if fair.requests.get("short") is None:
            break
    assert decoded >= 6
    fair.run_until_done()


def test_without_the_threshold_the_short_request_waits_for_the_whole_prefill(model_2k):
    unfair = engine(model_2k, long_prefill_token_threshold=0)
    steps, chunks = short_beside_long(unfair)
    assert steps == 3 and chunks == [BUDGET, BUDGET, 1000 - 3 * BUDGET], (steps, chunks)
    unfair.run_until_done()


def test_a_lone_prompt_keeps_the_whole_budget(model_2k):
    fair = engine(model_2k)
    fair.add_request("long", LONG, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    fair.run_until_done()
    prefill = [r.num_tokens for rec in fair.step_records for r in rec.scheduled if r.kind != "decode"]
    assert prefill == [BUDGET, BUDGET, BUDGET, 1000 - 3 * BUDGET]


def test_the_default_threshold():
    assert fair_prefill_threshold(None, 2048) == 512
    assert fair_prefill_threshold(None, 100) == MIN_FAIR_CHUNK
    assert fair_prefill_threshold(None, 8) is None           # a lesson's tiny budget: plain chunked prefill
    assert fair_prefill_threshold(0, 2048) is None and fair_prefill_threshold(300, 2048) == 300
    with pytest.raises(ConfigError):
        fair_prefill_threshold(-1, 2048)
