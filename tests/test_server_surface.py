"""The rest of OpenAI's surface, in-process on the tiny random model: ``n``, logprobs, tools, /tokenize.

Random weights on purpose: a tool call that validates against its schema proves the grammar made
it. Each test here failed before: ``n`` > 1, ``logprobs`` and ``tools`` were 400s, /tokenize a 404,
and a missing xgrammar a 500.
"""

from __future__ import annotations

import json
import sys

import jsonschema
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
from fastapi.testclient import TestClient  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.lessons.agreement import teacher_forced_logits  # noqa: E402
from lifeofprompt.serving.server import ServerConfig, build_app  # noqa: E402

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
ADD = {
    "type": "object",
    "additionalProperties": False,
    "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
}
ECHO = {
    "type": "object",
    "additionalProperties": False,
    "required": ["s"],
    "properties": {"s": {"type": "string", "maxLength": 5}},
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
    {"type": "function", "function": {"name": "echo", "parameters": ECHO}},
]
SCHEMAS = {"add": ADD, "echo": ECHO}


def tiny_engine(tiny_model, num_kv_blocks: int = 128):
    model, tokenizer = tiny_model
    tokenizer = type(tokenizer)(tokenizer.vocab_size)
    tokenizer.chat_template = "tags"  # ByteTokenizer.apply_chat_template: <role>\ncontent\n
    return LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=num_kv_blocks, max_num_seqs=8, log_stats=False)


@pytest.fixture(scope="module")
def http():
    # 2,048 positions: the default tools template puts the tools in the system prompt, a byte a token here
    app = build_app(tiny_engine(build_tiny_model(max_position_embeddings=2048), num_kv_blocks=1024), model_name="tiny")
    with TestClient(app, raise_server_exceptions=False) as client:
        client.engine = app.state.engine
        yield client


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def streamed(http, path, body):
    """The JSON chunks of a streamed answer (the final [DONE] checked and dropped)."""
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ----------------------------------------------------------------------------- n


def test_n_answers_are_seeded_seed_to_seed_plus_n_minus_one(http):
    body = {"model": "tiny", "prompt": ["hello", "abc"], "max_tokens": 6, "temperature": 1.0, "return_token_ids": True}
    many = ok(http.post("/v1/completions", json={**body, "n": 3, "seed": 40}))
    assert [c["index"] for c in many["choices"]] == list(range(6))
    for p, prompt in enumerate(body["prompt"]):
        for i in range(3):
            one = ok(http.post("/v1/completions", json={**body, "prompt": prompt, "seed": 40 + i}))["choices"][0]
            assert many["choices"][p * 3 + i]["token_ids"] == one["token_ids"]
    assert len({tuple(c["token_ids"]) for c in many["choices"][:3]}) > 1
    assert many["usage"]["completion_tokens"] == 6 * 6
    assert many["usage"]["prompt_tokens"] == len("hello") + len("abc")  # each prompt counted once


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_n_gives_the_same_answers_as_a_whole_one(http, path):
    base = CHAT if "chat" in path else {"model": "tiny", "prompt": "hello"}
    body = {**base, "max_tokens": 6, "n": 3, "seed": 7, "return_token_ids": True}
    whole = ok(http.post(path, json=body))["choices"]
    ids = {}
    for chunk in streamed(http, path, body):
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
    assert ids == {c["index"]: c["token_ids"] for c in whole}


# ----------------------------------------------------------------------------- logprobs


def test_completion_logprobs_are_the_raw_models(http):
    """Greedy: each token's logprob is the log-softmax of the model's own logits (teacher-forced), and
    the sampled token is the most likely of its top_logprobs."""
    out = ok(
        http.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hello",
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 3,
                "return_token_ids": True,
            },
        )
    )["choices"][0]
    lp, ids = out["logprobs"], out["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) == 5
    prompt = http.engine.tokenizer.encode("hello", add_special_tokens=False)
    expected = torch.log_softmax(teacher_forced_logits(http.engine.model, prompt, ids).float(), dim=-1)
    for i, token in enumerate(ids):
        assert lp["token_logprobs"][i] == pytest.approx(expected[i, token].item(), abs=1e-4)
        assert lp["token_logprobs"][i] == pytest.approx(max(lp["top_logprobs"][i].values()), abs=1e-6)
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def test_chat_logprobs_have_exactly_top_logprobs_alternatives(http):
    for body in ({"logprobs": True, "top_logprobs": 4}, {"logprobs": True}):
        out = ok(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, "seed": 1, **body}))
        content = out["choices"][0]["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"]
        for entry in content:
            assert len(entry["top_logprobs"]) == body.get("top_logprobs", 0)
            values = [t["logprob"] for t in entry["top_logprobs"]]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            assert entry["bytes"] == list(entry["token"].encode("utf-8"))
    plain = ok(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}))
    assert plain["choices"][0]["logprobs"] is None


def test_streamed_logprobs_match_the_whole_answer(http):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = ok(http.post("/v1/completions", json=body))["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in streamed(http, "/v1/completions", body) if c["choices"]]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for c in chunks for x in c[key]] == pytest.approx(whole[key], abs=1e-5)


# ----------------------------------------------------------------------------- tools


def assert_valid_calls(choices):
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1
        call = message["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return [c["message"]["tool_calls"][0]["function"]["name"] for c in choices]


def test_tool_choice_required_calls_one_of_the_tools_with_valid_arguments(http):
    out = ok(
        http.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 200,  # a call is about 60 bytes of Hermes framing, a byte a token here
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,  # one call each (several: tests/test_tool_calls_auto.py)
                "n": 12,
                "seed": 0,
                "temperature": 1.0,
            },
        )
    )
    names = assert_valid_calls(out["choices"])
    assert set(names) == {"add", "echo"}, names  # the grammar lets either be chosen


def test_a_named_tool_is_called_and_streams_name_first_then_argument_pieces(http):
    body = {
        **CHAT,
        "max_tokens": 120,
        "tools": TOOLS,
        "seed": 2,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
    }
    whole = ok(http.post("/v1/chat/completions", json={**body, "n": 4}))
    assert assert_valid_calls(whole["choices"]) == ["add"] * 4
    chunks = streamed(http, "/v1/chat/completions", body)
    calls = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    first, rest = calls[0], calls[1:]
    assert first["function"] == {"name": "add", "arguments": ""} and first["id"].startswith("call_")
    assert len(rest) > 1 and all(d["index"] == 0 and set(d["function"]) == {"arguments"} for d in rest)
    arguments = "".join(d["function"]["arguments"] for d in rest)
    assert arguments == whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    jsonschema.validate(json.loads(arguments), ADD)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_reach_the_prompt_through_our_template_unless_the_chat_template_reads_them(http, monkeypatch):
    def prompt_tokens(**extra):
        return ok(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, **extra}))["usage"]["prompt_tokens"]

    bare = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == bare  # "none": the tools are not shown
    assert prompt_tokens(tools=TOOLS) > bare + len(json.dumps(ADD))  # auto: our tools template, in the system prompt
    # a chat template that reads ``tools`` gets them instead (this byte tokenizer's renders none of them)
    monkeypatch.setattr(http.engine.tokenizer, "chat_template", "{% if tools %}...{% endif %}", raising=False)
    assert prompt_tokens(tools=TOOLS) == bare


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools.0"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"logprobs": 3}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_tools_and_logprobs_are_400s_naming_the_field(http, extra, param):
    response = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("extra", [{"logprobs": 21}, {"logprobs": True}, {"logprobs": -1}, {"top_logprobs": 2}])
def test_bad_completion_logprobs_are_400s(http, extra):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("logprobs", "top_logprobs")


# ----------------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_and_detokenize_round_trip(http):
    out = ok(http.post("/tokenize", json={"prompt": "hello"}))
    assert out == {"tokens": [1] + [b + 3 for b in b"hello"], "count": 6, "max_model_len": http.engine.max_model_len}
    assert ok(http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False}))["count"] == 5
    assert ok(http.post("/detokenize", json={"tokens": out["tokens"][1:]})) == {"prompt": "hello"}


def test_tokenize_messages_counts_what_the_chat_endpoint_bills(http):
    counted = ok(http.post("/tokenize", json={"messages": CHAT["messages"]}))["count"]
    billed = ok(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}))["usage"]["prompt_tokens"]
    assert counted == billed


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT["messages"]}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenizer_routes_answer_openai_errors(http, path, body, param):
    response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenizer_routes_need_the_api_key(tiny_model):
    app = build_app(tiny_engine(tiny_model), model_name="tiny", config=ServerConfig(api_key="sekrit"))
    with TestClient(app, raise_server_exceptions=False) as client:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [107]})):
            assert client.post(path, json=body).status_code == 401
            assert client.post(path, json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200


# ----------------------------------------------------------------------------- without xgrammar


def test_without_xgrammar_structured_output_is_a_400_that_says_what_to_install(http, monkeypatch):
    from lifeofprompt import SamplingParams, StructuredOutputUnavailableError
    from lifeofprompt.engine.structured_output import StructuredOutputsParams

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    monkeypatch.setattr(http.engine, "_grammar_backend", None)
    with pytest.raises(StructuredOutputUnavailableError, match="pip install xgrammar"):
        http.engine.add_request(
            "no-grammar", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
        )
    for body in (
        {**CHAT, "response_format": {"type": "json_object"}},
        {**CHAT, "tools": TOOLS, "tool_choice": "required"},
    ):
        response = http.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "missing_dependency" and "pip install xgrammar" in error["message"]
    assert ok(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}))["choices"]  # the rest still served
