"""Structured output under speculative decoding: a grammar request drafts, each verify row is masked with the
grammar's state after the drafts before it, and the answer is what it would be without speculation.

On the tiny random model, with prompt lookup (n-gram): the prompt holds JSON of the schema's shape, so
lookup finds drafts once the answer starts repeating its keys. Before, a grammar request never drafted,
and one decoding plainly beside a verify never advanced its grammar.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from lifeofprompt import LLM, SamplingParams
from lifeofprompt.engine.structured_output import StructuredOutputsParams

pytest.importorskip("xgrammar")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "city", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "city": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
}
PROMPT = '{"name": "ann", "city": "rome", "age": 31}\n{"name": "bob", "city": "oslo", "age": 42}\n'
STRUCTURE = StructuredOutputsParams(json=SCHEMA)


@pytest.fixture(scope="module")
def llms(tiny_model):
    model, tokenizer = tiny_model
    make = lambda spec: LLM(
        model,
        tokenizer=tokenizer,
        log_stats=False,
        num_kv_blocks=512,
        max_num_seqs=16,  # noqa: E731
        speculative_config=spec,
    )
    return make(None), make(NGRAM)


def drafted(out) -> int:
    return out.metrics.spec_decode.num_draft_tokens


def test_greedy_grammar_answers_draft_and_equal_the_plain_ones(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=STRUCTURE)
    prompts = [PROMPT, PROMPT + '{"name": "', "hello " + PROMPT]
    expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    outs = spec.generate(prompts, params, use_tqdm=False)
    for out, want in zip(outs, expected):
        assert out.outputs[0].token_ids == want.token_ids
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert sum(drafted(o) for o in outs) > 0, "no grammar request drafted"
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


def test_sampled_grammar_answers_under_speculation_all_validate(llms):
    _, spec = llms
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=STRUCTURE) for seed in range(12)
    ]
    outs = spec.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert sum(drafted(o) for o in outs) > 0
    assert len({o.outputs[0].text for o in outs}) > 6


def test_a_grammar_request_beside_a_verify_still_walks_its_grammar(llms):
    """A penalised grammar request never drafts; decoding plainly in steps that hold another request's
    verify, it must still advance its grammar after each token (it did not: its mask went stale)."""
    plain, spec = llms
    asks = [
        SamplingParams(temperature=0, max_tokens=200, structured_outputs=STRUCTURE, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    ]
    prompts = [PROMPT, PROMPT * 2]
    expected = plain.generate(prompts, asks, use_tqdm=False)
    outs = spec.generate(prompts, asks, use_tqdm=False)
    assert drafted(outs[0]) == 0 and drafted(outs[1]) > 0
    assert outs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)


def test_drafts_are_cut_to_what_the_grammar_allows(llms):
    plain, _ = llms
    backend = plain.engine.grammar_backend()
    state = backend.matcher(StructuredOutputsParams(regex="ab+c"))
    a, b, c, x = (plain.engine.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    assert state.valid_prefix([a, b, b, x, b]) == 3
    assert state.valid_prefix([x]) == 0
    assert state.valid_prefix([a, b, c]) == 3  # the grammar can still take EOS after c
    rows = state.verify_bitmask([a, b])
    logits = torch.zeros(3, backend.vocab_size)
    backend.apply(logits, rows)
    allowed = [set((logits[i] == 0).nonzero().flatten().tolist()) for i in range(3)]
    assert allowed[0] == {a} and allowed[1] == {b} and allowed[2] == {b, c}
    assert state.accept(a)  # the tentative walk left the state where it was
