"""Tools over HTTP, the request's side: the tools parsed, the mode chosen, the grammar built, the prompt rendered.

OpenAI's ``tools`` list the functions a model may call, each with a JSON schema for its arguments;
``tool_choice`` says whether it must call one. Every call is written in the **Hermes format**, the
one vLLM ships a chat template and a parser for (and Qwen 2.5/3 and NousHermes are trained on)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and xgrammar's structural tags constrain the answer (``tool_structure``), so every call parses and
its arguments are valid for that tool's ``parameters`` schema:

* ``"auto"`` (OpenAI's default when tools are given): free text, until the model writes the trigger
  ``<tool_call>``; from there the grammar holds it to a call of one of the tools, then free text
  again, and so on (``TriggeredTagsFormat``);
* ``"required"``: one or more calls and nothing else (``TagsWithSeparatorFormat``, a newline between);
* a **named** function (``{"type": "function", "function": {"name": "f"}}``): one call of ``f``;
* ``"none"``: the tools are ignored (not shown to the template either), as OpenAI does.

``parallel_tool_calls: false`` allows at most one call (the grammar stops after the first). The
grammar writes the function's name before its arguments, so a streamed call can name the function
in its first delta (``tool_calls.py`` parses the answer back).

The prompt (``tool_conversation``): a chat template that reads ``tools`` (Qwen's, Hermes') gets
them as they are, with the messages in OpenAI's form. Other templates (SmolLM2's) get our default
tools template: the tools as JSON inside ``<tools></tools>`` in the system prompt with the
instruction to answer in the format above, an assistant turn's ``tool_calls`` written back as
``<tool_call>`` blocks, and ``role: "tool"`` results as a user turn of ``<tool_response>`` blocks.
The grammar is the Hermes one either way: right for Qwen's and Hermes' templates; a model trained on
another format (Llama 3's bare JSON) answers ``auto`` in its own words as ``content``, and its
``required`` and named calls are still written, and parsed, in the Hermes form.

The steps, for any route that serves tools (chat completions; the Responses API can reuse them):
``parse_tools`` → ``tool_mode`` → ``tool_structure`` (the grammar) → ``tool_conversation`` (the
prompt); the answer back through ``tool_calls.message_from`` (whole) or ``ToolCallParser`` +
``deltas_from`` (streamed).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.structured_output import MAX_WHITESPACE, StructuredOutputsParams
from ..errors import InvalidRequestError

ANY_OBJECT = {"type": "object"}
TRIGGER = "<tool_call>"  # the text that starts a call
CALL_OPEN = '<tool_call>\n{"name": "'  # ... the name follows
ARGUMENTS_OPEN = '", "arguments": '  # ... the arguments' JSON follows
CALL_CLOSE = "}\n</tool_call>"  # ... and this ends the call
CALL_SEPARATOR = "\n"  # between the calls of a "required" answer


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


def parse_tools(tools: list | None) -> list[ToolDefinition]:
    """The request's ``tools`` checked one by one: a 400 naming ``tools.i`` for a malformed one."""
    parsed = []
    for i, tool in enumerate(tools or []):
        try:
            parsed.append(ToolDefinition.model_validate(tool))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"tools.{i}: {where}: {first['msg']}", param=f"tools.{i}") from None
    names = [t.function.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    return parsed


def tool_mode(tools: list[ToolDefinition], tool_choice) -> str | None:
    """``None`` (no tools in play), ``"auto"``, ``"required"`` or the name of the function to call."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise InvalidRequestError(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
    if tool_choice in ("auto", "required"):
        return tool_choice
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        name = tool_choice["function"]["name"]
        if name not in {t.function.name for t in tools}:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return name
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template reads a ``tools`` variable (SmolLM2-135M-Instruct's does not)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


# ----------------------------------------------------------------------------- the grammar


def _call_tag(tool: ToolDefinition) -> dict:
    """One tool's call as a structural tag: the fixed opening with its name, arguments valid for its schema."""
    return {
        "type": "tag",
        "begin": CALL_OPEN + tool.function.name + ARGUMENTS_OPEN,
        "content": {
            "type": "json_schema",
            "json_schema": tool.function.parameters or ANY_OBJECT,
            "max_whitespace_cnt": MAX_WHITESPACE,  # random weights would pad an unbounded run forever
        },
        "end": CALL_CLOSE,
    }


def tool_structure(tools: list[ToolDefinition], mode: str, parallel: bool = True) -> StructuredOutputsParams:
    """The structural tag for ``mode`` ("auto", "required" or a function's name), as vLLM's ``structural_tag``."""
    one_call = not parallel
    if mode == "auto":
        tags = [_call_tag(t) for t in tools]
        fmt = {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags, "stop_after_first": one_call}
    elif mode == "required":
        tags = [_call_tag(t) for t in tools]
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": one_call,
        }
    else:
        fmt = _call_tag(next(t for t in tools if t.function.name == mode))
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def tools_error(exc: InvalidRequestError) -> InvalidRequestError:
    """The engine's refusal of a tools grammar, as a 400 that names ``tools`` (the schemas the client sent)."""
    if exc.param != "structured_outputs.structural_tag":
        return exc
    detail = str(exc).split("could not be compiled: ", 1)[-1].strip()
    return InvalidRequestError(f"a tool's parameters schema could not be compiled: {detail}", param="tools")


# ----------------------------------------------------------------------------- the prompt

SYSTEM_TOOLS = (
    "You can call functions to help with the user's request. The functions are listed as JSON "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "Do not guess argument values. To call a function, answer with a JSON object holding its name and "
    "arguments inside <tool_call></tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def tools_system_prompt(tools: list[dict]) -> str:
    """Our default tools template's system text: each tool's function definition as one JSON line."""
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return SYSTEM_TOOLS.format(tools=listed)


def call_text(call: dict) -> str:
    """An assistant's earlier call (OpenAI's ``tool_calls`` entry) as the Hermes block the model would write."""
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            arguments = json.dumps(arguments)  # not JSON: kept, as a JSON string
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_OPEN}{function.get('name', '')}{ARGUMENTS_OPEN}{arguments}{CALL_CLOSE}"


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """OpenAI's messages as plain ``{role, content}`` turns in the Hermes form, for a template that knows no tools.

    The tools join the system prompt (a system message is added if there is none); an assistant's
    ``tool_calls`` follow its text as ``<tool_call>`` blocks; consecutive tool results become one
    user turn of ``<tool_response>`` blocks (templates without tools know no ``tool`` role)."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [call_text(c) for c in message["tool_calls"]])
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
                continue
            out.append({"role": "user", "content": response, "tool_results": True})
            continue
        out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        system = tools_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{system}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def tool_conversation(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list | None]:
    """The conversation and tools to hand the chat template: as they are if it reads ``tools``, else in
    our default (Hermes) form with the tools in the system prompt and no ``tools`` variable."""
    if template_supports_tools(tokenizer):
        return messages, tools
    return hermes_messages(messages, tools), None
