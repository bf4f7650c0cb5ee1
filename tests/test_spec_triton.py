"""A verify runs through the Triton attention (interpreter on the CPU) as through torch's: k + 1 query rows
over a cached prefix are one more variable-length query, like a prefill chunk. A tiny random model keeps
the interpreter quick."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # find it without importing it: lifeofprompt.kernels
    pytest.skip("Triton is not installed", allow_module_level=True)  # must be first (interpreter mode)
from lifeofprompt import kernels  # noqa: E402,F401
from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.engine.model_runner import ModelRunner  # noqa: E402
from lifeofprompt.engine.sampling_params import SamplingParams  # noqa: E402
from lifeofprompt.engine.sequence import Sequence  # noqa: E402
from lifeofprompt.model.config import TINYLLAMA_1_1B  # noqa: E402
from lifeofprompt.model.llama import LlamaForCausalLM  # noqa: E402
from lifeofprompt.model.loader import ByteTokenizer  # noqa: E402

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]
TINY = replace(
    TINYLLAMA_1_1B,
    name="tiny",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(3)
    return LlamaForCausalLM(TINY).eval()


def test_verify_rows_match_between_torch_and_triton(tiny):
    """A prompt of 7 tokens, then a verify of [last, 4 drafts] beside another sequence's plain decode,
    over block size 4 (the verify crosses a block boundary): every one of the 5 + 1 logit rows agrees."""
    pool = dict(num_kv_blocks=12, block_size=4)
    runners = {name: ModelRunner.for_model(tiny, attention_backend=name, **pool) for name in ("torch", "triton")}
    logits = {}
    for name, runner in runners.items():
        a = Sequence("a", [5, 9, 11, 5, 9, 11, 5], SamplingParams(temperature=0))
        b = Sequence("b", [7, 8, 9], SamplingParams(temperature=0))
        a.block_table, b.block_table = [6, 2, 9], [4]
        runner.model(*runner.prepare([a, b], [7, 3]))
        a.num_computed_tokens, b.num_computed_tokens = 6, 2  # each has one token left to compute
        a.spec_token_ids = [9, 11, 5, 9]  # positions 7..10: blocks 2 and 9
        logits[name] = runner.model(*runner.prepare([a, b], [5, 1]))
    assert logits["triton"].shape == (6, TINY.vocab_size)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=0)
    torch.testing.assert_close(runners["triton"].kv_cache.kv, runners["torch"].kv_cache.kv, atol=1e-4, rtol=0)


def test_engine_speculates_through_the_triton_backend(tiny):
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(
            tiny,
            tokenizer=ByteTokenizer(TINY.vocab_size),
            num_kv_blocks=16,
            block_size=4,
            attention_backend=backend,
            log_stats=False,
            check_invariants=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        )
        engine.add_request("r", [5, 9, 11, 5, 9, 11, 5], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        outs[backend] = engine.run_until_done()[0].outputs[0].token_ids
        assert engine.spec_stats.num_drafts > 0
    assert outs["triton"] == outs["torch"]
