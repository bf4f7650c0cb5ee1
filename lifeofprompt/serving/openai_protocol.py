"""OpenAI's wire format, as our server speaks it: request bodies in, responses and errors out.

The bodies are pydantic models, so a missing field or a wrong type becomes a 400 naming the
field; the values then go through ``SamplingParams``, whose own checks raise the typed errors of
``lifeofprompt.errors``. vLLM's extensions are accepted where benchmarks use them
(``ignore_eos``, ``top_k``, ``min_p``, ``return_token_ids``); what we do not support
(``n > 1``, ``logprobs``, penalties) is refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError, LifeOfPromptError
from ..engine.llm import render_chat
from ..engine.sampling_params import SamplingParams


class _Body(BaseModel):
    """Unknown fields are ignored, as OpenAI-compatible servers do (clients send many)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                 # vLLM's extension
    min_p: float | None = None               # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    ignore_eos: bool = False                 # vLLM's extension, for benchmarks
    return_token_ids: bool = False           # vLLM's extension: choices carry the generated token ids
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def sampling_params_from(body: _Body, default_max_tokens: int | None) -> SamplingParams:
    """OpenAI's fields → ``SamplingParams`` (its validation raises typed errors naming the field)."""
    if body.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")
    if body.logprobs not in (None, False):
        raise InvalidRequestError("logprobs are not supported", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise InvalidRequestError(f"{name} is not supported", param=name)
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    kwargs = dict(max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                  stop=body.stop, seed=body.seed, ignore_eos=body.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    return SamplingParams(**kwargs)


def completion_prompts(prompt) -> list:
    """``prompt`` as OpenAI allows it (text, token ids, or a list of either) → a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """The model's own chat template, ending with the assistant's turn, as token ids."""
    plain = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):       # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" for part in content):
                raise InvalidRequestError("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(str(part.get("text", "")) for part in content)
        plain.append({"role": message.role, "content": content or ""})
    return render_chat(tokenizer, plain)[1]


# ----------------------------------------------------------------------------- responses


def error_body(message: str, error_type: str, param: str | None = None, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: Exception):
    """A typed error → its HTTP status and OpenAI's error shape (anything else is a 500)."""
    if isinstance(exc, LifeOfPromptError):
        status, error_type = exc.http_status, exc.error_type
    else:
        status, error_type = 500, "internal_error"
    return JSONResponse(error_body(str(exc), error_type, getattr(exc, "param", None), status), status_code=status)


def usage_field(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_finish_reason(completion) -> str | None:
    reason = completion.finish_reason
    return None if reason is None else ("stop" if reason == "abort" else reason)


def sse_event(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
