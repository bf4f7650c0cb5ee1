"""``/v1/responses`` (OpenAI's Responses API, stateless) through the official client, on SmolLM2.

Each request is answered by the chat route (``responses_api.py``), so these check the translation
both ways: instructions and items into the prompt, ``text.format`` and tools into the grammar,
and the chat answer (whole or streamed) back as a ``response`` object and its typed events.
Before, ``/v1/responses`` was a 404.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402

MODEL = "smollm2-135m"
CITY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "country"],
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
}
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(smollm2):
    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=8, log_stats=False)
    with ServerThread(engine, model_name=MODEL) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_a_string_input_makes_a_response_with_text(client):
    made = client.responses.create(
        model=MODEL,
        temperature=0,
        input="What is the capital of France?",
        instructions="Answer briefly.",
        max_output_tokens=24,
    )
    assert made.id.startswith("resp_") and made.object == "response" and made.model == MODEL
    assert made.status in ("completed", "incomplete") and made.output_text.strip()
    assert made.output[0].type == "message" and made.output[0].content[0].type == "output_text"
    usage = made.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 0 < usage.output_tokens <= 24
    # the instructions are the system message, first: the same prompt as chat's
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=1,
    )
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert made.store is False and made.previous_response_id is None  # stateless


def test_max_output_tokens_makes_an_incomplete_response(client):
    cut = client.responses.create(model=MODEL, temperature=0, input="Tell me a long story.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"


def test_text_format_json_schema_answers_valid_json(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    made = client.responses.create(
        model=MODEL,
        temperature=0,
        input="Name a city and its country as JSON.",
        text={"format": fmt},
        max_output_tokens=60,
    )
    assert made.status == "completed", made.output_text
    jsonschema.validate(json.loads(made.output_text), CITY)
    assert made.text.format.type == "json_schema"


def test_content_parts_are_text_and_other_parts_are_a_400(client):
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ann."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ann!"}]},
        {"role": "user", "content": "What is my name?"},
    ]
    assert client.responses.create(model=MODEL, temperature=0, input=conversation, max_output_tokens=8).output_text
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, temperature=0, input=image)
    assert refused.value.body["param"] == "input.0.content.0"


def check_event_order(events) -> None:
    """The Responses API's stream grammar: created, in_progress, items (each opened, filled, closed
    in order), then one terminal event; sequence numbers count from 0."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds.count(kinds[-1]) == 1
    expect_next = {
        "response.in_progress": {"response.output_item.added"},
        "response.output_item.done": {"response.output_item.added", kinds[-1]},
    }
    expect_next["response.output_item.added"] = {
        "response.content_part.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    }
    expect_next["response.content_part.added"] = {"response.output_text.delta", "response.output_text.done"}
    expect_next["response.output_text.delta"] = {"response.output_text.delta", "response.output_text.done"}
    expect_next["response.output_text.done"] = {"response.content_part.done"}
    expect_next["response.content_part.done"] = {"response.output_item.done"}
    expect_next["response.function_call_arguments.delta"] = {
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    }
    expect_next["response.function_call_arguments.done"] = {"response.output_item.done"}
    for before, after in zip(kinds[1:-1], kinds[2:]):
        assert after in expect_next[before], f"{after} after {before}: {kinds}"
    open_items = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert open_items == [e.item.id for e in events if e.type == "response.output_item.done"]
    for e in events:
        if hasattr(e, "item_id"):
            assert e.item_id in open_items


def test_streaming_yields_typed_events_whose_deltas_make_the_text(client):
    events = list(
        client.responses.create(model=MODEL, temperature=0, input="Say hello.", max_output_tokens=12, stream=True)
    )
    check_event_order(events)
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas and deltas == done.text == final.output_text
    assert sum(e.type == "response.output_text.delta" for e in events) > 1  # streamed, not whole at the end
    assert final.usage.output_tokens > 0 and final.id == events[0].response.id


@pytest.mark.parametrize(
    "choice",
    [pytest.param("required", marks=pytest.mark.slow), {"type": "function", "name": "get_weather"}],
    ids=["required", "named"],
)
def test_an_agents_function_call_round_trip(client, choice):
    """The model calls a tool (its arguments valid for the tool's schema); the agent sends the call and
    its output back as items, and the next response reads them."""
    first = client.responses.create(  # one call: "required" allows several, each ~15 tokens of Hermes framing
        model=MODEL,
        temperature=0,
        input=ASK,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    (call,) = calls
    assert call.call_id and call.id.startswith("fc_")
    if call.name == "get_weather":
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    else:
        assert choice == "required" and call.name == "get_time" and isinstance(json.loads(call.arguments), dict)

    def answer(output: str):
        turn = [
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": output},
        ]
        # tool_choice "none": the answer is text (auto, the agent's default: tests/test_tool_calls_auto.py)
        return client.responses.create(
            model=MODEL, temperature=0, input=turn, tools=TOOLS, tool_choice="none", max_output_tokens=16
        )

    short, long = answer("21"), answer("21 degrees celsius, sunny, with a light wind from the west")
    assert short.output_text and short.output[0].type == "message"
    assert long.usage.input_tokens > short.usage.input_tokens  # the tool's output is in the prompt


def test_a_streamed_function_call_has_its_argument_events(client):
    tool_choice = {"type": "function", "name": "get_weather"}
    events = list(
        client.responses.create(
            model=MODEL,
            temperature=0,
            input=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_output_tokens=60,
            stream=True,
        )
    )
    check_event_order(events)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    (item,) = events[-1].response.output
    assert (item.type, item.name, item.arguments) == ("function_call", "get_weather", done.arguments)


@pytest.mark.slow
def test_tools_with_no_tool_choice_are_auto_and_an_agents_loop_runs_on_it(client, smollm2):
    """No tool_choice (the Agents SDK's and LangChain's default) is auto: the trigger forced by logit_bias
    (``<tool_call>``'s five tokens) makes a call valid for its schema; the loop's second turn, also auto,
    is answered."""
    tokenizer = smollm2[1]
    bias = {str(tokenizer.encode(t, add_special_tokens=False)[0]): 100 for t in ("<", "tool", "_", "call", ">")}
    first = client.responses.create(
        model=MODEL,
        temperature=0,
        input=ASK,
        tools=TOOLS,
        parallel_tool_calls=False,
        max_output_tokens=80,
        extra_body={"logit_bias": bias},
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    if call.name == "get_weather":
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    turn = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees celsius"},
    ]
    second = client.responses.create(model=MODEL, temperature=0, input=turn, tools=TOOLS, max_output_tokens=16)
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


def test_an_output_needs_its_call_in_the_same_input(client):
    """Nothing is stored between requests: a function_call_output whose call is not in the input is a 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL, input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]
        )
    assert caught.value.body["param"] == "input.0.call_id"


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item():
    from lifeofprompt.serving.responses_protocol import output_from_message

    whole = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    cut = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}
    items = output_from_message({"content": None, "tool_calls": [whole, cut]}, "incomplete")
    assert [(item["type"], item["status"]) for item in items] == [
        ("function_call", "completed"),
        ("function_call", "incomplete"),
    ]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"extra_body": {"background": True}}, "background"),  # an SDK field since 1.67
        ({"extra_body": {"conversation": "conv_123"}}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0"),
        ({"input": [{"type": "item_reference", "id": "msg_123"}]}, "input.0.type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ],
)
def test_what_needs_server_state_is_a_400_naming_the_field(client, fields, param):
    request = {"model": MODEL, "temperature": 0, "input": "hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**request)
    assert refused.value.body["param"] == param


def test_store_false_or_missing_is_served(client):
    for store in ({"store": False}, {}):
        assert client.responses.create(model=MODEL, temperature=0, input="hi", max_output_tokens=2, **store).output_text
