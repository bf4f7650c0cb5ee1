"""Async scheduling on the embedded model: the same answers with it on as off, and the rules that turn it off.

Each test runs the same requests through two engines on the same model, ``async_scheduling`` on and
off, and compares what the user gets: tokens, finish reasons, texts, logprobs. Greedy tokens are
compared under the margin rule (``lessons/agreement.py``): where the two differ, the first difference
must fall on a step the model left undecided.
"""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model

from lifeofprompt.engine import llm_engine
from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.structured_output import StructuredOutputsParams
from lifeofprompt.errors import ConfigError
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.story import STORY_PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")


def engines(smollm2, **settings):
    model, tokenizer = smollm2
    settings.setdefault("num_kv_blocks", 64)  # a small pool starts fast
    return [
        LLMEngine(model, tokenizer=tokenizer, log_stats=False, check_invariants=True, async_scheduling=on, **settings)
        for on in (True, False)
    ]


def run(engine, requests, abort_after=None) -> dict:
    """Every request's final output; ``abort_after``: (request id, tokens streamed before it is aborted)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if abort_after and out.request_id == abort_after[0] and len(out.outputs[0].token_ids) >= abort_after[1]:
                engine.abort(out.request_id)
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 2_000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
    return done


def assert_same_greedy(smollm2, on: dict, off: dict, min_steps: int) -> None:
    """The answers agree token by token wherever the model decided the token (the margin rule)."""
    model, tokenizer = smollm2
    got, want, margins = [], [], []
    for rid, reference in off.items():
        for a, b in zip(on[rid].outputs, reference.outputs):
            got.append(list(a.token_ids))
            want.append(list(b.token_ids))
            if got[-1] != want[-1]:  # only a difference needs the margins
                prompt = tokenizer.encode(on[rid].prompt) if on[rid].prompt else on[rid].prompt_token_ids
                margins.append(top2_margins(teacher_forced_logits(model, prompt, want[-1])).tolist())
            else:
                margins.append([float("inf")] * len(want[-1]))
    assert_greedy_agrees(got, want, margins, FP32_TOLERANCE, min_steps=min_steps)


def story(params) -> list:
    return [(str(i), p, params) for i, p in enumerate(STORY_PROMPTS)]


@pytest.mark.slow  # 7 s; the property test stops, ends on length and on stop tokens (tiny model, quick tier)
def test_greedy_story_with_eos_max_tokens_and_a_stop_string(smollm2):
    on, off = engines(smollm2)
    plain = run(off, [("0", STORY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))])
    stop = plain["0"].outputs[0].text[10:18]  # a stop string the first answer reaches mid-way
    requests = [  # a stop string, the model's EOS, max_tokens
        ("0", STORY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, stop=[stop])),
        ("1", STORY_PROMPTS[1], SamplingParams(temperature=0, max_tokens=48)),
        ("2", STORY_PROMPTS[2], SamplingParams(temperature=0, max_tokens=12)),
    ]
    a, b = run(on, requests), run(off, requests)
    assert_same_greedy(smollm2, a, b, min_steps=25)
    for rid in b:
        assert a[rid].outputs[0].text == b[rid].outputs[0].text
        assert a[rid].outputs[0].finish_reason == b[rid].outputs[0].finish_reason
    assert a["0"].outputs[0].finish_reason == "stop" and stop not in a["0"].outputs[0].text
    assert [o.outputs[0].finish_reason for o in a.values()].count("length") == 1
    assert a["1"].outputs[0].token_ids[-1] in on.eos_token_ids
    assert plain["0"].outputs[0].text.startswith(a["0"].outputs[0].text + stop)  # cut right before the stop
    assert len(a["0"].outputs[0].token_ids) <= len(plain["0"].outputs[0].token_ids)  # no token past it
    assert all(len(o.metrics.token_times) == len(o.outputs[0].token_ids) for o in a.values())


@pytest.mark.slow  # 8 s; the property test and the greedy tests keep the bookkeeping in the quick tier
def test_seeded_samples_n_2_min_tokens_penalties_and_logprobs(smollm2):
    on, off = engines(smollm2)
    params = SamplingParams(
        n=2, temperature=0.8, seed=7, max_tokens=24, min_tokens=6, repetition_penalty=1.2, logprobs=2
    )
    a, b = run(on, story(params)), run(off, story(params))
    for rid in b:
        for x, y in zip(a[rid].outputs, b[rid].outputs):
            assert x.token_ids == y.token_ids and len(x.token_ids) >= 6
            assert [lp[t] for lp, t in zip(x.logprobs, x.token_ids)] == pytest.approx(
                [lp[t] for lp, t in zip(y.logprobs, y.token_ids)], abs=1e-4
            )


@pytest.mark.slow  # 4 s; the property test aborts mid-stream on the tiny model in the quick tier
def test_an_abort_mid_stream_leaves_the_others_unchanged(smollm2):
    on, off = engines(smollm2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = run(on, story(params), abort_after=("1", 5))
    b = run(off, story(params), abort_after=("1", 5))
    assert a["1"].outputs[0].finish_reason == "abort" == b["1"].outputs[0].finish_reason
    assert a["1"].outputs[0].token_ids == b["1"].outputs[0].token_ids  # aborted after the same token
    assert_same_greedy(smollm2, {k: a[k] for k in "02"}, {k: b[k] for k in "02"}, min_steps=35)


@pytest.mark.slow  # 6 s; the property test preempts on the tiny model in the quick tier
def test_preemption_under_a_tight_pool(smollm2):
    on, off = engines(smollm2, num_kv_blocks=9, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    a, b = run(on, story(params)), run(off, story(params))
    assert on.scheduler.num_preemptions > 0 and off.scheduler.num_preemptions > 0
    assert_same_greedy(smollm2, a, b, min_steps=40)


def test_a_grammar_walks_the_sampled_tokens(smollm2):
    on, off = engines(smollm2)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=8, structured_outputs=choice)
    a, b = run(on, story(params)), run(off, story(params))
    for rid in b:
        assert a[rid].outputs[0].text == b[rid].outputs[0].text and a[rid].outputs[0].text in ("yes", "no", "maybe")


@pytest.mark.slow  # 2 s; the property test mixes prompt-scoring requests in on the tiny model in the quick tier
def test_a_request_scoring_its_prompt_runs_its_steps_one_at_a_time(smollm2):
    on, off = engines(smollm2)
    requests = story(SamplingParams(temperature=0, max_tokens=12)) + [
        ("p", STORY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    ]
    a, b = run(on, requests), run(off, requests)
    scored = [r for r in on.step_records if r.launch.mode == "eager, prompt rows scored"]
    assert scored and all(r.forward_times is None for r in scored)  # run as plain steps
    assert len(a["p"].prompt_logprobs) == len(b["p"].prompt_logprobs)
    for x, y in zip(a["p"].prompt_logprobs[1:], b["p"].prompt_logprobs[1:]):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert_same_greedy(smollm2, a, b, min_steps=30)


def test_on_as_asked_off_on_a_cpu_and_said_why(smollm2):
    model, tokenizer = smollm2
    default = LLMEngine(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=16)  # pinned tuning: off, untimed
    assert default.overlap is None and "async scheduling off: not timed on this CPU" in "\n".join(default.startup_log)
    asked = LLMEngine(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=16, async_scheduling=True)
    assert asked.overlap is not None and "async scheduling on: as asked" in "\n".join(asked.startup_log)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    spec = LLMEngine(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=16, speculative_config=ngram)
    assert spec.overlap is None and "async scheduling off: speculative decoding" in "\n".join(spec.startup_log)
    with pytest.raises(ConfigError, match="async_scheduling=True does not work with speculative decoding"):
        LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=16, async_scheduling=True, speculative_config=ngram)
    with pytest.raises(ConfigError, match="async_scheduling must be True, False or None"):
        LLMEngine(model, tokenizer=tokenizer, log_stats=False, async_scheduling="yes")
    off = LLMEngine(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=16, async_scheduling=False)
    assert off.overlap is None and "async scheduling off: as asked" in "\n".join(off.startup_log)


def tiny_auto_engine(**settings) -> LLMEngine:
    model, tokenizer = build_tiny_model()
    return LLMEngine(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=32, cpu_tuning="auto", **settings)


def test_a_cpu_times_both_ways_at_start_up_and_keeps_the_faster(monkeypatch, tmp_path):
    """With the CPU tuning on, the engine times a decode with async scheduling on and off, in turns (one
    warm-up each, then three pairs), keeps the faster, says so, and the next start reads the cache."""
    calls = []

    def fake(seconds_on, seconds_off):
        def time_decode(engine, on):
            calls.append(on)
            return seconds_on if on else seconds_off

        return time_decode

    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path / "on"))
    monkeypatch.setattr(llm_engine, "time_decode", fake(0.010, 0.020))
    faster_on = tiny_auto_engine()
    assert calls == [False, True] + [True, False] * 3
    assert faster_on.overlap is not None
    assert "async scheduling on: timed here, one request's decode at 10.00 ms a token on and 20.00 ms off" in (
        "\n".join(faster_on.startup_log)
    )
    calls.clear()
    again = tiny_auto_engine()  # cached: nothing timed
    assert calls == [] and again.overlap is not None and again.async_scheduling_why == faster_on.async_scheduling_why
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path / "off"))
    monkeypatch.setattr(llm_engine, "time_decode", fake(0.021, 0.020))
    faster_off = tiny_auto_engine()
    assert faster_off.overlap is None and faster_off.async_scheduling_why.startswith("off: timed here")
    asked = tiny_auto_engine(async_scheduling=False)  # a setting given: nothing timed
    assert asked.async_scheduling_why == "off: as asked"


def test_the_timing_runs_both_loops_and_leaves_the_engine_as_new(monkeypatch, tmp_path):
    """The real timing on the tiny model: both ways decode, and the engine starts empty after it (no request,
    block, cached prefix or trace left) and answers as an untimed engine does."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    timed = tiny_auto_engine()
    assert "timed here" in timed.async_scheduling_why
    bm = timed.block_manager
    assert not timed.requests and not timed.step_records and timed.scheduler.seqs == []
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks == 0 and bm.hits == bm.misses == 0
    untimed = tiny_auto_engine(async_scheduling=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = (run(e, [("x", [5, 6, 7, 8], params)]) for e in (timed, untimed))
    assert a["x"].outputs[0].token_ids == b["x"].outputs[0].token_ids


def test_the_next_step_is_planned_while_this_one_runs(smollm2):
    """The trace shows the overlap: each step was planned before the forward of the step before it had
    ended, and the forwards never overlap each other."""
    on, _ = engines(smollm2)
    run(on, story(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    records = [r for r in on.step_records if r.forward_times is not None]
    assert len(records) >= 15
    pairs = list(zip(records, records[1:]))
    assert all(after.forward_times[0] >= before.forward_times[1] for before, after in pairs)
    planned_during = sum(after.scheduled_time < before.forward_times[1] for before, after in pairs)
    assert planned_during >= 0.8 * len(pairs)


def test_the_rule_on_a_gpu_and_with_each_feature_that_turns_it_off():
    from types import SimpleNamespace

    from lifeofprompt.engine.async_scheduling import choose
    from lifeofprompt.engine.config import EngineConfig

    def resolved(device="cuda:0", graphs=False, stages=1):
        return SimpleNamespace(device=device, cuda_graphs=graphs, pipeline_parallel_size=stages)

    auto = EngineConfig()
    assert choose(auto, resolved(), None, None)[0] is True  # a GPU, eager: on
    assert choose(auto, resolved("cpu"), None, None)[0] is False  # a CPU: off unless asked
    assert choose(auto, resolved(graphs=True), None, None) == (
        False,
        "off: CUDA graphs (the next step's inputs would be written while a replay reads them)",
    )
    assert "pipeline stages" in choose(auto, resolved(stages=2), None, None)[1]
    assert "tensor-parallel" in choose(auto, resolved(), None, object())[1]
    assert "speculative" in choose(auto, resolved(), object(), None)[1]
    with pytest.raises(ConfigError, match="pipeline stages"):
        choose(EngineConfig(async_scheduling=True), resolved(stages=2), None, None)


def test_the_serve_flag_sets_it_either_way():
    from lifeofprompt.cli import build_parser
    from lifeofprompt.commands import engine_settings

    def settings(*flags):
        return engine_settings(build_parser().parse_args(["serve", *flags]))

    assert settings("--async-scheduling")["async_scheduling"] is True
    assert settings("--no-async-scheduling")["async_scheduling"] is False
    assert "async_scheduling" not in settings()  # left to the engine's rule
