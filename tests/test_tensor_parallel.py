"""Tensor parallelism on the CPU (gloo, 3 ranks, one torch thread each) on a tiny random Llama with
SmolLM2's head layout: the same greedy tokens as the single-process engine through chunked prefill,
prefix caching and preemption; every rank holds a third of the weights and of the KV pool; every
rank ran the same block table; sizes the model cannot be split by are refused by name.

One engine of each kind for the whole module (a tensor-parallel start spawns two interpreters).
"""

from __future__ import annotations

import psutil
import pytest
from tiny_models import TINY_SMOLLM2_LAYOUT, assert_parallel_agrees, tiny_model

from lifeofprompt.distributed import collectives
from lifeofprompt.distributed.sharded_model import shard_weights
from lifeofprompt.distributed.sizes import ShardPlan, check_tensor_parallel_size, valid_tensor_parallel_sizes
from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import ParallelConfigError, WorkerFailedError
from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.model.config import ModelConfig

T = 3
BLOCK_SIZE = 4
# 12 blocks of 4 tokens for 4 requests of up to 23 tokens: the pool runs out and the newest is preempted;
# 8 tokens a step: prompts are chunked; prompts 0 and 1 share two full blocks: prefix caching.
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
MAX_TOKENS = 12

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.ranks]


def greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def single(one_thread):
    model, tokenizer = tiny_model()
    llm = LLM(model, tokenizer=tokenizer, **ENGINE)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.fixture(scope="module")
def parallel(one_thread):
    model, tokenizer = tiny_model()
    llm = LLM(model, tokenizer=tokenizer, tensor_parallel_size=T, **ENGINE)
    outputs = llm.generate(PROMPTS, greedy())
    yield llm, outputs
    llm.shutdown()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ----------------------------------------------------------------------------- sizes (no processes)


def test_valid_sizes_are_named():
    assert valid_tensor_parallel_sizes(SMOLLM2_135M) == (1, 3)
    assert valid_tensor_parallel_sizes(TINY_SMOLLM2_LAYOUT) == (1, 3)
    for bad in (0, 2, 4, 9):
        with pytest.raises(ParallelConfigError, match=r"valid sizes: 1, 3") as info:
            check_tensor_parallel_size(SMOLLM2_135M, bad)
        assert info.value.valid_sizes == (1, 3)


def test_a_bad_size_is_refused_before_any_process_starts():
    model, tokenizer = tiny_model()
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(ParallelConfigError, match="does not divide the 9 query heads"):
        LLM(model, tokenizer=tokenizer, tensor_parallel_size=2, **ENGINE)
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    """4 query / 2 KV heads over 4 ranks: each rank holds the one KV head its query head reads."""
    config = ModelConfig(
        name="gqa",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
    )
    plans = [ShardPlan.for_rank(config, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.heads for p in plans] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert plans[0].kv_replication == 2 and plans[0].config.num_kv_heads == 1
    assert [p.vocab for p in plans] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # 10 rows padded to 12


# ----------------------------------------------------------------------------- the engine


def test_tokens_match_the_single_process_engine(single, parallel):
    """Through chunked prefill, prefix caching and preemption. Tokens are compared where the single
    engine's top-2 margin beats the measured logit difference between the two (sums in another order)."""
    llm_1, tokens_1 = single
    llm_t, outputs = parallel
    tokens_t = [o.outputs[0].token_ids for o in outputs]
    for llm in (llm_1, llm_t):
        records = list(llm.engine.step_records)
        kinds = {s.kind for r in records for s in r.scheduled}
        assert {"prefill chunk", "recompute", "decode"} <= kinds, kinds
        assert llm.engine.scheduler.num_preemptions > 0
    assert outputs[1].num_cached_tokens >= 2 * BLOCK_SIZE  # prompt 1 found prompt 0's two blocks

    full, _ = tiny_model()
    assert_parallel_agrees(llm_t.engine.model, full, PROMPTS, tokens_t, tokens_1)


def test_each_rank_holds_its_third(parallel):
    llm, _ = parallel
    engine = llm.engine
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
    assert [r["rank"] for r in reports] == [0, 1, 2]
    full, _ = tiny_model()
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    d, hidden = 16, 144
    expected = {
        "embed_tokens.weight": (107, hidden),
        "norm.weight": (hidden,),
        "layers.0.self_attn.qkv_proj.weight": ((3 + 2 * 1) * d, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, 3 * d),
        "layers.0.mlp.gate_up_proj.weight": (2 * 32, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, 32),
    }
    one_pool = 2 * 2 * 12 * BLOCK_SIZE * 1 * d * 4  # layers, K/V, blocks, slots, 1 KV head, head_dim, fp32
    for report in reports:
        shapes = report["weights"]["shapes"]
        assert {k: shapes[k] for k in expected} == expected
        assert "lm_head.weight" not in shapes  # tied: the embedding's shard is the LM head
        assert abs(report["weights"]["nbytes"] / full_bytes - 1 / T) < 0.01
        assert report["kv_shape"] == (2, 2, 12, BLOCK_SIZE, 1, d) and report["kv_nbytes"] == one_pool
        # the very slice of the full weights, not just its shape
        want = shard_weights(full, ShardPlan.for_rank(full.config, report["rank"], T))
        for name, total in report["weights"]["sums"].items():
            assert total == pytest.approx(float(want[name].double().sum()), abs=1e-9)
    single_pool = 2 * 2 * 12 * BLOCK_SIZE * 3 * d * 4
    assert sum(r["kv_nbytes"] for r in reports) == single_pool


def test_every_rank_multiplies_by_the_paths_the_driver_chose(parallel):
    """The driver chooses the CPU product paths once (pinned here) and sends them: no rank keeps its own."""
    llm, _ = parallel
    engine = llm.engine
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
    driver = reports[0]["products"]
    assert driver and all(path is not None and "linear" in path for path in driver.values())
    assert all(r["products"] == driver for r in reports[1:])
    assert any("workers' CPU matrix products: the driver's (pinned: linear)" in line for line in engine.startup_log)


def test_every_rank_ran_the_same_block_table(parallel):
    llm, _ = parallel
    engine = llm.engine
    engine.add_request("tables", PROMPTS[2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # a paged step, so the tables are this one's
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
    tables = [r["block_tables"] for r in reports]
    assert tables[0] is not None and tables[0] == tables[1] == tables[2]
    seq = engine.scheduler.running[0] if engine.scheduler.running else None
    if seq is not None:
        assert tables[0][0][: len(seq.block_table)] == seq.block_table
    engine.run_until_done()


def test_every_collective_of_a_step_is_counted(parallel):
    """Per forward: two broadcasts (header, payload), one all-reduce after the embedding and two per layer,
    one gather of the logits; the all-reduces move [tokens, hidden] fp32 each."""
    llm, _ = parallel
    engine = llm.engine
    collectives.reset()
    before = len(engine.step_records)
    llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    records = list(engine.step_records)[before:]
    tokens = sum(r.num_batched_tokens for r in records)
    stats = collectives.snapshot()
    assert len(records) == 3 and tokens == 3 + 1 + 1  # a prefill of 3, two decodes
    assert stats["broadcast"]["calls"] == 2 * len(records)
    assert stats["all_reduce"]["calls"] == (1 + 2 * 2) * len(records)
    assert stats["all_reduce"]["bytes"] == (1 + 2 * 2) * tokens * 144 * 4
    assert stats["gather"]["calls"] == len(records) and stats["gather"]["bytes"] == 3 * 107 * 4
    assert all(v["seconds"] > 0 for v in stats.values())
    workers = engine.parallel.report(engine.model, engine.runner.kv_cache)[1:]
    assert all(w["collectives"]["all_reduce"]["calls"] >= stats["all_reduce"]["calls"] for w in workers)
    # each call, by size, on every rank: the same all-reduces in the same order (the cost model's last arrival)
    mine = collectives.samples()["all_reduce"]
    assert [n for n, _ in mine] == [t * 144 * 4 for r in records for t in [r.num_batched_tokens] * 5]
    from lifeofprompt.lessons.parallelism import last_arrival_calls

    last = last_arrival_calls([mine] + [w["collective_calls"]["all_reduce"] for w in workers])
    assert [n for n, _ in last] == [n for n, _ in mine] and all(t <= s for (_, t), (_, s) in zip(last, mine))


def test_shutdown_ends_every_worker(parallel):
    """Last in the module: the shared engine ends here."""
    llm, _ = parallel
    pids = llm.engine.parallel.worker_pids
    assert len(pids) == T - 1 and not any(gone(p) for p in pids)
    llm.shutdown()
    assert all(gone(p) for p in pids)
    with pytest.raises(WorkerFailedError, match="shut down"):
        llm.generate(PROMPTS[:1], greedy())
    llm.shutdown()  # idempotent
