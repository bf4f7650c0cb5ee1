"""Speculative decoding on the GPU path (Triton attention, fused kernels, CUDA graphs for plain decodes).

On ``tinyllama-1.1b-random`` (RANDOM weights), bf16, skipped without CUDA:
* n-gram speculation: verify steps run eagerly beside graph-replayed plain decodes, the allocator's
  invariants hold after every step, no block leaks, and the greedy tokens match plain decoding up to
  the first bf16 near-tie (agreement reported, >= 90% of the tokens before the sequences part);
* the model as its own draft accepts nearly every draft (>= 80% in bf16: a verify's k + 1 rows round
  differently from one-row decodes);
* seeded sampling with speculation repeats run after run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPEAT = [5, 17, 99, 230, 7, 5, 17, 99, 230, 7, 5, 17]  # prompt lookup finds something here


@pytest.fixture(scope="module")
def tinyllama():
    from lifeofprompt.model.loader import ByteTokenizer, random_tinyllama

    model = random_tinyllama("cuda", torch.bfloat16)
    return model, ByteTokenizer(model.config.vocab_size)


def engine(tinyllama, spec=None, **kwargs):
    from lifeofprompt.engine.llm_engine import LLMEngine

    model, tokenizer = tinyllama
    return LLMEngine(
        model,
        tokenizer=tokenizer,
        num_kv_blocks=256,
        max_num_seqs=8,
        log_stats=False,
        check_invariants=True,
        speculative_config=spec,
        **kwargs,
    )


def run(e, prompts, params):
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    outs = {o.request_id: o.outputs[0].token_ids for o in e.run_until_done()}
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    return [outs[str(i)] for i in range(len(prompts))]


def agreeing_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_ngram_speculation_on_the_gpu_path(tinyllama):
    from lifeofprompt.engine.sampling_params import SamplingParams

    prompts = [REPEAT, REPEAT[3:] * 2, [9, 8, 7, 6] * 4]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = run(engine(tinyllama), prompts, params)
    spec_engine = engine(tinyllama, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    before = len(spec_engine.step_records)
    spec = run(spec_engine, prompts, params)
    modes = [r.launch.mode for r in list(spec_engine.step_records)[before:]]
    agree = sum(agreeing_prefix(a, b) for a, b in zip(spec, plain))
    print(
        f"\nn-gram on the GPU: {agree} of {sum(map(len, plain))} tokens agree before a bf16 near-tie; "
        f"acceptance {spec_engine.spec_stats.acceptance_rate:.1%}; launches {sorted(set(modes))}"
    )
    assert agree >= 0.9 * sum(map(len, plain)) or all(agreeing_prefix(a, b) >= 8 for a, b in zip(spec, plain))
    assert spec_engine.spec_stats.num_drafts > 0 and "eager" in modes


def test_the_model_as_its_own_draft_on_the_gpu(tinyllama):
    from lifeofprompt.engine.sampling_params import SamplingParams

    model, _ = tinyllama
    e = engine(tinyllama, {"model": model, "num_speculative_tokens": 3})
    run(e, [REPEAT, [3, 4, 5]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    print(f"\nself-draft on the GPU: acceptance {e.spec_stats.acceptance_rate:.1%}")
    assert e.spec_stats.acceptance_rate >= 0.8


def test_seeded_speculative_sampling_repeats_on_the_gpu(tinyllama):
    from lifeofprompt.engine.sampling_params import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    first = run(engine(tinyllama, spec), [REPEAT, REPEAT[::-1]], params)
    again = run(engine(tinyllama, spec), [REPEAT, REPEAT[::-1]], params)
    assert first == again
