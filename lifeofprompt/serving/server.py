"""An OpenAI-compatible HTTP server around ``LLMEngine``.

Two threads share the work, so that a step on the CPU never blocks the network:

* the **engine thread** (``engine_loop.EngineLoop``) does nothing but call ``engine.step()``
  while there is work, and hands each ``RequestOutput`` to the asyncio queue of the HTTP request
  that owns it;
* the **event loop** (FastAPI on uvicorn) checks and parses requests, tokenizes them on its own
  tokenizer in a worker thread, calls the engine's thread-safe ``add_request`` / ``abort``, and
  awaits its queue, turning outputs into JSON or into server-sent events in OpenAI's chunk format.

One bad request never hurts another: a request that fails in a step ends alone, with its typed
error (``lifeofprompt.errors``: its HTTP status and OpenAI type), in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; every error is, FastAPI's own included
(``http_errors.py``). What a request may ask for is limited before any work (``limits.py``); the
door has an optional API key (``auth.py``); on SIGTERM the server drains (``engine_loop.py``).
The wire format lives in ``openai_protocol.py``, the answers' shapes in ``choices.py`` (``n``,
logprobs, tool calls: ``tools.py``), vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in
``tokenizer_routes.py``, the ``/metrics`` page in ``server_metrics.py``; every answer echoes the
request's ``X-Request-Id`` (``request_id.py``); ``/v1/responses``, stateless, is answered by the chat
route (``responses_api.py``).

    python -m lifeofprompt serve --model smollm2-135m --port 8000

The chapters and tests run the same app in a background thread: ``lessons/server_thread.py``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..engine.logs import log_to_stderr
from .auth import ApiKeyMiddleware, exposure_warning
from .engine_loop import EngineLoop
from .http_errors import document_errors, install_error_handlers
from .limits import MAX_N, BodySizeLimit, PromptTokenizer, ServerLimits, default_max_waiting
from .openai_routes import Endpoints
from .request_id import RequestIdMiddleware
from .responses_api import add_responses_route
from .tokenizer_routes import add_tokenizer_routes

__all__ = ["EngineLoop", "ServerConfig", "build_app", "door_settings", "serve", "uvicorn_server"]

logger = logging.getLogger("lifeofprompt.server")
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class ServerConfig:
    """What the ``serve`` flags set beyond the engine (see ``python -m lifeofprompt serve --help``)."""

    api_key: str | None = None
    enable_docs: bool = False
    allowed_origins: list[str] | None = None
    limits: ServerLimits | None = None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    bound_max_waiting: bool = True  # an unbounded engine queue gets default_max_waiting()


def build_app(
    engine, model_name: str | None = None, engine_loop: EngineLoop | None = None, config: ServerConfig | None = None
):
    """The FastAPI app over an ``LLMEngine``: the door (body size, key, CORS), every error in OpenAI's shape,
    the OpenAI routes (``openai_routes.py``) and vLLM's tokenizer routes; the engine thread starts and stops
    with the app."""
    config = config or ServerConfig()
    limits = config.limits or ServerLimits()
    model_name = model_name or engine.model_name
    engine_loop = engine_loop or EngineLoop(engine)
    if config.bound_max_waiting and engine.max_waiting is None:
        engine.max_waiting = default_max_waiting(engine.resolved.max_num_seqs)
    prompt_tokenizer = PromptTokenizer(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()
            prompt_tokenizer.close()

    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json")
    app = FastAPI(
        title="lifeofprompt",
        description="An OpenAI-compatible server over a vLLM-style engine built from scratch.",
        version="1",
        lifespan=lifespan,
        **(docs if config.enable_docs else dict.fromkeys(docs)),
    )
    app.state.engine, app.state.engine_loop, app.state.model_name = engine, engine_loop, model_name
    app.state.config, app.state.prompt_tokenizer = config, prompt_tokenizer
    install_error_handlers(app)
    document_errors(app)
    app.add_middleware(BodySizeLimit, limit=limits.max_request_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        origins = list(config.allowed_origins)
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so the door's own errors carry the id too
    endpoints = Endpoints(engine, engine_loop, model_name, limits, prompt_tokenizer)
    endpoints.add_to(app)
    add_tokenizer_routes(app, engine, prompt_tokenizer, endpoints.check_model)
    add_responses_route(app, endpoints)
    return app


# ----------------------------------------------------------------------------- running it


def uvicorn_server(app, host: str, port: int, log_level: str, shutdown_timeout: float):
    """uvicorn, told of SIGTERM before it starts closing connections: the engine loop drains."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.engine_loop.begin_shutdown(shutdown_timeout)
            super().handle_exit(sig, frame)

    # uvicorn waits for open connections a little longer than the drain, so aborted requests still get their answer
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=shutdown_timeout + 5
    )
    return Server(config)


def _bytes(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n:,} bytes"


def door_settings(engine, config: ServerConfig) -> str:
    """The start-up line that says how the door is set: the key, what a request may carry, how many
    wait, and how much of a step one long prompt may take (every one a ``serve`` flag)."""
    limits = config.limits or ServerLimits()
    sched = engine.resolved.scheduler
    key = (
        "API key on (/v1/*, /tokenize, /detokenize, /tokenizer_info; /health and /metrics open)"
        if config.api_key is not None
        else "API key off"
    )
    cors = f"CORS for {', '.join(config.allowed_origins)}" if config.allowed_origins else "CORS off"
    waiting = "unbounded waiting" if engine.max_waiting is None else f"{engine.max_waiting} waiting"
    threshold = sched.long_prefill_token_threshold
    fair = (
        f"a prompt's chunk at most {threshold} of {sched.max_num_batched_tokens} tokens a step while others wait or run"
        if threshold
        else f"off (a prompt's chunk may take all {sched.max_num_batched_tokens} tokens of a step)"
    )
    return (
        f"door: {key}; docs {'on' if config.enable_docs else 'off'}; {cors}; requests: bodies up to "
        f"{_bytes(limits.max_request_bytes)}, up to {limits.max_prompts_per_request} prompts and n <= {MAX_N}; "
        f"queue: {sched.max_num_seqs} running + {waiting}, then 503 with Retry-After; fair prefill: {fair}; "
        f"shutdown: running requests get {config.shutdown_timeout:g} s"
    )


def serve(
    engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    config: ServerConfig | None = None,
    log_level: str = "info",
) -> None:
    """Run the server in the foreground until Ctrl-C or SIGTERM (then it drains: ``engine_loop.py``).

    The server's log lines (the exposure warning, the door's settings, the shutdown) go to stderr
    unless the program has set logging up itself."""
    config = config or ServerConfig()
    log_to_stderr(logger, "server")
    warning = exposure_warning(host, config.api_key)
    if warning:
        logger.warning(warning)
    app = build_app(engine, model_name=model_name, config=config)
    logger.info(door_settings(engine, config))
    uvicorn_server(app, host, port, log_level, config.shutdown_timeout).run()
