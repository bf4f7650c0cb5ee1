"""Decode graphs with tensor parallelism, on the CPU: the per-rank protocol run eagerly (gloo, T = 3).

On a GPU each rank captures its own decode graphs and rank 0 broadcasts every step's padded inputs
outside them (``distributed/rank_graphs.py``; captured for real in ``tests/gpu/test_parallel_gpu.py``).
Here ``start_decode_graphs(capture=False)`` runs the same protocol with the padded step run eagerly on
every rank: rank 0 fills its static buffers, broadcasts them, every rank copies them into its own
and runs its shard, and the logits are gathered. The tokens must be the single-process engine's
(where its top-2 margin decides them), with decode steps padded to the graph ladder.
"""

from __future__ import annotations

import pytest
from tiny_models import assert_parallel_agrees, tiny_model

from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams

T = 3
# Four requests, at most 4 at a time: graph sizes 1, 2, 4, so a step of 3 decodes is padded to 4.
# The pool runs out (12 blocks of 4): a preempted request comes back through the eager path.
ENGINE = dict(
    dtype="float32",
    block_size=4,
    num_kv_blocks=12,
    max_num_seqs=4,
    max_num_batched_tokens=8,
    enable_prefix_caching=True,
    log_stats=False,
    check_invariants=True,
)
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18, 40, 41, 42],
    [11, 12, 13, 14, 50, 51],
    [60, 61, 62, 63, 64, 65, 66],
    [70, 71, 72],
]
MAX_TOKENS = 12

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.ranks]


def greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def runs(one_thread):
    model, tokenizer = tiny_model()
    single = LLM(model, tokenizer=tokenizer, **ENGINE)
    reference = [o.outputs[0].token_ids for o in single.generate(PROMPTS, greedy())]
    llm = LLM(model, tokenizer=tokenizer, tensor_parallel_size=T, **ENGINE)
    try:
        runner, shard = llm.engine.runner, llm.engine.model
        runner.start_decode_graphs(capture=False)
        sizes, run = [], shard.replay_decode

        def counted(size, payload):
            sizes.append(size)
            return run(size, payload)

        shard.replay_decode = counted
        before = len(llm.engine.step_records)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
        launches = [r.launch for r in list(llm.engine.step_records)[before:] if r.launch.padded_to is not None]
        replays = [(launch.padded_to, launch.rows, launch.mode) for launch in launches]
        assert [size for size, _, _ in replays] == sizes[: len(replays)]  # one replay per padded step
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], greedy())]
        reports = llm.engine.parallel.report(shard, runner.kv_cache)
        yield dict(reference=reference, tokens=tokens, again=again, replays=replays, shard=shard, reports=reports)
    finally:
        llm.shutdown()


def test_decode_steps_go_through_every_ranks_buffers_padded(runs):
    replays = runs["replays"]
    assert replays, "no decode step took the per-rank path"
    assert all(mode == "padded eager decode on every rank" for _, _, mode in replays)
    assert all(size in (1, 2, 4) and rows <= size for size, rows, _ in replays)
    assert any(rows < size for size, rows, _ in replays), "no step was padded"


def test_tokens_match_the_single_process_engine(runs):
    full, _ = tiny_model()
    assert_parallel_agrees(runs["shard"], full, PROMPTS, runs["tokens"], runs["reference"])
    # the engine serves on: one request alone, so other batch sizes; held to the same margins, not to exact ties
    assert_parallel_agrees(runs["shard"], full, PROMPTS[:1], runs["again"], runs["reference"][:1])


def test_every_rank_gathered_every_step(runs):
    """Each step ends in one gather on every rank; a rank that skipped a replay would have hung the group."""
    gathers = [r["collectives"]["gather"]["calls"] for r in runs["reports"]]
    assert len(gathers) == T and len(set(gathers)) == 1 and gathers[0] >= len(runs["replays"])
