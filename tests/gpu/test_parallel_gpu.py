"""The distributed path on one GPU: NCCL with ``distributed_executor_backend="mp"`` at T = P = 1 (skipped without CUDA).

NCCL cannot put two ranks on one device, so the process group is rank 0 alone: every step is still
broadcast and every all-reduce still runs through NCCL. On ``tinyllama-1.1b-random`` (RANDOM
weights), bf16, eager unless said:
* its greedy tokens are the single-process engine's at every step whose top-2 margin exceeds
  twice the measured logit difference between the two (``lessons/agreement.py``; a sum over one
  rank should make that difference 0);
* it prints the per-step overhead (``pytest -s`` or ``-rA`` shows it): the median decode step with
  and without the process group, and the collectives' share of a step
  (``collective_bench.one_rank_overhead``; ``benchmarks/gpu_check.py collectives`` records it);
* with CUDA graphs (``enforce_eager=False``) the rank captures and replays its own decode graphs,
  the step's broadcast and the logits gather outside them (``distributed/rank_graphs.py``).
The same on the CPU with gloo: ``tests/test_parallel_one_rank.py`` (and ``tests/test_rank_graphs.py``
runs the per-rank graph protocol eagerly at T = 3).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[(7 * i + 13 * k) % 31000 + 3 for i in range(n)] for k, n in enumerate((37, 120, 16, 64))]
MAX_TOKENS = 48
ENGINE = dict(num_kv_blocks=256, block_size=16, max_num_seqs=8, enforce_eager=True, log_stats=False)


@pytest.fixture(scope="module")
def runs():
    """``{"uni": (EngineRun, teacher-forced logits), "mp": ...}``, both forced on the single engine's tokens."""
    from lifeofprompt.engine.llm import LLM
    from lifeofprompt.lessons.agreement import teacher_forced_logits
    from lifeofprompt.lessons.collective_bench import measure_llm
    from lifeofprompt.model.loader import ByteTokenizer, random_tinyllama

    model = random_tinyllama("cuda", torch.bfloat16)
    out = {}
    for name in ("uni", "mp", "mp-graphs"):  # "mp-graphs": the rank captures its own decode graphs
        settings = dict(ENGINE, enforce_eager=name != "mp-graphs")
        llm = LLM(
            model,
            tokenizer=ByteTokenizer(model.config.vocab_size),
            distributed_executor_backend=name.split("-")[0],
            **settings,
        )
        try:
            run = measure_llm(llm, PROMPTS, MAX_TOKENS)
            reference = out["uni"][0].tokens if "uni" in out else run.tokens
            out[name + " last launch"] = llm.engine.step_records[-1].launch.mode  # the last step: a decode
            out[name] = run, [teacher_forced_logits(llm.engine.model, p, t) for p, t in zip(PROMPTS, reference)]
            graphs = getattr(llm.engine.model, "decode_graphs", None)
            out[name + " graphs"] = sorted(graphs.graphs) if graphs is not None else []
        finally:
            llm.shutdown()
    return out


def test_one_rank_over_nccl_picks_the_single_engines_tokens(runs):
    import torch.distributed as dist

    from lifeofprompt.lessons.agreement import BF16_TOLERANCE, assert_greedy_agrees, top2_margins

    (single, reference), (one_rank, candidate) = runs["uni"], runs["mp"]
    assert "= 1 rank over nccl" in "\n".join(one_rank.startup_lines) and not dist.is_initialized()
    assert one_rank.collectives["all_reduce"]["calls"] > 0 and one_rank.collectives["broadcast"]["calls"] > 0
    difference = max((a - b).abs().max().item() for a, b in zip(reference, candidate))
    margins = [top2_margins(r).tolist() for r in reference]
    steps = sum(len(t) for t in single.tokens)
    compared = assert_greedy_agrees(one_rank.tokens, single.tokens, margins, 2 * difference, min_steps=int(0.9 * steps))
    print(
        f"\none rank over NCCL: logits differ by at most {difference:.3g}; {sum(compared)} of {steps} greedy steps "
        f"compared, tokens {'identical' if one_rank.tokens == single.tokens else 'parted at a near tie'}"
    )
    assert difference < BF16_TOLERANCE


def test_report_the_per_step_collective_overhead(runs):
    from lifeofprompt.lessons.collective_bench import format_overhead, one_rank_overhead

    overhead = one_rank_overhead(runs["uni"][0], runs["mp"][0])
    print(f"\n{overhead['group']}\n{format_overhead(overhead)}")
    assert overhead["calls_per_step"]["broadcast"] == 2
    assert overhead["calls_per_step"]["all_reduce"] == 1 + 2 * 22  # TinyLlama's 22 layers
    assert overhead["decode_step_single_s"] > 0 and overhead["decode_step_one_rank_s"] > 0


def test_one_rank_replays_its_own_cuda_graphs(runs):
    """The process-group path with CUDA graphs: the rank captured its graphs (all-reduces inside, the step's
    broadcast and the logits gather outside: ``distributed/rank_graphs.py``), its tokens are the eager
    engine's wherever a bf16 difference cannot flip them, and its decode steps replayed them. (Its step time
    beside eager's is printed, not asserted: speed is measured in benchmarks/.)"""
    from lifeofprompt.lessons.agreement import BF16_TOLERANCE, assert_greedy_agrees, top2_margins

    (single, reference), (graphs, _) = runs["uni"], runs["mp-graphs"]
    assert runs["mp-graphs graphs"][:4] == [1, 2, 4, 8], runs["mp-graphs graphs"]
    assert runs["mp graphs"] == []
    assert runs["mp-graphs last launch"] == "CUDA graph replay on every rank"
    assert runs["mp last launch"] != "CUDA graph replay on every rank"
    margins = [top2_margins(r).tolist() for r in reference]
    compared = assert_greedy_agrees(graphs.tokens, single.tokens, margins, 2 * BF16_TOLERANCE, min_steps=0)
    eager = runs["mp"][0]
    print(
        f"\none rank over NCCL with per-rank CUDA graphs: {sum(compared)} greedy steps compared; decode step "
        f"{graphs.decode_step_s * 1e3:.2f} ms against {eager.decode_step_s * 1e3:.2f} ms eager "
        f"(single process eager {single.decode_step_s * 1e3:.2f} ms)"
    )
