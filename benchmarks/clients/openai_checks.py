"""The openai SDK against our server: ``python openai_checks.py CHECK`` (base URL from $CLIENTS_BASE_URL).

Checks: ``responses`` (client.responses.create), ``responses_stream``, ``chat_tools_stream`` (a streamed chat
with tools and no tool_choice, so OpenAI's default "auto"), ``chat_required_stream`` (the same with
tool_choice "required"), ``chat_named_stream`` (a named tool_choice). Exit 0 when the protocol worked; what the
135M model chose is printed, not judged.
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

BASE_URL = os.environ.get("CLIENTS_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("CLIENTS_MODEL", "smollm2-135m")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


def responses(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello in one word.", max_output_tokens=16, temperature=0)
    print("status:", response.status, "| output_text:", repr(response.output_text))


def responses_stream(client: OpenAI) -> None:
    """Raw events: a cut answer ends with response.incomplete, which the SDK's stream().get_final_response()
    does not accept (it wants response.completed), so the events are read as they come."""
    events, text = [], ""
    for event in client.responses.create(
        model=MODEL, input="Count to three.", max_output_tokens=32, temperature=0, stream=True
    ):
        events.append(event.type)
        text += getattr(event, "delta", "") if event.type == "response.output_text.delta" else ""
    print("events:", list(dict.fromkeys(events)), "| text:", repr(text))
    if events[:1] != ["response.created"] or events[-1] not in ("response.completed", "response.incomplete"):
        sys.exit("the stream must open with response.created and end with response.completed or .incomplete")


def chat_stream(client: OpenAI, **tool_choice) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], stream=True, max_tokens=96, temperature=0, **tool_choice
    )
    text, calls, finish, repeated = "", {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        indexes = [delta.index for delta in choice.delta.tool_calls or []]
        if len(indexes) != len(set(indexes)):  # clients that read tool_calls[0] of each chunk would lose text
            repeated.append(indexes)
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "deltas": 0})
            call["deltas"] += 1
            call["name"] += (delta.function and delta.function.name) or ""
            call["arguments"] += (delta.function and delta.function.arguments) or ""
        finish = choice.finish_reason or finish
    print("finish_reason:", finish, "| text:", repr(text), "| tool_calls:", list(calls.values()))
    if repeated:
        sys.exit(f"a chunk carried several tool_calls entries for one index: {repeated[:3]}")
    for call in calls.values():  # the concatenated deltas must be JSON, unless max_tokens cut the answer
        if finish == "tool_calls":
            json.loads(call["arguments"])


CHECKS = {
    "responses": responses,
    "responses_stream": responses_stream,
    "chat_tools_stream": lambda client: chat_stream(client),
    "chat_required_stream": lambda client: chat_stream(client, tool_choice="required"),
    "chat_named_stream": lambda client: chat_stream(
        client, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ),
}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](OpenAI(base_url=BASE_URL, api_key="x", max_retries=0))
