"""Async scheduling on a GPU (run by the GPU issue's script; skipped without CUDA).

On ``tinyllama-1.1b-random`` (RANDOM weights), bf16, eager steps: on by default where CUDA graphs are off,
off where they are on (said why), and the same greedy tokens with it on as off. Every request runs the same
number of tokens, so both engines compute the same batches and the tokens must be identical, near ties
included; an abort mid-stream leaves no block behind.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tinyllama():
    from lifeofprompt.model.loader import ByteTokenizer, random_tinyllama

    model = random_tinyllama("cuda", torch.bfloat16)
    return model, ByteTokenizer(model.config.vocab_size)


def engine(tinyllama, **settings):
    from lifeofprompt.engine.llm_engine import LLMEngine

    model, tokenizer = tinyllama
    return LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=256, max_num_seqs=8, log_stats=False, **settings)


def test_on_for_eager_steps_off_with_graphs(tinyllama):
    eager = engine(tinyllama, enforce_eager=True)
    assert eager.overlap is not None and eager.async_scheduling_why.startswith("on: a GPU's forward")
    graphs = engine(tinyllama)
    assert graphs.overlap is None and "CUDA graphs" in graphs.async_scheduling_why


def test_the_same_greedy_tokens_on_and_off(tinyllama):
    from test_async_scheduling import run  # tests/test_async_scheduling.py: to the end, no block leaked

    from lifeofprompt.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    vocab = tinyllama[0].config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 120, 16, 64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [(str(i), p, params) for i, p in enumerate(prompts)]
    on = run(engine(tinyllama, enforce_eager=True, async_scheduling=True), requests)
    off = run(engine(tinyllama, enforce_eager=True, async_scheduling=False), requests)
    for rid in off:
        assert on[rid].outputs[0].token_ids == off[rid].outputs[0].token_ids, rid
    aborted = run(engine(tinyllama, enforce_eager=True, async_scheduling=True), requests, abort_after=("1", 5))
    assert aborted["1"].outputs[0].finish_reason == "abort"
    assert aborted["1"].outputs[0].token_ids == off["1"].outputs[0].token_ids[: len(aborted["1"].outputs[0].token_ids)]
