"""Pipeline overlap at P = 2 (gloo, one torch thread a rank, the tiny random model with SmolLM2's head layout).

With two or more requests the engine keeps two steps in flight, one per micro-batch group, and stage 1
runs one group's step while stage 0 runs the other's, as the ranks' own clocks show; with one request
only one step is ever in flight and stage 0 waits for every step's logits (the bubble). Greedy tokens
equal the single-process engine's and the non-overlapped P = 2 engine's; no sequence is ever in two
steps in flight, and a group's preemptions touch only its own requests; the block manager's invariants
hold after every step (``check_invariants``), at the end, and after an abort whose step was still in the
pipe; no worker outlives shutdown, nor a worker killed mid-run (the typed error, within 30 s).

One parallel engine at a time per process: the non-overlapped engine runs and is gone before the
overlapped one starts, and the overlapped one is shut down (and checked) before the fault test's.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_tensor_parallel import ENGINE, PROMPTS, greedy
from test_tensor_parallel_faults import DEADLINE_S, spawned_children, wait_gone
from tiny_models import assert_parallel_agrees, tiny_model

from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import WorkerFailedError

pytestmark = [pytest.mark.usefixtures("one_thread")]  # ranks: the tests that start the P = 2 engine


def pipelined(**kwargs) -> LLM:
    model, tokenizer = tiny_model()
    return LLM(model, tokenizer=tokenizer, pipeline_parallel_size=2, **(ENGINE | kwargs))


def run(llm: LLM, prompts) -> dict:
    """Generate greedily; the tokens, the new step records, and the range of step numbers the ranks ran."""
    engine = llm.engine
    before, first = len(engine.step_records), engine.model.stage_clock.num_steps
    outputs = llm.generate(prompts, greedy())
    return dict(
        tokens=[o.outputs[0].token_ids for o in outputs],
        records=list(engine.step_records)[before:],
        steps=range(first, engine.model.stage_clock.num_steps),
    )


@pytest.fixture(scope="module")
def single(one_thread):
    model, tokenizer = tiny_model()
    return tokens_of(LLM(model, tokenizer=tokenizer, **ENGINE))


def tokens_of(llm: LLM) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.fixture(scope="module")
def plain(one_thread):
    """The non-overlapped P = 2 engine's tokens (it is shut down before the overlapped one starts)."""
    llm = pipelined(pipeline_overlap=False)
    try:
        assert llm.engine.pipeline is None
        return tokens_of(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def overlapped(one_thread):
    """The overlapped engine (the default at P > 1): the four prompts, then one alone."""
    llm = pipelined()
    runs = dict(many=run(llm, PROMPTS), one=run(llm, PROMPTS[:1]))
    yield llm, runs
    llm.shutdown()


def stage_times(llm: LLM) -> tuple[dict, dict]:
    """``{step: (start, end)}`` of stage 0's layers (rank 0) and stage 1's (rank 1), on their own clocks
    (one machine: one ``time.monotonic`` for every process)."""
    engine = llm.engine
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
    as_dict = lambda times: {k: (start, end) for k, start, end in times}  # noqa: E731
    return as_dict(engine.model.stage_clock.times), as_dict(reports[1]["stage_times"])


@pytest.mark.ranks
def test_overlapped_steps_give_the_single_and_the_plain_engines_tokens(single, plain, overlapped):
    llm, runs = overlapped
    tokens = runs["many"]["tokens"]
    full, _ = tiny_model()
    assert_parallel_agrees(llm.engine.model, full, PROMPTS, tokens, single)
    assert_parallel_agrees(llm.engine.model, full, PROMPTS, tokens, plain)  # at every step its margin decides
    assert llm.engine.scheduler.num_preemptions > 0  # two groups, one pool of 12 blocks: it ran dry


@pytest.mark.ranks
def test_two_groups_keep_two_steps_in_flight_and_the_stages_run_at_once(overlapped):
    llm, runs = overlapped
    records = runs["many"]["records"]
    assert {r.group for r in records} == {0, 1}
    assert max(1 + len(r.overlapped) for r in records) == 2 == llm.engine.pipeline.max_in_flight
    assert sum(1 for r in records if r.overlapped) >= len(records) // 2
    by_step = {r.step: r for r in records}
    for r in records:  # never one sequence in two steps in flight
        mine = {s.request_id for s in r.scheduled}
        for other in r.overlapped:
            assert by_step[other].group != r.group
            assert mine.isdisjoint(s.request_id for s in by_step[other].scheduled)
    stage0, stage1 = stage_times(llm)
    steps = runs["many"]["steps"]
    at_once = [k for k in steps[1:] if stage0[k][0] < stage1[k - 1][1] and stage1[k - 1][0] < stage0[k][1]]
    assert at_once, "stage 0 never ran a step while stage 1 ran the one before it"


@pytest.mark.ranks
def test_one_request_keeps_one_step_in_flight_the_bubble(overlapped):
    llm, runs = overlapped
    records = runs["one"]["records"]
    assert len(records) > 3 and all(not r.overlapped for r in records)
    stage0, stage1 = stage_times(llm)
    steps = runs["one"]["steps"]
    assert len(steps) == len(records)
    for k in steps[1:]:  # stage 0 starts step k only after stage 1 has finished step k - 1
        assert stage0[k][0] >= stage1[k - 1][1]


@pytest.mark.ranks
def test_the_block_manager_is_whole_after_overlapped_steps(overlapped):
    llm, _ = overlapped
    engine = llm.engine
    assert not engine.pipeline.in_flight and not engine.scheduler.has_unfinished()
    engine.block_manager.check_invariants(engine.scheduler.seqs)
    assert engine.block_manager.num_used_blocks == 0
    assert "up to 2 steps in flight" in next(line for line in engine.startup_log if line.startswith("pipeline"))


@pytest.mark.ranks
def test_an_abort_while_its_step_is_in_the_pipe_frees_its_blocks_safely(single, overlapped):
    """Its blocks go back at once and the other group's later steps may take them: every stage runs the steps
    in order, so those steps write after the aborted one's. The survivor keeps the single engine's tokens."""
    llm, _ = overlapped
    engine = llm.engine
    engine.add_request("keep", PROMPTS[0], greedy())
    engine.add_request("drop", PROMPTS[2], greedy())

    def in_pipe(rid: str) -> bool:
        return any(s.request_id == rid for f in engine.pipeline.in_flight for s in f.started.record.scheduled)

    done = []
    for _ in range(20):
        done += [o for o in engine.step() if o.finished]
        if in_pipe("drop") and engine.step_records[-1].step > 3:
            break
    assert in_pipe("drop")
    engine.abort("drop")
    done += engine.run_until_done()
    kept = next(o for o in done if o.request_id == "keep")
    assert sorted(o.outputs[0].finish_reason for o in done) == ["abort", "length"]
    full, _ = tiny_model()
    assert_parallel_agrees(engine.model, full, PROMPTS[:1], [kept.outputs[0].token_ids], single[:1])
    assert engine.block_manager.num_used_blocks == 0 and not engine.pipeline.in_flight
    engine.block_manager.check_invariants(engine.scheduler.seqs)


@pytest.mark.ranks
def test_shutdown_ends_every_worker_of_the_overlapped_engine(overlapped):
    llm, _ = overlapped
    pids = llm.engine.parallel.worker_pids
    llm.shutdown()
    assert wait_gone(pids, 10) == [] and spawned_children() == []


@pytest.mark.ranks
def test_a_worker_killed_with_steps_in_flight_gives_the_typed_error_within_30_s():
    llm = pipelined(num_kv_blocks=64)
    pids = llm.engine.parallel.worker_pids
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    start = None
    try:
        with pytest.raises(WorkerFailedError, match=r"rank 1 was killed by signal 9") as info:
            for out in llm.stream([[5, 6, 7, 8], [9, 10, 11]], params):
                if start is None and llm.engine.pipeline.max_in_flight == 2 and len(out.outputs[0].token_ids) >= 3:
                    os.kill(pids[0], signal.SIGKILL)
                    start = time.monotonic()
        assert start is not None and time.monotonic() - start < DEADLINE_S
        assert info.value.rank == 1
        assert wait_gone(pids, 5) == [] and spawned_children() == []
    finally:
        llm.shutdown()


def test_serve_can_turn_the_overlap_off():
    from lifeofprompt.cli import build_parser

    assert build_parser().parse_args(["serve"]).pipeline_overlap is None  # the engine's default: on
    assert build_parser().parse_args(["serve", "--no-pipeline-overlap"]).pipeline_overlap is False


def test_a_group_preempts_only_its_own_requests():
    """Group 1's step is in the pipe; group 0 runs the shared pool dry and evicts its own newest, never group 1's."""
    from lifeofprompt.engine.block_manager import BlockManager
    from lifeofprompt.engine.config import SchedulerConfig
    from lifeofprompt.engine.scheduler import Scheduler
    from lifeofprompt.engine.sequence import Sequence, SequenceStatus

    limits = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=64, max_model_len=6 * 4, num_groups=2)
    scheduler = Scheduler(BlockManager(6, 4, enable_prefix_caching=False), limits)
    a, b, c, d = (
        Sequence(name, list(range(1, 1 + n)), SamplingParams(max_tokens=4))
        for name, n in (("a", 8), ("b", 8), ("c", 4), ("d", 4))
    )
    for seq in (a, b, c, d):
        scheduler.add(seq)
    assert [s.group for s in (a, b, c, d)] == [0, 1, 0, 1]  # each to the group with the fewest
    first = scheduler.schedule(group=0)
    in_flight = scheduler.schedule(group=1)
    assert first.seqs == [a, c] and in_flight.seqs == [b, d] and scheduler.block_manager.num_free_blocks == 0
    scheduler.update_from_output(first, [7, 7])
    tables = {s.request_id: list(s.block_table) for s in (b, d)}
    again = scheduler.schedule(group=0)  # a needs a third block: the pool is empty
    assert again.preempted == ["c"] and again.seqs == [a]
    assert {s.request_id: list(s.block_table) for s in (b, d)} == tables
    assert b.status == d.status == SequenceStatus.RUNNING
