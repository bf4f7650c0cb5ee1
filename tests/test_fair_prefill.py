"""Fair chunked prefill: a long prompt takes at most ``long_prefill_token_threshold`` tokens of a step
while anyone else waits or runs, so a short request's first token comes the step after it arrives,
and its decodes go on beside the long prefill. Counted in steps, not seconds.

Before, running prompt chunks took the whole budget first: a short request waited for the whole
rest of the long prefill (18.6 s beside an 8,100-token prompt, against 0.09 s idle).
"""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model

from lifeofprompt.engine.config import MIN_FAIR_CHUNK, fair_prefill_threshold
from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import ConfigError

BUDGET = 256
LONG = [5 + (i * 7) % 250 for i in range(1000)]


@pytest.fixture(scope="module")
def model_2k():
    return build_tiny_model(max_position_embeddings=2048)


def engine(model_2k, **kwargs):
    model, tokenizer = model_2k
    return LLMEngine(
        model,
        tokenizer=tokenizer,
        num_kv_blocks=160,
        max_num_batched_tokens=BUDGET,
        log_stats=False,
        check_invariants=True,
        **kwargs,
    )


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
    assert fair.scheduler.config.long_prefill_token_threshold == BUDGET // 4 == 64
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
    assert fair_prefill_threshold(None, 8) is None  # a lesson's tiny budget: plain chunked prefill
    assert fair_prefill_threshold(0, 2048) is None and fair_prefill_threshold(300, 2048) == 300
    with pytest.raises(ConfigError):
        fair_prefill_threshold(-1, 2048)


# ----------------------------------------------------------------------------- the lesson's measurement


def test_the_lesson_measures_the_short_request_beside_the_long_one(model_2k):
    """lessons/fair_prefill.short_beside_long (chapter 09, benchmarks/fair_prefill.py): the same
    step counts as above, each step's tokens per request, and a TTFT inside the steps that gave it."""
    from lifeofprompt.lessons.fair_prefill import short_beside_long, synthetic_ids

    short = synthetic_ids(256, 5, stride=13)
    off = short_beside_long(engine(model_2k, long_prefill_token_threshold=0), LONG, short)
    on = short_beside_long(engine(model_2k), LONG, short)
    assert (off.threshold, on.threshold) == (None, 64)
    assert (off.steps_to_first_token, on.steps_to_first_token) == (3, 1)
    assert [s.long_tokens for s in off.spans[:4]] == [BUDGET, BUDGET, BUDGET, 1000 - 3 * BUDGET]
    assert [s.long_tokens for s in on.spans[:2]] == [BUDGET, 64] and on.spans[1].short_tokens == 5
    for run in (off, on):
        assert sum(s.long_tokens for s in run.spans) == len(LONG)  # max_tokens=1: the prefill gives it
        assert sum(s.short_tokens for s in run.spans) == 5 + 3  # prompt, then 3 decodes of 4 tokens
        assert run.spans[0].start_s >= 0 and all(a.end_s <= b.start_s for a, b in zip(run.spans, run.spans[1:]))
        arrival_step = run.after_arrival[0]
        assert run.short_arrival_s <= arrival_step.start_s
        given = run.after_arrival[run.steps_to_first_token - 1]
        assert arrival_step.start_s - run.short_arrival_s <= run.ttft_s <= given.end_s - run.short_arrival_s + 1e-9
        assert run.as_dict()["steps_to_first_token"] == run.steps_to_first_token
        assert run.first_token_step_s == given.duration_s
        assert run.long_first_token_s == pytest.approx(
            next(
                s.end_s
                for s in run.spans
                if s.long_tokens and sum(x.long_tokens for x in run.spans if x.end_s <= s.end_s) == len(LONG)
            )
        )


def test_the_lesson_can_stop_the_long_prompt_once_the_short_one_is_done(model_2k):
    from lifeofprompt.lessons.fair_prefill import short_alone, short_beside_long

    fair = engine(model_2k)
    run = short_beside_long(fair, LONG, [10, 11, 12], finish=False)
    assert sum(s.long_tokens for s in run.spans) < len(LONG) and run.long_first_token_s is None  # aborted mid-prefill
    assert not fair.has_unfinished_requests() and fair.block_manager.num_free_blocks == fair.num_kv_blocks
    assert short_alone(fair, [20, 21, 22]) > 0


def test_the_fair_prefill_figure_draws_every_step_and_both_waits(model_2k):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lifeofprompt.figures.serving import plot_fair_prefill
    from lifeofprompt.lessons.fair_prefill import short_beside_long

    off = short_beside_long(engine(model_2k, long_prefill_token_threshold=0), LONG, [10, 11, 12])
    on = short_beside_long(engine(model_2k), LONG, [10, 11, 12], finish=False)
    fig = plot_fair_prefill(off, on, alone_s=0.01, label="machine X")
    timeline, waits = fig.axes
    assert any(t.get_text() == "machine X" for t in fig.texts)
    assert len(timeline.collections) == len(off.spans) + len(on.spans)  # one box per step
    assert [b.get_height() for b in waits.patches] == [0.01, off.ttft_s, on.ttft_s]
    assert any(f"TTFT {off.ttft_s:.2f} s" in t.get_text() for t in timeline.texts)
    plt.close(fig)
