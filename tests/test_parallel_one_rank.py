"""``distributed_executor_backend="mp"`` at T = P = 1 on the CPU (gloo): the distributed path with rank 0 alone.

A world of one spawns no worker, yet every step still broadcasts its inputs and runs every
all-reduce through gloo. An all-reduce over one rank is a sum of one term, so the logits are
bit-for-bit the single-process engine's and the greedy tokens are exactly equal (the reference
runs the same torch forward: no C step, as the "mp" engine forces). Also: the
collectives really run, the one-call C step stays off, shutdown leaves no process group behind,
and values vLLM's name does not take raise ``ConfigError``. (The same on one GPU with NCCL:
``tests/gpu/test_parallel_gpu.py``.)
"""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.distributed as dist
from tiny_models import tiny_model

from lifeofprompt.distributed import collectives
from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import ConfigError, WorkerFailedError
from lifeofprompt.lessons.agreement import teacher_forced_logits

BLOCK_SIZE = 4
# As tests/test_tensor_parallel.py: the pool runs out (preemption), prompts are chunked, prompts 0 and 1 share blocks.
ENGINE = dict(
    dtype="float32",
    block_size=BLOCK_SIZE,
    num_kv_blocks=12,
    max_num_batched_tokens=8,
    enable_prefix_caching=True,
    log_stats=False,
    check_invariants=True,
)
SHARED = [11, 12, 13, 14, 15, 16, 17, 18]
PROMPTS = [SHARED + [40, 41, 42], SHARED + [50, 51, 52, 53, 54], [60, 61, 62, 63, 64, 65, 66], [70, 71, 72]]
LAYERS, HIDDEN = 2, 144  # the tiny model's

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.ranks]


def greedy(max_tokens: int = 12):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def single(one_thread):
    model, tokenizer = tiny_model()
    llm = LLM(model, tokenizer=tokenizer, distributed_executor_backend="uni", **ENGINE)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.fixture(scope="module")
def one_rank(one_thread):
    """The "mp" engine, asked for the C step (which it must refuse); the processes it started beside."""
    before = children()
    model, tokenizer = tiny_model()
    llm = LLM(model, tokenizer=tokenizer, distributed_executor_backend="mp", cpu_tuning="c-step", **ENGINE)
    started = children() - before
    yield llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())], started
    llm.shutdown()


# ----------------------------------------------------------------------------- values (no process group)


@pytest.mark.parametrize("value", ["ray", "MP", "external_launcher", 1, ["mp"]])
def test_an_unknown_backend_is_refused_by_name_before_the_model_loads(value):
    with pytest.raises(ConfigError, match=r"not one of: None .*'uni' .*'mp'"):
        LLM("no-such-model", distributed_executor_backend=value)


def test_uni_refuses_a_split_model_before_any_process_starts():
    before = children()
    with pytest.raises(ConfigError, match="'uni' runs one process.*tensor_parallel_size=3"):
        LLM("no-such-model", distributed_executor_backend="uni", tensor_parallel_size=3)
    assert children() <= before and not dist.is_initialized()


def test_serve_passes_the_backend_to_the_engine():
    from lifeofprompt.cli import build_parser
    from lifeofprompt.commands import _engine_for_serving

    args = build_parser().parse_args(["serve", "--model", "no-such-model", "--distributed-executor-backend", "ray"])
    assert args.distributed_executor_backend == "ray"
    with pytest.raises(ConfigError, match="distributed_executor_backend='ray'"):
        _engine_for_serving(args)


def test_one_process_by_default_and_with_uni(single):
    llm, _ = single
    assert llm.engine.parallel is None and not dist.is_initialized()
    model, tokenizer = tiny_model()
    assert LLM(model, tokenizer=tokenizer, **ENGINE).engine.parallel is None


def test_bf16_with_an_fp32_rotary_table_is_exact_too():
    """A bf16 model keeps its rotary table in fp32 (``RotaryEmbedding._apply``), and so does every shard
    built in bf16: rank 0's shard once rounded its table to bf16, which moved these logits by 0.06 and
    parted the tokens. Before the shared engine starts: one process group at a time."""

    def bf16_model():
        model, tokenizer = tiny_model()
        return model.to(torch.bfloat16), tokenizer

    engine = dict(ENGINE, dtype=None)
    prompts = PROMPTS[:2]
    model, tokenizer = bf16_model()
    tokens_1 = [o.outputs[0].token_ids for o in LLM(model, tokenizer=tokenizer, **engine).generate(prompts, greedy())]
    mp = LLM(*bf16_model()[:1], tokenizer=tokenizer, distributed_executor_backend="mp", **engine)
    try:
        assert mp.engine.model.dtype == torch.bfloat16 and mp.engine.model.rotary.cos.dtype == torch.float32
        assert [o.outputs[0].token_ids for o in mp.generate(prompts, greedy())] == tokens_1
        for prompt, tokens in zip(prompts, tokens_1):
            assert teacher_forced_logits(mp.engine.model, prompt, tokens).equal(
                teacher_forced_logits(model, prompt, tokens)
            )
    finally:
        mp.shutdown()
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------- a world of one


def test_a_world_of_one_rank_spawns_nothing(one_rank):
    llm, _, started = one_rank
    group = llm.engine.parallel
    assert group is not None and group.world_size == 1 and group.worker_pids == [] and not started
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert any("= 1 rank over gloo" in line and "no other rank" in line for line in llm.engine.startup_log)


def test_the_c_step_stays_off(one_rank, single):
    """Asked for it, the "mp" engine still runs the torch forward (the step this mode exists to measure)."""
    llm, _, _ = one_rank
    assert llm.engine.runner.speedups.c_step_rows == 0
    model, tokenizer = tiny_model()
    asked = LLM(model, tokenizer=tokenizer, cpu_tuning="c-step", **ENGINE)  # a single engine takes it when asked
    assert asked.engine.runner.speedups.c_step_rows > 0


def test_tokens_equal_the_single_process_engine(single, one_rank):
    """Exactly, through chunked prefill, prefix caching and preemption: the logits are bit-for-bit the same."""
    llm_1, tokens_1 = single
    llm_mp, tokens_mp, _ = one_rank
    for llm in (llm_1, llm_mp):
        kinds = {s.kind for r in llm.engine.step_records for s in r.scheduled}
        assert {"prefill chunk", "recompute", "decode"} <= kinds, kinds
    assert tokens_mp == tokens_1
    full, _ = tiny_model()
    for prompt, tokens in zip(PROMPTS, tokens_1):
        assert teacher_forced_logits(llm_mp.engine.model, prompt, tokens).equal(
            teacher_forced_logits(full, prompt, tokens)
        )


def test_every_step_goes_through_the_process_group(one_rank):
    """Per step: two broadcasts (header, payload) and 1 + 2 x layers all-reduces of [tokens, hidden] fp32;
    no gather (one rank holds the whole vocabulary)."""
    llm, _, _ = one_rank
    engine = llm.engine
    collectives.reset()
    before = len(engine.step_records)
    llm.generate([PROMPTS[3]], greedy(3))
    records = list(engine.step_records)[before:]
    tokens = sum(r.num_batched_tokens for r in records)
    stats = collectives.snapshot()
    assert len(records) == 3 and tokens == 3 + 1 + 1  # a prefill of 3, two decodes
    assert stats["broadcast"]["calls"] == 2 * len(records)
    assert stats["all_reduce"]["calls"] == (1 + 2 * LAYERS) * len(records)
    assert stats["all_reduce"]["bytes"] == (1 + 2 * LAYERS) * tokens * HIDDEN * 4
    assert "gather" not in stats
    assert all(v["seconds"] > 0 for v in stats.values())


def test_the_overhead_report(single, one_rank):
    """What the GPU test prints (``collective_bench.one_rank_overhead``), from the same two engines here."""
    from lifeofprompt.lessons.collective_bench import format_overhead, measure_llm, one_rank_overhead

    runs = [measure_llm(llm, PROMPTS, 6) for llm in (single[0], one_rank[0])]
    assert runs[0].collectives == {} and runs[1].reports[0]["rank"] == 0
    o = one_rank_overhead(*runs)
    assert o["tokens_equal"] and o["steps"] == runs[1].steps > 0
    assert o["calls_per_step"] == {"broadcast": 2, "all_reduce": 1 + 2 * LAYERS}
    assert 0 < o["collective_s_per_step"] and 0 < o["collective_share"] < 1
    assert o["overhead_s"] == pytest.approx(o["decode_step_one_rank_s"] - o["decode_step_single_s"])
    assert "= 1 rank over gloo" in o["group"] and "through a process group of one rank" in format_overhead(o)


def test_shutdown_leaves_no_process_group(one_rank, single):
    """Last in the module: the shared engine ends here, and another can start after it."""
    llm, _, _ = one_rank
    llm.shutdown()
    assert not dist.is_initialized()
    with pytest.raises(WorkerFailedError, match="shut down"):
        llm.generate(PROMPTS[:1], greedy())
    model, tokenizer = tiny_model()
    again = LLM(model, tokenizer=tokenizer, distributed_executor_backend="mp", **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in again.generate(PROMPTS[:2], greedy())] == single[1][:2]
    finally:
        again.shutdown()
    assert not dist.is_initialized()
