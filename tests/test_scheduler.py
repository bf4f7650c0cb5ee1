"""The scheduler without a model: token budget, chunked prefill, admission, preemption, rejection.

A fake "model" samples token ``(last token + 1) % 100`` so every step is instant; the real-model
correctness (identical greedy tokens alone, crowded, chunked, preempted) is in test_engine.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_counts import examples

from lifeofprompt.engine.block_manager import BlockManager
from lifeofprompt.engine.config import SchedulerConfig
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.scheduler import Scheduler
from lifeofprompt.engine.sequence import Sequence, SequenceStatus
from lifeofprompt.errors import RequestTooLargeError


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> Scheduler:
    """A scheduler over a fresh pool; the longest request is what the whole pool holds."""
    limits = SchedulerConfig(max_num_seqs, max_num_batched_tokens, num_blocks * block_size)
    return Scheduler(BlockManager(num_blocks, block_size), limits)


def seq(name, prompt_len, max_tokens, first=0):
    return Sequence(
        name, [(first + i) % 100 for i in range(prompt_len)], SamplingParams(temperature=0, max_tokens=max_tokens)
    )


def run_step(scheduler):
    """Schedule, 'run' (next token = last + 1 for sequences that reached their end), update, finish;
    returns the step's trace (``step_trace.StepRecord``)."""
    batch = scheduler.schedule()
    record = batch.trace
    sampled = [
        (s.token_ids[-1] + 1) % 100 if s.num_computed_tokens + n == len(s) else None
        for s, n in zip(batch.seqs, batch.num_scheduled_tokens)
    ]
    update = scheduler.update_from_output(batch, sampled)  # a request ends at its max_tokens there
    record.finished.extend(s.request_id for s in update.finished)
    scheduler.block_manager.check_invariants(scheduler.seqs)
    return record


def test_decodes_first_then_prompt_chunks_share_one_budget():
    sched = make_scheduler(64, 4, 8, 8)
    a, b = seq("a", 3, 4), seq("b", 20, 2)
    sched.add(a)
    first = run_step(sched)
    assert [(r.request_id, r.kind, r.num_tokens) for r in first.scheduled] == [("a", "prefill", 3)]
    sched.add(b)
    steps = [run_step(sched) for _ in range(3)]
    # a decodes (1 token) first, b's prompt takes the other 7 tokens of the budget, chunk after chunk
    assert [[(r.request_id, r.kind, r.start, r.num_tokens) for r in s.scheduled] for s in steps] == [
        [("a", "decode", 3, 1), ("b", "prefill chunk", 0, 7)],
        [("a", "decode", 4, 1), ("b", "prefill chunk", 7, 7)],
        [("a", "decode", 5, 1), ("b", "prefill", 14, 6)],
    ]
    assert steps[2].finished == ["a"] and all(s.num_batched_tokens <= 8 for s in steps)
    assert steps[0].scheduled[1].block_table == [1, 2]  # blocks for tokens 0..6 of b


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(64, 4, 2, 100)
    for i in range(3):
        sched.add(seq(f"r{i}", 2, 2))
    record = run_step(sched)
    assert record.admitted == ["r0", "r1"] and record.num_waiting == 1
    run_step(sched)  # r0, r1 finish
    assert run_step(sched).admitted == ["r2"]


def test_admission_waits_for_blocks():
    sched = make_scheduler(4, 4, 8, 100)
    sched.add(seq("big", 12, 1))
    sched.add(seq("small", 6, 1))
    record = run_step(sched)
    assert record.admitted == ["big"] and record.num_free_blocks == 1  # small needs 2 blocks: it waits
    assert sched.waiting[0].request_id == "small" and sched.waiting[0].block_table == []
    assert run_step(sched).admitted == ["small"]


def test_preemption_evicts_the_newest_and_it_returns_first():
    sched = make_scheduler(4, 4, 8, 100)
    old, new = seq("old", 7, 5), seq("new", 7, 6, first=50)
    sched.add(old)
    sched.add(new)
    assert run_step(sched).admitted == ["old", "new"]  # 2 blocks each: the pool is full
    assert run_step(sched).preempted == []  # token 7 still fits in block 1
    record = run_step(sched)  # both need a 3rd block for token 8
    assert record.preempted == ["new"] and [r.request_id for r in record.scheduled] == ["old"]
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert sched.waiting[0] is new and new.num_preemptions == 1 and new.output_token_ids == [57, 58]
    while old.status != SequenceStatus.FINISHED:
        assert run_step(sched).admitted == []  # its first block is cached, but 2 more are needed
    record = run_step(sched)
    assert record.admitted == ["new"] and record.scheduled[0].kind == "recompute"
    # the first block of its prompt was still in the prefix cache: 4 tokens reused, 5 recomputed
    assert (record.scheduled[0].num_cached_tokens, record.scheduled[0].start, record.scheduled[0].num_tokens) == (
        4,
        4,
        5,
    )
    while new.status != SequenceStatus.FINISHED:
        run_step(sched)
    assert new.output_token_ids == list(range(57, 63)) and old.output_token_ids == list(range(7, 12))
    assert sched.block_manager.num_used_blocks == 0 and sched.num_preemptions == 1


def test_a_request_that_can_never_fit_is_named_before_it_is_added():
    sched = make_scheduler(4, 4, 8, 100)
    with pytest.raises(RequestTooLargeError, match="16 tokens"):
        sched.check_fits(seq("huge", 10, 7))  # 17 tokens > 4 blocks × 4
    sched.check_fits(seq("fits", 10, 6))  # exactly 16: fine
    sched.add(seq("fits", 10, 6))
    assert len(sched.waiting) == 1


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(0, 6)), min_size=1, max_size=8),
    st.integers(4, 16),
    st.integers(1, 24),
    st.integers(1, 4),
    st.integers(2, 4),
)
def test_every_workload_finishes_with_the_same_tokens(requests, num_blocks, budget, max_seqs, block_size):
    """Random arrivals, pools and budgets: no livelock, budget and caps respected, no leaks, and each
    request's tokens equal what it would produce alone (last + 1 chains)."""
    sched = make_scheduler(num_blocks, block_size, max_seqs, budget)
    pending = [(arrive, seq(f"r{i}", p, m, first=i * 7)) for i, (p, m, arrive) in enumerate(requests)]
    added = []
    for step in range(2000):
        for _, s in [x for x in pending if x[0] == step]:
            try:
                sched.check_fits(s)
                sched.add(s)
                added.append(s)
            except RequestTooLargeError:
                assert s.num_prompt_tokens + s.sampling_params.max_tokens > num_blocks * block_size
        if step > 6 and not sched.has_unfinished():
            break
        record = run_step(sched)
        assert record.num_batched_tokens <= budget and len(sched.running) <= max_seqs
    assert not sched.has_unfinished(), "livelock: requests left after 2000 steps"
    for s in added:
        last = s.prompt_token_ids[-1]
        assert s.output_token_ids == [(last + k) % 100 for k in range(1, s.sampling_params.max_tokens + 1)]
    assert sched.block_manager.num_used_blocks == 0


def test_the_printed_schedule_folds_quiet_steps():
    from lifeofprompt.figures.schedule import format_steps

    sched = make_scheduler(8, 4, 8, 100)
    sched.add(seq("a", 3, 4))
    records = [run_step(sched) for _ in range(4)]
    assert format_steps(records, fold_quiet=True).splitlines() == [
        "step   0:    3 tokens, 1 running, 0 waiting, 7 blocks free",
        "             a prefill       tokens   0..2   (3)  blocks [0]",
        "step 1: one decode token per running request, no new block",
        "step   2:    1 tokens, 1 running, 0 waiting, 6 blocks free",
        "             a decode        tokens   4..4   (1)  blocks [0, 1]",
        "step   3:    1 tokens, 1 running, 0 waiting, 6 blocks free",
        "             a decode        tokens   5..5   (1)  blocks [0, 1]",
        "             a finished: its blocks go back to the pool after this step",
    ]
    assert len(format_steps(records).splitlines()) == 9
