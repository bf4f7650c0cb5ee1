"""Structured output: the grammar, not the model, makes the output valid (random weights included)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lifeofprompt import LLM, SamplingParams
from lifeofprompt.engine.structured_output import StructuredOutputsParams
from lifeofprompt.errors import InvalidRequestError

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "ok"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    model, tokenizer = tiny_model
    return LLM(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=512, max_num_seqs=32)


def sampled(llm, structure, count, max_tokens=256, prompt="hello"):
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structure)
        for seed in range(count)
    ]
    return [o.outputs[0] for o in llm.generate([prompt] * count, params, use_tqdm=False)]


def test_a_hundred_sampled_answers_of_random_weights_all_validate(tiny_llm):
    outs = sampled(tiny_llm, StructuredOutputsParams(json=SCHEMA), 100)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 50  # sampled, not one answer repeated


def test_without_the_grammar_random_weights_give_no_json(tiny_llm):
    outs = [
        o.outputs[0].text
        for o in tiny_llm.generate(
            ["hello"] * 5, [SamplingParams(temperature=1.0, seed=s, max_tokens=40) for s in range(5)], use_tqdm=False
        )
    ]
    parsed = 0
    for text in outs:
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0  # so the test above measures the mask


@pytest.mark.parametrize(
    "structure,check",
    [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutputsParams(grammar='root ::= "a" ("b" | "c")* "d"'), lambda t: re.fullmatch(r"a[bc]*d", t)),
    ],
)
def test_regex_choice_object_and_grammar_hold_for_every_sample_and_greedy(tiny_llm, structure, check):
    for out in sampled(tiny_llm, structure, 12):
        assert out.finish_reason == "stop" and check(out.text), out.text
    greedy = tiny_llm.generate(
        ["hi"], SamplingParams(temperature=0, max_tokens=256, structured_outputs=structure), use_tqdm=False
    )[0].outputs[0]
    assert check(greedy.text), greedy.text


def test_bad_structures_are_typed_errors_naming_the_field(tiny_llm):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(json=SCHEMA, regex="a")
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError) as info:
        tiny_llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert info.value.param == "structured_outputs.regex"
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.choice == ("a",)


@pytest.mark.slow
def test_the_real_model_answers_a_hundred_times_in_the_schema(smollm2):
    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=1024, max_num_seqs=50)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON: name, age, ok."}])
    outs = sampled(llm, StructuredOutputsParams(json=SCHEMA), 100, max_tokens=60, prompt=prompt)
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # any JSON object: unbounded, so a sampled answer may still be nesting when max_tokens ends it;
    # every one that ends by itself parses as an object
    finished = [
        o
        for o in sampled(llm, StructuredOutputsParams(json_object=True), 10, max_tokens=160, prompt=prompt)
        if o.finish_reason == "stop"
    ]
    assert len(finished) >= 5
    assert all(isinstance(json.loads(o.text), dict) for o in finished)
