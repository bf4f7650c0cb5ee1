"""The real embedded model split over processes (gloo, one thread each): T = 3, P = 2 and T x P = 3 x 2.
The story's greedy tokens are the single-process engine's wherever the top-2 margin beats the measured
logit difference, and each rank holds its share of SmolLM2's weights and of its KV pool."""

from __future__ import annotations

import pytest
from tiny_models import assert_parallel_agrees

from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams

MAX_TOKENS = 6
ENGINE = dict(dtype="float32", num_kv_blocks=32, log_stats=False)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics, pytest.mark.ranks]


def greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def want(smollm2, story_ids, one_thread):
    model, tokenizer = smollm2
    return [o.outputs[0].token_ids for o in LLM(model, tokenizer=tokenizer, **ENGINE).generate(story_ids, greedy())]


@pytest.fixture(scope="module", params=[(3, 1), (1, 2), (3, 2)], ids=lambda p: f"T{p[0]}xP{p[1]}")
def parallel(request, smollm2, story_ids, one_thread):
    """One layout at a time (torch.distributed has one default group per process)."""
    model, tokenizer = smollm2
    tp, pp = request.param
    llm = LLM(model, tokenizer=tokenizer, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.generate(story_ids, greedy())]
    yield llm, tp, pp, got
    llm.shutdown()


def test_story_tokens_match_the_single_process_engine(smollm2, story_ids, want, parallel):
    llm, _, _, got = parallel
    assert_parallel_agrees(llm.engine.model, smollm2[0], story_ids, got, want)


def test_each_rank_holds_its_share_of_smollm2(smollm2, parallel):
    llm, tp, pp, _ = parallel
    model, _ = smollm2
    engine = llm.engine
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    for r in reports:
        shapes, (first, last) = r["weights"]["shapes"], r["layers"]
        assert last - first == 30 // pp and r["kv_shape"] == (30 // pp, 2, 32, 16, 3 // tp, 64)
        assert shapes["layers.0.self_attn.qkv_proj.weight"] == ((9 + 2 * 3) // tp * 64, 576)  # its heads only
        assert shapes["layers.0.mlp.down_proj.weight"] == (576, 1536 // tp)
        head = "embed_tokens.weight" if r["stage"] == 0 else "lm_head.weight"
        assert shapes[head] == (49152 // tp, 576)
        # its stage's layers and the embedding (or the tied LM head's copy), 1/T of each
        assert r["weights"]["nbytes"] == pytest.approx(((full - embedding) / pp + embedding) / tp, rel=0.005)
    assert len({str(r["block_tables"]) for r in reports}) == 1


def test_serve_passes_the_parallel_sizes_to_the_engine():
    """``serve --tensor-parallel-size/--pipeline-parallel-size`` reach the engine, which names SmolLM2's valid sizes."""
    from lifeofprompt.cli import build_parser
    from lifeofprompt.commands import _engine_for_serving
    from lifeofprompt.errors import ParallelConfigError

    args = build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "8"]
    )
    with pytest.raises(ParallelConfigError, match="valid sizes: 1, 3"):
        _engine_for_serving(args)
    args = build_parser().parse_args(["serve", "--pipeline-parallel-size", "31", "--dtype", "float32"])
    with pytest.raises(ParallelConfigError, match="valid sizes: 1 to 30"):
        _engine_for_serving(args)
