"""LLMEngine on the real embedded model (CPU, fp32): greedy tokens do not depend on the company a
request keeps — alone, in a crowded batch, chunked, or preempted and recomputed — and no block leaks."""

from __future__ import annotations

import threading
import time

import pytest

from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import QueueFullError, RequestTooLargeError
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_argmax_agrees, teacher_forced_logits

# Greedy continuations of the story's prompts (SmolLM2-135M-Instruct, fp32, EOS ignored), pinned. Every step
# is decided far beyond fp32 rounding (tests/test_pins.py), so any batch, chunking or CPU must give them exactly.
STORY_NEXT = [
    [2026, 365, 10905, 6176, 28, 4836],  # "hi my name is" -> "... (pausing,"
    [281, 260, 216, 34, 33, 302],  # "today is a beautiful summer day" -> " in the 21st"
    [506, 787, 737, 288, 536, 357],  # "hello there" -> "'s no need to do"
]


def make_engine(smollm2, **kwargs):
    model, tokenizer = smollm2
    kwargs.setdefault("num_kv_blocks", 32)
    return LLMEngine(model, tokenizer=tokenizer, log_stats=False, check_invariants=True, **kwargs)


def greedy(n, **kwargs):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


def run(engine, requests):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    return {o.request_id: o for o in engine.run_until_done()}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.numerics
def test_alone_matches_the_pinned_tokens(smollm2, story_ids):
    engine = make_engine(smollm2)
    out = run(engine, [("alone", story_ids[0], greedy(6))])["alone"]
    assert out.outputs[0].token_ids == STORY_NEXT[0]
    assert out.outputs[0].text == smollm2[1].decode(STORY_NEXT[0])
    assert out.outputs[0].finish_reason == "length" and out.finished
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times) and m.token_times[0] == m.first_token_time


@pytest.mark.numerics
def test_crowded_chunked_and_preempted_give_the_same_tokens(smollm2, story_ids):
    """A pool of 7 blocks of 4 tokens, a budget of 4 tokens a step: prompts are chunked, and the
    growing sequences run out of blocks so the newest is preempted and recomputed."""
    model, _ = smollm2
    extra = [list(range(1000, 1009))]  # a 9-token prompt: chunked across three steps
    prompts = story_ids + extra
    engine = make_engine(smollm2, num_kv_blocks=7, block_size=4, max_num_batched_tokens=4)
    outs = run(engine, [(f"r{i}", ids, greedy(6)) for i, ids in enumerate(prompts)])
    kinds = {r.kind for rec in engine.step_records for r in rec.scheduled}
    assert engine.scheduler.num_preemptions >= 1, "the pool was meant to force a preemption"
    assert "prefill chunk" in kinds, "the budget was meant to chunk a prompt"
    assert any(o.metrics.num_preemptions for o in outs.values())
    for i in range(len(story_ids)):
        assert outs[f"r{i}"].outputs[0].token_ids == STORY_NEXT[i]
    # r3 alone would get, at each step, the argmax of one uncached forward over its prompt and outputs;
    # another computation, so compared where that forward decides (measured: all 6 steps, by 0.34 or more)
    got = outs["r3"].outputs[0].token_ids
    assert_argmax_agrees(got, teacher_forced_logits(model, extra[0], got), FP32_TOLERANCE, min_decided=5)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.numerics
def test_abort_frees_blocks_at_once_and_reports_abort(smollm2, story_ids):
    engine = make_engine(smollm2)
    engine.add_request("a", story_ids[1], greedy(20))
    engine.add_request("b", story_ids[2], greedy(1))
    outs = engine.step()  # both prefilled; b is done
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", None), ("b", "length")]
    assert engine.block_manager.num_used_blocks == 1
    engine.abort("a")
    assert engine.block_manager.num_used_blocks == 0  # before any further step
    (out,) = engine.step()
    assert out.request_id == "a" and out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == STORY_NEXT[1][:1]
    assert not engine.has_unfinished_requests()
    engine.abort("a")  # a second abort of a finished request is harmless
    engine.abort("never-seen")


@pytest.mark.numerics
def test_stop_token_stop_string_and_eos(smollm2, story_ids):
    engine = make_engine(smollm2)
    day = story_ids[1]  # greedy: " in the 21st century." then EOS (2)
    outs = run(
        engine,
        [
            ("eos", day, SamplingParams(temperature=0, max_tokens=12)),
            ("ignore", day, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
            ("token", day, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[216])),
            ("string", day, SamplingParams(temperature=0, max_tokens=12, stop=["21st"])),
        ],
    )
    eos = outs["eos"].outputs[0]
    assert (eos.token_ids, eos.text, eos.finish_reason) == (
        [281, 260, 216, 34, 33, 302, 2070, 30, 2],
        " in the 21st century.",
        "stop",
    )
    ignore = outs["ignore"].outputs[0]
    assert ignore.token_ids[:9] == eos.token_ids and len(ignore.token_ids) == 10 and ignore.finish_reason == "length"
    token = outs["token"].outputs[0]
    assert (token.token_ids, token.finish_reason, token.stop_reason) == ([281, 260, 216], "stop", 216)
    string = outs["string"].outputs[0]
    assert (string.text, string.finish_reason, string.stop_reason) == (" in the ", "stop", "21st")
    assert string.token_ids == [281, 260, 216, 34, 33, 302]
    assert not engine.scheduler.has_unfinished() and engine.block_manager.num_used_blocks == 0


@pytest.mark.numerics
def test_a_stop_string_ends_the_output_at_once_and_the_sequence_at_the_next_step(smollm2, story_ids):
    """The text shows a stop string only after the step's lock (output_processor.py): the output ends
    there, and the scheduler lets the sequence go when the next step drains the engine's inbox."""
    engine = make_engine(smollm2)
    engine.add_request("s", story_ids[1], SamplingParams(temperature=0, max_tokens=12, stop=["21st"]))
    seq = None
    while True:
        seq = seq or next(iter(engine.scheduler.running), None)
        outputs = engine.step()
        if outputs and outputs[0].finished:
            break
    assert (outputs[0].outputs[0].text, outputs[0].outputs[0].finish_reason) == (" in the ", "stop")
    assert seq.status.value == "running" and seq.block_table  # still the scheduler's, for one more step
    assert engine.step() == [] and seq.status.value == "finished" and seq.finish_reason == "stop"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.numerics
def test_streamed_deltas_add_up_and_hold_back_stop_prefixes(smollm2, story_ids):
    engine = make_engine(smollm2)
    engine.add_request("s", story_ids[1], SamplingParams(temperature=0, max_tokens=12, stop=["century"]))
    pieces, ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].new_text)
            ids += out.outputs[0].new_token_ids
            assert "cent" not in out.outputs[0].text or out.finished
    assert "".join(pieces) == out.outputs[0].text == " in the 21st "
    assert ids == out.outputs[0].token_ids


def test_requests_added_and_aborted_from_another_thread(smollm2, story_ids):
    engine = make_engine(smollm2, max_waiting=2)
    engine.add_request("first", story_ids[0], greedy(3))
    finished, errors = {}, []

    def drive():
        try:
            while len(finished) < 3:
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=drive)
    thread.start()
    engine.add_request("second", story_ids[1], greedy(3))
    engine.add_request("third", story_ids[2], greedy(50))
    deadline = time.monotonic() + 300
    while not any(r.request_id == "third" for rec in list(engine.step_records) for r in rec.scheduled):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine.abort("third")  # while it runs: applied at the start of the next step
    thread.join(timeout=300)
    assert not errors and not thread.is_alive()
    assert finished["first"].outputs[0].token_ids == STORY_NEXT[0][:3]
    assert finished["second"].outputs[0].token_ids == STORY_NEXT[1][:3]
    assert finished["third"].outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0


def test_queue_bound_and_too_large_requests(smollm2, story_ids):
    engine = make_engine(smollm2, num_kv_blocks=2, block_size=4, max_num_seqs=1, max_waiting=1)
    with pytest.raises(RequestTooLargeError):
        engine.add_request("huge", story_ids[1], greedy(3))  # 6 + 3 tokens > 2 blocks × 4
    engine.add_request("ok", story_ids[0], greedy(2))  # takes the free seat at the next step
    engine.add_request("also", story_ids[0], greedy(2))  # waits: max_num_seqs + max_waiting = 2
    with pytest.raises(QueueFullError):
        engine.add_request("more", story_ids[2], greedy(2))
    assert engine.get_num_unfinished_requests() == 2


def test_startup_log_names_memory_blocks_and_concurrency(smollm2):
    engine = make_engine(smollm2, num_kv_blocks=64)
    text = "\n".join(engine.startup_log)
    assert "weights take 513.1 MiB" in text
    assert "KV cache: 45.0 MiB = 64 blocks × 16 tokens = 1024 tokens (45.0 KiB per token)" in text
    assert "requests up to 1024 tokens" in text  # the pool caps the context of 8192
    assert "maximum concurrency for 1024 tokens per request: 1.00x" in text
    shorter = make_engine(smollm2, num_kv_blocks=64, max_model_len=256)  # as vLLM counts it: pool ÷ longest request
    assert "maximum concurrency for 256 tokens per request: 4.00x" in "\n".join(shorter.startup_log)


@pytest.mark.numerics
def test_n_answers_share_the_prompt_blocks_and_sample_apart(smollm2, story_ids):
    engine = make_engine(smollm2, block_size=4)
    prompt = story_ids[1] + story_ids[0]  # 10 tokens: two full blocks to share
    engine.add_request("n", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True))
    engine.add_request("g", story_ids[2], SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True))
    (n_out,) = [o for o in engine.run_until_done() if o.request_id == "n"]
    assert [c.index for c in n_out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 3 for c in n_out.outputs)
    assert len({tuple(c.token_ids) for c in n_out.outputs}) > 1  # seeds 7, 8, 9: different draws
    later = [
        r
        for rec in engine.step_records
        for r in rec.scheduled
        if r.request_id in ("n/1", "n/2") and r.kind == "prefill"
    ]
    assert [r.num_cached_tokens for r in later] == [8, 8]  # the siblings reused the prompt's blocks
    engine.add_request("again", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True))
    (again,) = engine.run_until_done()
    # same seed, same answers: the prompt's blocks now come from the cache (other shapes, other rounding), and a
    # seeded draw changes only if it lands within that rounding of a boundary between tokens (~1e-5 a draw)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in n_out.outputs]
    engine.add_request("cut", prompt, SamplingParams(n=2, temperature=0, max_tokens=5))
    engine.step()
    engine.abort("cut")
    (cut,) = engine.step()
    assert cut.finished and [c.finish_reason for c in cut.outputs] == ["abort", "abort"]
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("early", prompt, SamplingParams(n=3, temperature=0, max_tokens=5))
    request = engine.requests["early"]
    siblings = [c.seq for c in request.completions]
    assert len(request.pending) == 2  # they wait for the first answer's prompt blocks, in no line yet
    engine.abort("early")  # before any step: all three end through the scheduler, the two never queued too
    (early,) = engine.step()
    assert [c.finish_reason for c in early.outputs] == ["abort"] * 3
    assert all(seq.is_finished and seq.finish_reason == "abort" for seq in siblings)
    assert not engine.scheduler.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_pool_sized_from_kv_cache_memory(smollm2):
    per_block = 2 * 30 * 3 * 64 * 4 * 16  # K and V, 30 layers, 3 KV heads, fp32, 16 tokens
    engine = make_engine(smollm2, num_kv_blocks=None, kv_cache_memory=10 * per_block + 100)
    assert engine.num_kv_blocks == 10 and engine.runner.kv_cache.nbytes == 10 * per_block
    assert engine.max_model_len == 160  # a request can never outgrow the pool
