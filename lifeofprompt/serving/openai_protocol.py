"""OpenAI's wire format, as our server speaks it: request bodies in, responses out.

The bodies are pydantic models, so a missing field or a wrong type becomes a 400 naming the
field; the values then go through ``SamplingParams``, whose own checks raise the typed errors of
``lifeofprompt.errors``. vLLM's extensions are accepted where benchmarks use them
(``ignore_eos``, ``top_k``, ``min_p``, ``return_token_ids``). ``n`` answers per prompt are seeded
``seed``, ``seed + 1``, ...; log-probabilities come in OpenAI's shapes (``openai_logprobs.py``);
``tools`` are answered through the grammar (``tools.py``).

Nothing is silently ignored: every field of OpenAI's (or vLLM's) API that we do not serve yet is
declared here and refused by name (``UNSUPPORTED``) as soon as it asks for anything, so a client
that asks for JSON never gets prose back without a word. Fields nobody has heard of are still
accepted, as OpenAI-compatible servers do (clients send many).

The response models are what ``/openapi.json`` documents and what the schemathesis suite checks
every answer against (``tests/test_server_fuzz.py``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine.sampling_params import SamplingParams
from ..engine.structured_output import StructuredOutputsParams
from ..errors import InvalidRequestError
from .limits import MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from .openai_logprobs import ChatLogprobs, CompletionLogprobs
from .tools import ToolCall


class NullMeansDefault(BaseModel):
    """A request body where ``null`` for an optional field means its default, as OpenAI reads it:
    clients (and SDKs that serialize every attribute) send ``"n": null`` or ``"stream": null``.
    A required field that is null is still a 400 naming it."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class _Body(NullMeansDefault):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    min_p: float | None = None  # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    return_token_ids: bool = False  # vLLM's extension: choices carry the generated token ids
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias in [-100, 100]
    min_tokens: int | None = None  # vLLM's
    logprobs: Any = None  # completions: an int (top N); chat: a bool, with top_logprobs
    top_logprobs: int | None = None
    # declared so that they are refused by name (UNSUPPORTED), never ignored
    response_format: Any = None
    guided_json: Any = None  # vLLM's structured output
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool | None = None  # vLLM's


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None  # the prompt before the answer; with logprobs, its tokens' too (choices.py)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's top N, as the choice's prompt_logprobs
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(NullMeansDefault):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call (tools.tool_structure)
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None


def _is_text_format(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1


# field -> the values that ask for nothing (anything else is refused, naming the field)
UNSUPPORTED = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "use_beam_search": lambda v: not v,
}


# include_usage: a last chunk with the totals; continuous_usage_stats (vLLM's, for benchmarks): usage on every chunk
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def check_supported(body: _Body) -> None:
    """Caps first (n, top_logprobs, logit_bias: served later within these; stop), then a 400
    naming the first field that asks for something we do not do."""
    if body.n > MAX_N or body.n < 1:
        raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {body.n}", param="n")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if body.logit_bias is not None and len(body.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    for name, asks_nothing in UNSUPPORTED.items():
        if name in type(body).model_fields and not asks_nothing(getattr(body, name)):
            raise InvalidRequestError(f"{name}={getattr(body, name)!r} is not supported by this server yet", param=name)
    options = body.stream_options or {}
    if set(options) - set(STREAM_OPTIONS):
        raise InvalidRequestError(
            f"stream_options supports only {' and '.join(STREAM_OPTIONS)}, got {sorted(options)}",
            param="stream_options",
        )


def check_text(value, param: str) -> None:
    """A 400 for text that is not Unicode a tokenizer can take: a lone surrogate (JSON's "\\ud800")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"{param} is not valid Unicode: a lone surrogate at character {exc.start}", param=param
            ) from None
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_text(item, f"{param}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, f"{param}.{key}")


def num_logprobs(body: _Body) -> int | None:
    """How many alternatives per token the request asks for (None: no logprobs), as each endpoint spells it."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs not in (None, True, False):
            raise InvalidRequestError(
                "logprobs must be true or false (top_logprobs gives how many alternatives)", param="logprobs"
            )
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None:
        raise InvalidRequestError("top_logprobs is a chat field; completions take logprobs: N", param="top_logprobs")
    value = body.logprobs
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
    return value


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The engine's ``prompt_logprobs`` for a completions request: vLLM's field as asked, else ``echo`` with
    ``logprobs: N`` scores the echoed prompt's tokens with the same N (as vLLM does), else None. vLLM's
    field is not streamed (as in vLLM), and with ``echo`` it must ask for the same N as ``logprobs``."""
    echoed = num_logprobs(body) if body.echo else None
    asked = body.prompt_logprobs
    if asked is None:
        return echoed
    if body.stream:
        raise InvalidRequestError("prompt_logprobs is not streamed: ask without stream", param="prompt_logprobs")
    if echoed is not None and echoed != asked:
        raise InvalidRequestError(
            f"prompt_logprobs ({asked}) and echo's logprobs ({echoed}) ask for two different top N",
            param="prompt_logprobs",
        )
    return asked


def sampling_params_from(
    body: _Body, default_max_tokens: int | None, tool_structure: StructuredOutputsParams | None = None
) -> SamplingParams:
    """OpenAI's fields → ``SamplingParams`` (its validation raises typed errors naming the field).

    ``tool_structure``: the grammar of the request's tool call (``tools.tool_structure``), if any."""
    check_supported(body)
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    kwargs = dict(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        stop=body.stop,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=num_logprobs(body),
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
    ):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.logit_bias:
        kwargs["logit_bias"] = logit_bias_from(body.logit_bias)
    structured = structured_outputs_from(body)
    if tool_structure is not None:
        if structured is not None:
            raise InvalidRequestError(
                "a tool call is already structured output: ask for tools or a response format, not both",
                param="tool_choice",
            )
        structured = tool_structure
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return SamplingParams(**kwargs)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_from(body: _Body) -> StructuredOutputsParams | None:
    """``response_format`` (OpenAI), ``structured_outputs`` (vLLM's extra body field) or vLLM's older
    ``guided_*`` fields as one ``StructuredOutputsParams``; a 400 naming the field for anything else."""
    asked = []
    fmt = body.response_format
    if fmt is not None and not _is_text_format(fmt):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", dict(json_object=True)))
        elif (
            kind == "json_schema"
            and isinstance(fmt.get("json_schema"), dict)
            and isinstance(fmt["json_schema"].get("schema"), dict)
        ):
            asked.append(("response_format", dict(json=fmt["json_schema"]["schema"])))
        else:
            raise InvalidRequestError(
                "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                param="response_format",
            )
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise InvalidRequestError(
                "structured_outputs must be an object such as {'json': {...}} or {'regex': '...'}",
                param="structured_outputs",
            )
        asked.append(("structured_outputs", dict(body.structured_outputs)))
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            asked.append((name, {kind: getattr(body, name)}))
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequestError(
            f"ask for one structure only, got {', '.join(n for n, _ in asked)}", param=asked[1][0]
        )
    name, fields = asked[0]
    try:
        return StructuredOutputsParams(**fields)
    except TypeError:
        raise InvalidRequestError(f"{name} has unknown fields: {sorted(fields)}", param=name) from None


def logit_bias_from(value: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (JSON keys are strings) as ``{int: float}``; a 400 for a key that is no id."""
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
        out[token] = bias
    return out


def completion_prompts(prompt) -> list:
    """``prompt`` as OpenAI allows it (text, token ids, or a list of either) → a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """``{"role", "content"}`` dicts with text content, as a chat template takes them; an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` / ``name`` are kept (``tools.tool_conversation``
    renders them)."""
    plain = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" or not isinstance(part.get("text", ""), str) for part in content):
                raise InvalidRequestError("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(part.get("text", "") for part in content)
        entry = {"role": message.role, "content": content or ""}
        extra = message.model_extra or {}
        if message.role == "assistant" and extra.get("tool_calls"):
            if not isinstance(extra["tool_calls"], list) or not all(isinstance(c, dict) for c in extra["tool_calls"]):
                raise InvalidRequestError("tool_calls must be a list of calls", param=f"messages.{i}.tool_calls")
            entry["tool_calls"] = extra["tool_calls"]
        for name in ("tool_call_id", "name") if message.role == "tool" else ():
            if isinstance(extra.get(name), str):
                entry[name] = extra[name]
        plain.append(entry)
    return plain


# ----------------------------------------------------------------------------- responses


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every error this server answers has it."""

    error: ErrorDetail


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # token_ids with return_token_ids

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


def usage_field(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_finish_reason(completion) -> str | None:
    """Ours → OpenAI's: an aborted request (a client gone, a server shutting down) says "abort", as vLLM does;
    the official client accepts it (it does not validate the value)."""
    return completion.finish_reason


def sse_event(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
