"""The real embedded model split over 3 ranks (gloo, one thread each): the story's greedy tokens are the
single-process engine's wherever the top-2 margin beats the measured logit difference, and each rank
holds a third of SmolLM2's weights and of its KV pool."""

from __future__ import annotations

import pytest

from lifeofprompt.engine.llm import LLM
from lifeofprompt.engine.sampling_params import SamplingParams
from tiny_models import assert_parallel_agrees

T = 3
MAX_TOKENS = 6
ENGINE = dict(dtype="float32", num_kv_blocks=32, log_stats=False)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]


@pytest.fixture(scope="module")
def engines(smollm2, story_ids, one_thread):
    model, tokenizer = smollm2
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    single = LLM(model, tokenizer=tokenizer, **ENGINE)
    want = [o.outputs[0].token_ids for o in single.generate(story_ids, params)]
    parallel = LLM(model, tokenizer=tokenizer, tensor_parallel_size=T, **ENGINE)
    got = [o.outputs[0].token_ids for o in parallel.generate(story_ids, params)]
    yield parallel, want, got
    parallel.shutdown()


def test_story_tokens_match_the_single_process_engine(smollm2, story_ids, engines):
    parallel, want, got = engines
    model, _ = smollm2
    assert_parallel_agrees(parallel.engine.model, model, story_ids, got, want)


def test_each_rank_holds_a_third_of_smollm2(smollm2, engines):
    parallel, _, _ = engines
    model, _ = smollm2
    engine = parallel.engine
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    for r in reports:
        shapes = r["weights"]["shapes"]
        assert shapes["embed_tokens.weight"] == (49152 // T, 576)
        assert shapes["layers.0.self_attn.qkv_proj.weight"] == ((3 + 2) * 64, 576)       # 3 query + 1 K + 1 V heads
        assert shapes["layers.29.mlp.down_proj.weight"] == (576, 1536 // T)
        assert abs(r["weights"]["nbytes"] / full - 1 / T) < 0.005
        assert r["kv_shape"] == (30, 2, 32, 16, 1, 64)
    assert len({str(r["block_tables"]) for r in reports}) == 1


def test_serve_passes_the_tensor_parallel_size_to_the_engine():
    """``serve --tensor-parallel-size/--pipeline-parallel-size`` reach the engine, which names SmolLM2's valid sizes first."""
    from lifeofprompt.cli import build_parser
    from lifeofprompt.commands import _engine_for_serving
    from lifeofprompt.errors import ParallelConfigError

    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "8"])
    with pytest.raises(ParallelConfigError, match="valid sizes: 1, 3"):
        _engine_for_serving(args)
    args = build_parser().parse_args(["serve", "--pipeline-parallel-size", "31", "--dtype", "float32"])
    with pytest.raises(ParallelConfigError, match="valid sizes: 1 to 30"):
        _engine_for_serving(args)
