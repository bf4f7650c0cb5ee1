"""The Responses API's wire format, stateless: a ``/v1/responses`` body as a chat request, a chat answer as a response.

OpenAI's newer API (``client.responses.create``; the Agents SDK and LangChain speak it) says the
same things as chat completions in other words: ``input`` (a string, or a list of items:
messages, and the ``function_call`` / ``function_call_output`` items an agent sends back) and
``instructions`` are the conversation; ``max_output_tokens``, ``text.format`` and flat function
``tools`` are ``max_completion_tokens``, ``response_format`` and chat's nested tools. So a body is
translated into a ``ChatCompletionRequest`` here (``chat_request_from``) and answered by the chat
route itself (``responses_api.py``); the chat answer comes back as a ``response`` object
(``response_from_chat``). One pipeline: the same prompt rendering, grammar and tool-call parsing.

What needs a server that remembers (``previous_response_id``, ``store: true``, ``background``,
``conversation``, a stored ``prompt``, ``item_reference`` items) or tools the server would run
itself (web search, file search, ...) is a 400 naming the field. A missing ``store`` means
stateless, as if ``store: false``: nothing is kept after the answer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..errors import InvalidRequestError
from .openai_protocol import ChatCompletionRequest, NullMeansDefault

# asked for with any value but these, a field needs server state (or a feature we lack): a 400 naming it
STATEFUL = {
    "previous_response_id": lambda v: v is None,
    "store": lambda v: v in (None, False),
    "background": lambda v: v in (None, False),
    "conversation": lambda v: v is None,
    "prompt": lambda v: v is None,  # a prompt template stored on OpenAI's side
}
UNSERVED = {
    "reasoning": lambda v: not v or all(x is None for x in v.values()),  # SmolLM2 does not reason
    "include": lambda v: not v or set(v) <= {"reasoning.encrypted_content"},  # we make no reasoning items
    "top_logprobs": lambda v: not v,
    "truncation": lambda v: v in (None, "disabled"),
}
# vLLM's sampling extensions a Responses body may carry too, passed to the chat request as they are
SAMPLING_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SAMPLING_EXTRAS += ("ignore_eos", "logit_bias", "stop")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(NullMeansDefault):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    metadata: dict | None = None
    user: str | None = None
    # declared so that they are refused by name (STATEFUL, UNSERVED), never ignored
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None


def check_stateless(body: ResponsesRequest) -> None:
    for name, fine in {**STATEFUL, **UNSERVED}.items():
        value = getattr(body, name)
        if not fine(value):
            why = "needs server state; this server is stateless" if name in STATEFUL else "is not supported"
            raise InvalidRequestError(f"{name}={value!r} {why}", param=name)


# ----------------------------------------------------------------------------- request → chat


def part_text(content, where: str) -> str | None:
    """Message content as text: a string, or a list of ``input_text`` / ``output_text`` parts."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("content must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"only text content parts (input_text, output_text) are supported, got {kind!r}", param=f"{where}.{j}"
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_message_from(item, i: int) -> dict:
    """One ``input`` item as a chat message: a message, a call the model made, or its result."""
    where = f"input.{i}"
    if not isinstance(item, dict):
        raise InvalidRequestError("an input item must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ("user", "assistant", "system", "developer"):
            raise InvalidRequestError("a message's role is user, assistant, system or developer", param=f"{where}.role")
        return {"role": item["role"], "content": part_text(item.get("content"), f"{where}.content") or ""}
    if kind == "function_call":
        missing = [k for k in ("call_id", "name", "arguments") if not isinstance(item.get(k), str)]
        if missing:
            raise InvalidRequestError(f"a function_call item needs {', '.join(missing)}", param=f"{where}.{missing[0]}")
        call = {"name": item["name"], "arguments": item["arguments"]}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": item["call_id"], "type": "function", "function": call}],
        }
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequestError("a function_call_output item needs call_id", param=f"{where}.call_id")
        output = part_text(item.get("output"), f"{where}.output") or ""
        return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
    why = "needs server state" if kind == "item_reference" else "is not supported"
    raise InvalidRequestError(f"input item type {kind!r} {why}", param=f"{where}.type")


def chat_messages_from(body: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    if not body.input:
        raise InvalidRequestError("input must not be empty", param="input")
    turns = [chat_message_from(item, i) for i, item in enumerate(body.input)]
    check_outputs_follow_calls(turns)
    return messages + turns


def check_outputs_follow_calls(turns: list[dict]) -> None:
    """Stateless, a tool's output must come after the call it answers, in the same ``input`` (as OpenAI
    refuses an output whose call it cannot find): a 400 naming the item, not a prompt with a dangling result."""
    called = set()
    for i, turn in enumerate(turns):
        called |= {call["id"] for call in turn.get("tool_calls") or []}
        if turn["role"] == "tool" and turn["tool_call_id"] not in called:
            raise InvalidRequestError(
                f"no function_call item with call_id {turn['tool_call_id']!r} comes before this output: send the "
                "call too (nothing is stored between requests)",
                param=f"input.{i}.call_id",
            )


def chat_tools_from(tools: list | None) -> list[dict] | None:
    """Responses' flat function tools as chat's nested ones; a tool the server would run itself is a 400."""
    if tools is None:
        return None
    nested = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequestError(
                f"tools.{i}: only function tools are served; built-in tools ({kind!r}) need OpenAI's servers",
                param=f"tools.{i}",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        nested.append({"type": "function", "function": function})
    return nested


def chat_tool_choice_from(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )


def response_format_from(text: dict | None) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise InvalidRequestError(
        "text.format must be {'type': 'text'}, {'type': 'json_object'} or "
        "{'type': 'json_schema', 'name': ..., 'schema': {...}}",
        param="text.format",
    )


def chat_request_from(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks what this Responses body asks (``check_stateless`` first)."""
    check_stateless(body)
    extras = {k: v for k, v in (body.model_extra or {}).items() if k in SAMPLING_EXTRAS}
    fields = dict(
        model=body.model,
        messages=chat_messages_from(body),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=chat_tools_from(body.tools),
        tool_choice=chat_tool_choice_from(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format_from(body.text),
        user=body.user,
        stream=body.stream,
        stream_options={"include_usage": True} if body.stream else None,
        **extras,
    )
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


# chat's names for a field → the Responses API's, so a 400 names what the client sent
PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
PARAM_NAMES |= {"response_format": "text.format", "messages": "input"}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head = param.split(".")[0]
    return PARAM_NAMES.get(head, param) if head in PARAM_NAMES else param


# ----------------------------------------------------------------------------- chat answer → response


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status, "content": [part]}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id=None) -> dict:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def responses_usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """A chat finish reason as the response's ``status`` and ``incomplete_details``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return ("completed", None) if finish_reason is not None else ("in_progress", None)


def response_object(body: ResponsesRequest, response_id: str, model: str, **state) -> dict:
    """The ``response`` object: what the request asked for, echoed as the SDK's ``Response`` requires,
    and its state so far (``status``, ``output``, ``usage``, ``incomplete_details``)."""
    # the grammar holds every call to its tool's schema, as strict mode promises; older SDKs require both fields
    tools = [{"description": None, "parameters": {"type": "object"}, **t, "strict": True} for t in body.tools or []]
    return {
        "id": response_id,
        "object": "response",
        "created_at": state.pop("created_at", int(time.time())),
        "status": state.pop("status", "in_progress"),
        "error": None,
        "incomplete_details": state.pop("incomplete_details", None),
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": state.pop("output", []),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": tools,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": responses_usage(state.pop("usage", None)),
        "user": body.user,
        "metadata": body.metadata or {},
        "background": False,
    }


def call_status(arguments: str) -> str:
    """A function call's item status: "incomplete" when ``max_output_tokens`` cut its arguments short (they do
    not parse), so an agent can tell the one call it must not run from the finished ones."""
    try:
        json.loads(arguments)
    except ValueError:
        return "incomplete"
    return "completed"


def output_from_message(message: dict, status: str) -> list[dict]:
    """A chat message as output items: its text (if any, or if nothing else) then each tool call."""
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "", status))
    for call in calls:
        arguments = call["function"]["arguments"]
        items.append(function_call_item(call["id"], call["function"]["name"], arguments, call_status(arguments)))
    return items


def response_from_chat(body: ResponsesRequest, chat: dict, response_id: str) -> dict:
    (choice,) = chat["choices"]
    status, incomplete = status_of(choice["finish_reason"])
    return response_object(
        body,
        response_id,
        chat["model"],
        created_at=chat["created"],
        status=status,
        incomplete_details=incomplete,
        output=output_from_message(choice["message"], "incomplete" if status == "incomplete" else "completed"),
        usage=chat["usage"],
    )
