"""``/tokenize`` and ``/detokenize``, vLLM's extension: the server's tokenizer, as the engine sees text.

* ``POST /tokenize`` with ``{"prompt": "..."}`` (``add_special_tokens`` defaults to true, as vLLM) or
  ``{"messages": [...]}`` (rendered by the chat template exactly as ``/v1/chat/completions`` does,
  ``add_generation_prompt`` true, ``add_special_tokens`` false by default) →
  ``{"tokens": [...], "count": n, "max_model_len": L}``;
* ``POST /detokenize`` with ``{"tokens": [...]}`` → ``{"prompt": "..."}``;
* ``GET /tokenizer_info`` → the tokenizer's configuration as vLLM serves it: its ``init_kwargs``
  (special tokens as their text, ``model_max_length``, ``chat_template``, ``added_tokens_decoder``,
  ...) without the server's file paths, plus ``tokenizer_class``; ``bos_token``, ``eos_token``,
  ``pad_token`` and ``unk_token`` are always there (null when the tokenizer has none).
  lm-evaluation-harness's ``remote`` tokenizer reads it (it checks ``eos_token``, renders
  ``chat_template`` itself) and then calls ``/tokenize`` with ``{"prompt", "add_special_tokens": false}``
  and ``/detokenize`` with ``{"tokens"}``.

All three sit behind the API key like ``/v1`` (``auth.PROTECTED_PREFIXES``), answer errors in OpenAI's
shape, and run on the server's own tokenizer in its worker thread (``limits.PromptTokenizer``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..engine.llm import render_chat
from ..errors import InvalidRequestError
from .http_errors import error_responses
from .openai_protocol import ChatMessage, check_text, plain_messages
from .tools import tool_conversation

ROUTE_ERRORS = error_responses(400, 401, 404, 413, 500)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(tokenizer, body: TokenizeRequest, plain: list[dict] | None) -> list[int]:
    if plain is None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(tokenizer.encode(body.prompt, add_special_tokens=special))
    chat, tools = tool_conversation(tokenizer, plain, None)  # tool turns rendered as the chat route renders them
    text, ids = render_chat(tokenizer, chat, add_generation_prompt=body.add_generation_prompt, tools=tools)
    return list(tokenizer.encode(text, add_special_tokens=True)) if body.add_special_tokens else ids


def detokenize(tokenizer, tokens: list[int]) -> str:
    try:
        return tokenizer.decode(tokens, skip_special_tokens=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequestError(f"tokens could not be decoded: {exc}", param="tokens") from None


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# where the server keeps its files: no use to a client, and not the client's business
SERVER_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")


def plain_json(value):
    """A tokenizer's settings as JSON: an ``AddedToken`` as its text, dict keys as strings."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tokenizer) -> dict:
    """vLLM's ``/tokenizer_info``: the tokenizer's ``init_kwargs`` less file paths, with its class and chat template."""
    settings = dict(getattr(tokenizer, "init_kwargs", None) or {})
    info = plain_json({k: v for k, v in settings.items() if k not in SERVER_PATHS})
    for name in SPECIAL_TOKENS:
        info.setdefault(name, plain_json(getattr(tokenizer, name, None)))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    info["tokenizer_class"] = type(tokenizer).__name__
    return info


def add_tokenizer_routes(app, engine, prompt_tokenizer, check_model) -> None:
    vocab = engine.model_config.vocab_size
    info = tokenizer_info(engine.tokenizer)

    @app.get("/tokenizer_info", responses=error_responses(401))
    async def tokenizer_info_route() -> dict:
        return info

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ROUTE_ERRORS)
    async def tokenize_route(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt (text) or messages (a chat)", param="prompt")
        plain = None
        if body.messages is not None:
            if not body.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            check_text([m.model_dump() for m in body.messages], "messages")
            plain = plain_messages(body.messages)
        else:
            check_text(body.prompt, "prompt")
        tokens = await prompt_tokenizer.run(tokenize, body, plain)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ROUTE_ERRORS)
    async def detokenize_route(body: DetokenizeRequest):
        check_model(body.model)
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise InvalidRequestError(f"token id {outside[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await prompt_tokenizer.run(detokenize, list(body.tokens))}
