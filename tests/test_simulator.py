"""The simulator: the real scheduler on a roofline clock. Exact small cases, then the policies compared."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine.step_trace import ScheduledRequest, StepRecord
from lifeofprompt.lessons.roofline import Machine, predict_step_time
from lifeofprompt.lessons.simulator import SimRequest, Simulator, calibrate, compare_steps, random_workload
from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.loadtest.arrivals import closed_loop, poisson

MACHINE = Machine("test machine", bandwidth=10e9, flops=50e9, overhead_s=0.01)


def step_time(num_tokens, context, num_seqs=1):
    return predict_step_time(MACHINE, SMOLLM2_135M, torch.float32, num_tokens, context, num_seqs)


def test_one_request_follows_the_roofline_exactly():
    result = Simulator(machine=MACHINE).run([SimRequest(prompt_len=10, output_len=3)])
    (t,) = result.timings
    prefill, d1, d2 = step_time(10, 0), step_time(1, 10), step_time(1, 11)
    assert [s.num_batched_tokens for s in result.steps] == [10, 1, 1]
    assert t.first_token_time == pytest.approx(prefill)
    assert t.token_times == pytest.approx([prefill, prefill + d1, prefill + d1 + d2])
    assert result.summary["completed"] == 1 and result.num_preemptions == 0


def test_batching_beats_one_at_a_time_and_is_deterministic():
    work = random_workload(40, (8, 64), (4, 32), seed=3)
    one = Simulator(machine=MACHINE, max_num_seqs=1).run(work)
    many = Simulator(machine=MACHINE, max_num_seqs=16).run(work)
    again = Simulator(machine=MACHINE, max_num_seqs=16).run(work)
    assert many.summary == again.summary
    assert many.summary["output_throughput"] > 2 * one.summary["output_throughput"]
    assert many.summary["output_tokens"] == one.summary["output_tokens"] == sum(r.output_len for r in work)


def test_static_leaves_seats_idle_and_waits_longer():
    work = [SimRequest(16, n) for n in (2, 30, 2, 30, 2, 30, 2, 30)]
    static = Simulator(machine=MACHINE, static_batch_size=2).run(work)
    continuous = Simulator(machine=MACHINE, max_num_seqs=2).run(work)
    assert static.policy == "static" and continuous.policy == "continuous"
    # static: the second batch starts only after r1's 30 tokens; continuous fills r0's seat at once
    assert [s.admitted for s in static.steps if s.admitted] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6", "r7"]]
    assert continuous.steps[2].admitted == ["r2"]
    assert continuous.summary["ttft_s"]["p50"] < static.summary["ttft_s"]["p50"]
    assert continuous.duration < static.duration


def test_small_pool_preempts_finishes_and_rejects_the_impossible():
    work = [SimRequest(20, 40) for _ in range(6)] + [SimRequest(200, 10)]
    result = Simulator(machine=MACHINE, num_blocks=8, block_size=16).run(work)
    assert result.num_preemptions > 0
    assert result.summary["completed"] == 6 and result.summary["failed"] == 1
    assert "exceeds" in result.timings[-1].error


def test_arrival_patterns_drive_the_clock():
    work = random_workload(30, 16, 8, seed=0)
    loop = Simulator(machine=MACHINE).run(work, closed_loop(30, num_clients=3))
    assert max(len(s.scheduled) for s in loop.steps) <= 3
    slow = Simulator(machine=MACHINE).run(work, poisson(30, rate=0.5, seed=1))
    assert slow.summary["achieved_arrival_rate"] == pytest.approx(0.5, rel=0.5)
    assert slow.duration > 30  # the last request arrives after about a minute


def test_calibrate_and_compare_on_timed_steps():
    bare = Machine("bare", 10e9, 50e9)
    records = []
    for i, (n, ctx) in enumerate([(12, 0), (3, 12), (3, 15), (2, 16)]):
        rec = StepRecord(step=i, num_scheduled_tokens=[n], scheduled=[ScheduledRequest("r", "x", ctx, n, 0, [0])])
        predicted = predict_step_time(bare, SMOLLM2_135M, torch.float32, n, ctx, 1)
        rec.start_time, rec.end_time = 10.0 * i, 10.0 * i + predicted + 0.05
        records.append(rec)
    fitted = calibrate(bare, SMOLLM2_135M, torch.float32, records)
    assert fitted.overhead_s == pytest.approx(0.05)
    gap = compare_steps(fitted, SMOLLM2_135M, torch.float32, records)
    assert gap["median_ratio"] == pytest.approx(1.0) and gap["mean_abs_error"] < 1e-9
    assert gap["num_tokens"] == [12, 3, 3, 2]


# ----------------------------------------------------------------------------- fair chunked prefill


def test_the_simulator_takes_the_engines_threshold():
    from lifeofprompt.errors import ConfigError

    assert Simulator(machine=MACHINE).scheduler.config.long_prefill_token_threshold == 512  # 2,048 / 4, as LLMEngine
    assert Simulator(machine=MACHINE, max_num_batched_tokens=256).scheduler.config.long_prefill_token_threshold == 64
    assert (
        Simulator(machine=MACHINE, long_prefill_token_threshold=0).scheduler.config.long_prefill_token_threshold is None
    )
    assert (
        Simulator(machine=MACHINE, long_prefill_token_threshold=300).scheduler.config.long_prefill_token_threshold
        == 300
    )
    assert Simulator(machine=MACHINE, max_num_batched_tokens=8).scheduler.config.long_prefill_token_threshold is None
    with pytest.raises(ConfigError):
        Simulator(machine=MACHINE, long_prefill_token_threshold=-1)


def scene(threshold=None, budget=256):
    from lifeofprompt.lessons.fair_prefill import simulated_short_beside_long

    sim = Simulator(
        machine=MACHINE, num_blocks=160, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold
    )
    return simulated_short_beside_long(sim, 1000, 5, short_max_tokens=4)


def test_a_short_request_beside_a_long_prompt_waits_one_step_with_the_threshold_and_three_without():
    off, on = scene(0), scene()
    assert (off.threshold, on.threshold) == (None, 64)
    assert (off.steps_to_first_token, on.steps_to_first_token) == (3, 1)
    assert [s.long_tokens for s in off.spans] == [256, 256, 256, 232, 0, 0, 0]  # then the short one's 3 decodes
    # capped to 64 while the short request runs (its prompt, 3 decodes), the whole budget again once it is done
    assert [(s.long_tokens, s.short_tokens) for s in on.spans] == [
        (256, 0),
        (64, 5),
        (64, 1),
        (64, 1),
        (64, 1),
        (256, 0),
        (232, 0),
    ]
    assert (off.long_prefill_steps, on.long_prefill_steps) == (4, 7)  # what the cap costs the long prompt
    assert on.short_arrival_s == pytest.approx(step_time(256, 0)) and on.short_arrival_s == off.short_arrival_s
    assert on.ttft_s == pytest.approx(on.spans[1].duration_s) and on.ttft_s < off.ttft_s  # roofline seconds
    assert off.ttft_s == pytest.approx(sum(s.duration_s for s in off.spans[1:4]))


def test_the_simulator_cuts_the_same_chunks_as_the_engine_on_the_same_queue():
    """Same queue, same budget, same threshold: every step's tokens per request equal the real engine's."""
    from tiny_models import build_tiny_model

    from lifeofprompt.engine.llm_engine import LLMEngine
    from lifeofprompt.lessons.fair_prefill import short_beside_long, synthetic_ids

    model, tokenizer = build_tiny_model(max_position_embeddings=2048)
    for threshold in (0, None, 100):
        engine = LLMEngine(
            model,
            tokenizer=tokenizer,
            num_kv_blocks=160,
            max_num_batched_tokens=256,
            long_prefill_token_threshold=threshold,
            log_stats=False,
        )
        real = short_beside_long(engine, synthetic_ids(300, 1000), synthetic_ids(300, 5, stride=13))
        simulated = scene(threshold)
        assert simulated.threshold == real.threshold
        assert [(s.long_tokens, s.short_tokens) for s in simulated.spans] == [
            (s.long_tokens, s.short_tokens) for s in real.spans
        ], threshold
        assert (simulated.steps_to_first_token, simulated.long_prefill_steps) == (
            real.steps_to_first_token,
            real.long_prefill_steps,
        )


def test_the_runs_table_shows_steps_and_seconds_only_when_asked():
    from lifeofprompt.lessons.fair_prefill import format_runs

    runs = {"simulator, off": scene(0), "simulator, on": scene()}
    steps_only = format_runs(runs, seconds=False).splitlines()
    assert steps_only[1].split() == ["simulator,", "off", "off", "3", "steps", "4", "steps", "256", "256", "256", "232"]
    assert steps_only[2].split() == ["simulator,", "on", "64", "1", "step", "7", "steps", "256", "64"]
    with_seconds = format_runs(runs).splitlines()
    assert f"1 step, {runs['simulator, on'].ttft_s:.2f} s" in with_seconds[2]
