"""Limits before work: a request is measured before the server spends anything on it.

In the order a request meets them:

1. **the body** (``BodySizeLimit``): more than ``max_request_bytes`` is answered 413 before a
   byte of JSON is parsed, from ``Content-Length`` when the client sends one, else while the body
   streams in;
2. **the counts**: at most ``MAX_N`` answers, ``MAX_PROMPTS_PER_REQUEST`` prompts,
   ``MAX_TOP_LOGPROBS`` (20, as OpenAI), ``MAX_LOGIT_BIAS_ENTRIES`` (300, as OpenAI) and
   ``MAX_STOP_STRINGS`` (16; each is searched for in the text after every token);
3. **the characters** (``check_prompt_chars``): no token of the vocabulary is longer than
   ``longest_token_chars`` characters, so a prompt with more than that many times
   ``max_model_len`` characters cannot fit and is refused without being tokenized;
4. **the tokens**: the server tokenizes off the event loop, on its own copy of the tokenizer
   (``PromptTokenizer``), so a long prompt never stalls ``/health`` nor the engine thread's
   detokenizer; then the engine checks prompt + ``max_tokens`` against the context and the pool.
"""

from __future__ import annotations

import asyncio
import copy
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from ..errors import RequestTooLargeError

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # 4 MiB: a 128k-token prompt as text or as ids fits
MAX_N = 16
MAX_PROMPTS_PER_REQUEST = 64
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_STOP_STRINGS = 16  # OpenAI takes 4; every one is searched for after every token
WAITING_PER_SEQ = 4  # the default max_waiting: four full batches of work queued


@dataclass
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST


def default_max_waiting(max_num_seqs: int) -> int:
    """A bounded queue by default: beyond four batches' worth of waiting requests a client learns
    sooner, with a 503 and Retry-After, that it should come back (or go to another replica)."""
    return WAITING_PER_SEQ * max_num_seqs


def _too_large_body(limit: int) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": f"the request body is larger than the server's limit of {limit} bytes (--max-request-bytes)",
                "type": "request_too_large",
                "param": None,
                "code": 413,
            }
        }
    ).encode()


class BodySizeLimit:
    """ASGI middleware: a body over ``limit`` bytes gets 413 before the app reads (or parses) it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # FastAPI re-raises an HTTPException met while reading the body
                    raise HTTPException(413, json.loads(_too_large_body(self.limit))["error"]["message"])
            return message

        await self.app(scope, counted_receive, send)

    async def _refuse(self, send):
        body = _too_large_body(self.limit)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def longest_token_chars(tokenizer, fallback: int = 64) -> int:
    """The longest token of the vocabulary, in characters (a byte-level token's string is at least as
    long as the text it stands for); ``fallback`` for a tokenizer without ``get_vocab``."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return 1 if getattr(tokenizer, "is_stand_in", False) else fallback
    return max((len(token) for token in get_vocab()), default=fallback)


def check_prompt_chars(num_chars: int, max_model_len: int, chars_per_token: int, param: str = "prompt") -> None:
    """413 for text that cannot fit ``max_model_len`` tokens whatever its tokenization."""
    limit = max_model_len * chars_per_token
    if num_chars > limit:
        raise RequestTooLargeError(
            f"the {param} has {num_chars} characters: more than {max_model_len} tokens "
            f"(the engine's limit) whatever its tokenization (at most {chars_per_token} "
            "characters a token)",
            param=param,
        )


class PromptTokenizer:
    """The server's own tokenizer, used in one worker thread, off the event loop.

    A copy, not the engine's instance: the engine thread detokenizes every step with its own, and
    Hugging Face's fast tokenizers must not be used from two threads at once, so sharing one (and
    its lock) would let a long prompt stall every stream.
    """

    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        self.executor: ThreadPoolExecutor | None = None

    async def run(self, fn, *args):
        """``fn(tokenizer, *args)`` in the worker thread (started at first use, again after ``close``)."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lifeofprompt-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, self.tokenizer, *args)

    def close(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
