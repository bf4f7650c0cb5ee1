"""Tools over HTTP: a tool call is structured output whose grammar is built from the tools' own schemas.

OpenAI's ``tools`` list the functions a model may call, each with a JSON schema for its arguments;
``tool_choice`` says whether it must call one. We answer the choices a grammar can guarantee:

* a **named** function (``{"type": "function", "function": {"name": "f"}}``): the output is
  constrained to ``f``'s ``parameters`` schema, and that JSON is the call's ``arguments``;
* ``"required"``: the output is one JSON object ``{"name": ..., "arguments": ...}``, an ``anyOf``
  with one branch per tool, each branch pinning ``name`` (``const``) to that tool's name and
  ``arguments`` to its schema. One call per answer (OpenAI's ``parallel_tool_calls`` would be an
  array; an unbounded array lets random weights never close it);
* ``"none"``: the tools are ignored (not shown to the template either), as OpenAI does;
* ``"auto"`` (OpenAI's default when tools are given): the model decides in its own words, which
  needs a chat template that knows tools *and* a parser for the model's tool-call format. We have
  no such parser, so ``auto`` is a 400 unless the template mentions ``tools``; when it does, the
  tools go to the template and the text comes back as ``content``.

The answer comes back as ``tool_calls`` (``id``, ``type: "function"``, ``function: {name,
arguments}``, the arguments as a JSON string) with ``finish_reason: "tool_calls"``. An answer cut
short by ``max_tokens`` is not valid JSON yet: it comes back as ``content`` with ``"length"``.
With random weights the calls still validate, which is how the tests know the grammar did it.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.structured_output import StructuredOutputsParams
from ..errors import InvalidRequestError

ANY_OBJECT = {"type": "object"}


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


def check_auto(tokenizer, model_name: str) -> None:
    if not template_supports_tools(tokenizer):
        raise InvalidRequestError(
            f"tool_choice 'auto' (the default when tools are given) needs a chat template that supports tools, and "
            f"{model_name}'s does not: pass tool_choice 'required' or "
            "{'type': 'function', 'function': {'name': ...}} "
            "(the output is then constrained to the tools' schemas), or 'none'",
            param="tool_choice",
        )


def tool_structure(tools: list[ToolDefinition], mode: str) -> StructuredOutputsParams:
    """The grammar for ``mode`` ("required" or a function's name) as a JSON schema."""
    schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
    if mode != "required":
        return StructuredOutputsParams(json=schemas[mode])
    branches = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": schema},
        }
        for name, schema in schemas.items()
    ]
    return StructuredOutputsParams(json=branches[0] if len(branches) == 1 else {"anyOf": branches})


def tool_calls_from(text: str, mode: str) -> list[dict] | None:
    """The answer as OpenAI's ``tool_calls``; None if it is not (yet) a complete call (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if mode == "required":
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "arguments" not in value:
            return None
        name, arguments = value["name"], value["arguments"]
    else:
        name, arguments = mode, value
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
    ]
