"""N-gram speculation with pipeline overlap at P = 2 (gloo, one torch thread a rank, the tiny random model
with SmolLM2's head layout).

Each micro-batch group's verify (its last token and drafts) travels down the stages like a plain step,
with two steps in flight; it is sampled and rolled back when it comes back, and only then does its
group get new drafts. Greedy tokens equal the single-process engine's with the same speculation, and
without any (greedy speculation is exact), at every step the fp32 margin decides; each request is
drafted and keeps exactly what the single engine's drafted and kept; the counters agree with the step
records; seeded sampling draws what the single engine draws; the block manager's invariants hold after
every step (``check_invariants``), through preemptions, and at the end.

One parallel engine for the module (a P = 2 start spawns an interpreter); the single-process engines
are cheap. Run A fits the pool; run B, more and longer requests, runs it dry.
"""

from __future__ import annotations

import pytest
from test_pipeline_overlap import stage_times
from tiny_models import assert_parallel_agrees, tiny_model

from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_thread")]  # ranks: the tests that start the P = 2 engine

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# 40 blocks of 4 tokens. A: 3 requests of up to 48 tokens, all at once: no preemption, and 128 tokens a
# step never cut a draft, so drafts depend on the tokens alone. B: 6 requests of up to 72, 4 at a time:
# the pool runs dry. No C step in the reference (a P > 1 engine has none): its row limit would cut drafts.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    num_kv_blocks=40,
    max_num_batched_tokens=128,
    max_num_seqs=4,
    enable_prefix_caching=True,
    log_stats=False,
    check_invariants=True,
    cpu_tuning="linear",
)
TEXTS = (
    "abcabcabcabcabc",
    "hello hello hello hello",
    "xyzxyzxyz",
    "the cat the cat the",
    "1212121212",
    "no repeats here",
)
RUNS = dict(A=(3, 24), B=(6, 48))  # (requests, max_tokens)


def prompts_of(run: str) -> list[list[int]]:
    _, tokenizer = tiny_model()
    return [tokenizer.encode(t) for t in TEXTS[: RUNS[run][0]]]


def generate(llm: LLM, run: str, seeded: bool = False) -> dict:
    """Greedy outputs of one run (``seeded``: sampled at temperature 0.3, each request its own seed), and
    the step records it added."""
    engine = llm.engine
    before = len(engine.step_records)
    prompts = prompts_of(run)
    if seeded:
        params = [
            SamplingParams(temperature=0.3, seed=100 + i, max_tokens=RUNS[run][1], ignore_eos=True)
            for i in range(len(prompts))
        ]
    else:
        params = SamplingParams(temperature=0, max_tokens=RUNS[run][1], ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return dict(
        tokens=[o.outputs[0].token_ids for o in outputs], outputs=outputs, records=list(engine.step_records)[before:]
    )


@pytest.fixture(scope="module")
def single(one_thread):
    """The single-process engine's runs, with the same speculation (``spec``) and without (``plain``)."""
    model, tokenizer = tiny_model()
    with_spec = LLM(model, tokenizer=tokenizer, speculative_config=SPEC, **ENGINE)
    without = LLM(model, tokenizer=tokenizer, **ENGINE)
    runs = {run: dict(spec=generate(with_spec, run), plain=generate(without, run)) for run in RUNS}
    runs["seeded"] = generate(with_spec, "A", seeded=True)
    return runs


@pytest.fixture(scope="module")
def overlapped(one_thread):
    model, tokenizer = tiny_model()
    llm = LLM(model, tokenizer=tokenizer, pipeline_parallel_size=2, speculative_config=SPEC, **ENGINE)
    try:
        stats = llm.engine.spec_stats
        runs = {}
        for run in RUNS:
            accepted, drafts = stats.num_accepted_tokens, stats.num_drafts
            runs[run] = generate(llm, run)
            runs[run].update(
                accepted=stats.num_accepted_tokens - accepted,
                drafts=stats.num_drafts - drafts,
                preemptions=llm.engine.scheduler.num_preemptions,
            )
        runs["seeded"] = generate(llm, "A", seeded=True)
        runs["stages"] = stage_times(llm)
        yield llm, runs
    finally:
        llm.shutdown()


def verifies_within(output, prompt_len: int, agreed: int) -> list:
    """``(position, drafts, kept)`` of each verify of ``output`` whose tokens all lie in its first ``agreed``."""
    return [
        (s.position, s.draft_token_ids, s.num_accepted)
        for s in output.metrics.spec_steps
        if s.position + len(s.token_ids) - prompt_len < agreed
    ]


def agreed_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.ranks
@pytest.mark.parametrize("run", list(RUNS))
def test_overlapped_verifies_give_the_single_engines_tokens(single, overlapped, run):
    llm, runs = overlapped
    full, _ = tiny_model()
    tokens = runs[run]["tokens"]
    assert [len(t) for t in tokens] == [RUNS[run][1]] * RUNS[run][0]
    assert_parallel_agrees(llm.engine.model, full, prompts_of(run), tokens, single[run]["spec"]["tokens"])
    assert_parallel_agrees(llm.engine.model, full, prompts_of(run), tokens, single[run]["plain"]["tokens"])


@pytest.mark.ranks
def test_each_request_is_drafted_and_keeps_what_the_single_engine_did(single, overlapped):
    """Run A: drafts depend on a request's tokens alone, so as far as its tokens are the single engine's, so is
    every verify (position, drafts, kept); they are all the way here (at least 90% of the verifies compared)."""
    _, runs = overlapped
    mine, theirs = runs["A"], single["A"]["spec"]
    compared = 0
    for prompt, a, b in zip(prompts_of("A"), mine["outputs"], theirs["outputs"]):
        agreed = agreed_prefix(a.outputs[0].token_ids, b.outputs[0].token_ids)
        assert verifies_within(a, len(prompt), agreed) == verifies_within(b, len(prompt), agreed)
        compared += len(verifies_within(a, len(prompt), agreed))
    assert compared >= 0.9 * sum(len(o.metrics.spec_steps) for o in theirs["outputs"]) > 0


@pytest.mark.ranks
def test_seeded_sampling_speculates_as_in_the_single_engine(single, overlapped):
    """At temperature 0.3 each request draws from its own seeded generator, in its own order, whichever group
    it is in and whatever else is in the pipe: the rejection sampler keeps and draws the same tokens."""
    _, runs = overlapped
    mine, theirs = runs["seeded"], single["seeded"]
    assert mine["tokens"] == theirs["tokens"]
    assert sum(s.num_accepted for o in mine["outputs"] for s in o.metrics.spec_steps) > 0  # drafts were kept
    assert [
        [(s.position, s.draft_token_ids, s.num_accepted) for s in o.metrics.spec_steps] for o in mine["outputs"]
    ] == [[(s.position, s.draft_token_ids, s.num_accepted) for s in o.metrics.spec_steps] for o in theirs["outputs"]]


@pytest.mark.ranks
def test_verifies_are_in_flight_beside_the_other_groups_steps(overlapped):
    llm, runs = overlapped
    records = runs["A"]["records"] + runs["B"]["records"]
    assert llm.engine.pipeline is not None and llm.engine.pipeline.max_in_flight == 2
    verifies = [r for r in records if any(s.kind == "verify" for s in r.scheduled)]
    assert {r.group for r in verifies} == {0, 1}
    assert sum(1 for r in verifies if r.overlapped) >= len(verifies) // 2
    by_step = {r.step: r for r in records}
    for r in records:  # never one request in two steps in flight
        for other in r.overlapped:
            assert by_step[other].group != r.group
            assert {s.request_id for s in r.scheduled}.isdisjoint(s.request_id for s in by_step[other].scheduled)
    stage0, stage1 = runs["stages"]
    steps = sorted(set(stage0) & set(stage1))
    assert any(stage0[k][0] < stage1[k - 1][1] and stage1[k - 1][0] < stage0[k][1] for k in steps if k - 1 in stage1)


@pytest.mark.ranks
def test_the_acceptance_counters_agree_with_the_step_records(overlapped):
    _, runs = overlapped
    for run in RUNS:
        shares = [s for r in runs[run]["records"] for s in r.scheduled if s.kind == "verify"]
        assert runs[run]["drafts"] == len(shares) > 0
        assert runs[run]["accepted"] == sum(s.num_accepted_tokens for s in shares) > 0
        per_request = [o.metrics.spec_decode for o in runs[run]["outputs"]]
        assert sum(s.num_drafts for s in per_request) == len(shares)
        assert sum(s.num_accepted_tokens for s in per_request) == runs[run]["accepted"]


@pytest.mark.ranks
def test_the_pool_runs_dry_and_is_whole_at_the_end(overlapped):
    llm, runs = overlapped
    engine = llm.engine
    assert runs["A"]["preemptions"] == 0 < runs["B"]["preemptions"]
    assert not engine.pipeline.in_flight and not engine.scheduler.has_unfinished()
    engine.block_manager.check_invariants(engine.scheduler.seqs)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.ranks
def test_the_startup_log_says_verifies_travel_with_the_overlap(overlapped):
    llm, _ = overlapped
    log = llm.engine.startup_log
    assert "up to 2 steps in flight" in next(line for line in log if line.startswith("pipeline"))
    assert any(line.startswith("speculation with pipeline overlap") for line in log)


def test_drafts_changed_under_a_step_in_flight_are_caught():
    """``PipelineOverlap.check_drafts``: the guard behind the rule that only the collected group drafts."""
    from lifeofprompt.engine.llm_engine import StartedStep
    from lifeofprompt.engine.pipeline_overlap import InFlight, PipelineOverlap
    from lifeofprompt.engine.scheduler import ScheduledBatch
    from lifeofprompt.engine.sequence import Sequence

    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8))
    seq.set_spec([4, 5])
    batch = ScheduledBatch(step=7, seqs=[seq], num_scheduled_tokens=[3])
    done = InFlight(StartedStep(batch, record=None, drafts={seq.seq_id: [4, 5]}, start_time=0.0), pending=None)
    PipelineOverlap.check_drafts(done)
    seq.set_spec([4, 6])
    with pytest.raises(AssertionError, match="step 7: drafts changed"):
        PipelineOverlap.check_drafts(done)


def test_only_the_collected_group_is_drafted_for():
    from lifeofprompt.engine.block_manager import BlockManager
    from lifeofprompt.engine.config import SchedulerConfig
    from lifeofprompt.engine.scheduler import Scheduler
    from lifeofprompt.engine.sequence import Sequence

    limits = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=64, max_model_len=16 * 4, num_groups=2)
    scheduler = Scheduler(BlockManager(16, 4), limits)
    seqs = [Sequence(name, [1, 2, 3], SamplingParams(max_tokens=4)) for name in "abcd"]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule(group=0)
    scheduler.schedule(group=1)
    assert [s.request_id for s in scheduler.running_of(0)] == ["a", "c"]
    assert [s.request_id for s in scheduler.running_of(1)] == ["b", "d"]
    assert scheduler.running_of(None) == scheduler.running
