"""Tool calls with ``tool_choice: "auto"`` (and every other mode), through the ``openai`` client.

SmolLM2's chat template knows no tools, so the server renders them itself (the Hermes format,
``serving/tools.py``) and constrains the answer with xgrammar's structural tags: free text, or at
``<tool_call>`` a call whose arguments are valid for that tool's schema. The model is steered into
a call by ``logit_bias`` on the trigger's five tokens (``<``, ``tool``, ``_``, ``call``, ``>``); the
bias does not know the schemas, so arguments that validate against nested objects, enums, a
pattern and bounded arrays come from the grammar. The tiny random model checks what only the
grammar could do (parallel calls, one call with ``parallel_tool_calls: false``); the parser is
checked on its own against every way a stream can split a text.
"""

from __future__ import annotations

import json
import random

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from lifeofprompt.engine.llm import render_chat  # noqa: E402
from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402
from lifeofprompt.serving.tool_calls import ToolCallParser, deltas_from, message_from  # noqa: E402
from lifeofprompt.serving.tools import tool_conversation  # noqa: E402

ORDER = {  # nothing like a flat object: nested, enum, pattern, bounded array, required fields
    "type": "object",
    "additionalProperties": False,
    "required": ["customer", "items"],
    "properties": {
        "customer": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "tier"],
            "properties": {"name": {"type": "string", "maxLength": 20}, "tier": {"enum": ["gold", "silver"]}},
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["sku", "qty"],
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
            },
        },
    },
}
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "place_order", "description": "Place an order", "parameters": ORDER}},
]
SCHEMAS = {"get_weather": WEATHER, "place_order": ORDER}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TRIGGER_TOKENS = ("<", "tool", "_", "call", ">")  # how SmolLM2's tokenizer writes "<tool_call>"


def assert_valid(call) -> dict:
    """A call of one of TOOLS whose arguments parse and validate; its arguments."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# ----------------------------------------------------------------------------- the parser alone

TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool_call>}", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "place_order", "arguments": {"customer": {"name": "A", "tier": "gold"}, '
    '"items": [{"sku": "ABC-12", "qty": 1}]}}\n</tool_call>\n'
)


def stream_pieces(text: str, pieces: list[str]):
    """The text fed piece by piece: (content, {index: name}, {index: arguments}, order of first sight)."""
    parser, content, names, arguments, seen = ToolCallParser(), "", {}, {}, []
    deltas = [d for k, part in enumerate(pieces) for d in deltas_from(parser.feed(part, final=k == len(pieces) - 1))]
    for delta in deltas:
        assert "<tool" not in delta.get("content", "") and not delta.get("content", "").endswith("<")
        indexes = [entry["index"] for entry in delta.get("tool_calls", [])]
        assert len(set(indexes)) == len(indexes), delta  # one entry per call in a chunk, as vLLM sends
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if "id" in entry:  # a call's first delta: its name, no arguments yet
                assert entry["index"] not in names and entry["function"]["arguments"] == ""
                names[entry["index"]], arguments[entry["index"]] = entry["function"]["name"], ""
                seen.append(entry["index"])
            else:
                assert entry["index"] in names  # never arguments before the name
            arguments[entry["index"]] += entry["function"]["arguments"]
    return content, names, arguments, seen


def test_any_split_of_a_stream_gives_the_whole_answers_calls_and_never_a_partial_trigger():
    whole, finish = message_from(TEXT, "stop")
    assert finish == "tool_calls" and whole["content"] == "Let me check. "
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather", "place_order"]
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"])["city"] == "<tool_call>}"
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 60)))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
        content, names, arguments, seen = stream_pieces(TEXT, pieces)
        assert content == whole["content"] and seen == [0, 1]
        assert [arguments[i] for i in seen] == [c["function"]["arguments"] for c in whole["tool_calls"]]


def test_text_that_only_looks_like_a_trigger_and_calls_cut_by_max_tokens():
    assert message_from("a < b and <tool", "length") == ({"content": "a < b and <tool"}, "length")
    assert message_from("<tool_call> is a tag", "stop") == ({"content": "<tool_call> is a tag"}, "stop")
    cut, finish = message_from(TEXT[:70], "length")  # the name is complete, the arguments are not
    assert finish == "length" and cut["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert message_from('<tool_call>\n{"name": "get_w', "length") == (
        {"content": '<tool_call>\n{"name": "get_w'},
        "length",
    )


def test_what_a_cut_leaves_of_the_framing_is_never_content():
    """``max_tokens`` inside the next trigger after a call, or (required / named: no text allowed) inside
    the first call's name: the framing is dropped, not sent as content."""
    one_call = TEXT[: TEXT.index("<tool_call>", 20)]
    after, finish = message_from(one_call + "<tool", "length")
    assert finish == "length" and after["content"] == "Let me check. " and len(after["tool_calls"]) == 1
    assert message_from('<tool_call>\n{"name": "get_w', "length", text_allowed=False) == ({"content": None}, "length")
    parser, pieces = ToolCallParser(text_allowed=False), [TEXT[:40], TEXT[40:]]
    deltas = [delta for k, p in enumerate(pieces) for delta in deltas_from(parser.feed(p, final=k == 1))]
    assert "".join(delta.get("content", "") for delta in deltas) == ""
    # "Let me check. " cannot stand outside calls when text is not allowed; the calls still come
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c] == [
        "get_weather",
        "place_order",
    ]


def test_the_default_template_renders_tools_calls_and_results(smollm2):
    _, tokenizer = smollm2
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    chat, tools = tool_conversation(tokenizer, history, TOOLS)
    assert (
        tools is None
        and chat[0]["role"] == "system"
        and [m["role"] for m in chat[1:]]
        == ["user"] * 1
        + [
            "assistant",
            "user",
        ]
    )
    text, _ = render_chat(tokenizer, chat)
    assert "<tools>\n" + json.dumps(TOOLS[0]["function"]) in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    )
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text


# ----------------------------------------------------------------------------- SmolLM2 through the openai client


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=128, max_num_seqs=8, log_stats=False)
    bias = {str(tokenizer.encode(t, add_special_tokens=False)[0]): 100 for t in TRIGGER_TOKENS}
    assert len(bias) == len(TRIGGER_TOKENS)
    with ServerThread(engine, model_name="smol") as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=300)
        yield client, bias


@pytest.mark.slow
def test_auto_with_the_trigger_forced_makes_a_call_valid_for_its_schema(smol):
    client, bias = smol
    response = client.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, logit_bias=bias, parallel_tool_calls=False, max_tokens=150, seed=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    print("forced auto call:", call.function.name, call.function.arguments)
    assert_valid(call)
    assert choice.message.content is None


@pytest.mark.slow
def test_auto_streams_the_name_first_then_arguments_that_concatenate_to_valid_json(smol):
    client, bias = smol
    stream = client.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, logit_bias=bias, parallel_tool_calls=False, max_tokens=150, stream=True
    )
    deltas, finish, content = [], None, ""
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name in SCHEMAS
    assert first.function.arguments == ""
    pieces = [d.function.arguments for d in deltas[1:]]
    assert len(pieces) > 3 and all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    arguments = json.loads("".join(pieces))
    jsonschema.validate(arguments, SCHEMAS[first.function.name])


@pytest.mark.slow
def test_auto_left_to_the_model(smol):
    """What SmolLM2-135M does with the tools and a natural request is its own choice: reported, not asserted."""
    client, _ = smol
    response = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    choice = response.choices[0]
    print("auto left to SmolLM2:", choice.finish_reason, choice.message.content, choice.message.tool_calls)
    for call in choice.message.tool_calls or []:
        assert_valid(call)  # whatever it chose, a call parses
    # streamed, the same greedy answer: text flows as content (only a possible trigger's start waits)
    stream = client.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == (choice.message.content or "")
    assert sum(bool(c.delta.content) for c in chunks) > 1 or not choice.message.content


def test_a_tool_round_trip_renders_and_is_answered(smol, smollm2):
    client, _ = smol
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    choice = answer.choices[0]
    print("after the tool result:", choice.finish_reason, repr(choice.message.content), choice.message.tool_calls)
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # the prompt is the default template's rendering, call and result included (test above)
    plain = [{**m, "content": m["content"] or ""} for m in history]
    chat, _ = tool_conversation(smollm2[1], plain, TOOLS)
    assert "<tool_call>" in chat[2]["content"] and "<tool_response>" in chat[3]["content"]
    assert answer.usage.prompt_tokens == len(render_chat(smollm2[1], chat)[1])


# ----------------------------------------------------------------------------- the tiny random model


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model(max_position_embeddings=2048)  # the tools template, a byte a token
    tokenizer.chat_template = "tags"
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=1024, max_num_seqs=8, log_stats=False)
    with ServerThread(engine, model_name="tiny") as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=300)


SMALL = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {"type": "object", "required": ["n"], "properties": {"n": {"enum": [1, 2, 3]}}},
        },
    },
]


def complete_calls(client, **extra) -> list[int]:
    """How many complete calls each of 8 "required" answers made; each validates, the text holds nothing else."""
    response = client.chat.completions.create(
        model="tiny", messages=ASK, tools=SMALL, tool_choice="required", max_tokens=600, n=8, seed=3, **extra
    )
    counts = []
    for choice in response.choices:
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":  # random weights may go on calling: the last call is cut
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        for call in calls:
            schema = WEATHER if call.function.name == "get_weather" else SMALL[1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        counts.append(len(calls))
    return counts


def test_parallel_tool_calls_false_allows_one_call_and_true_allows_several(tiny):
    assert complete_calls(tiny, parallel_tool_calls=False) == [1] * 8
    several = complete_calls(tiny)
    print("complete calls per answer, parallel allowed:", several)
    assert max(several) > 1
