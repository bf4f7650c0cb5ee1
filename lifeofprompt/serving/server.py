"""An OpenAI-compatible HTTP server around ``LLMEngine``.

Two threads share the work, so that a step on the CPU never blocks the network:

* the **engine thread** (``EngineLoop``) does nothing but call ``engine.step()`` while there is
  work, and hands each ``RequestOutput`` to the asyncio queue of the HTTP request that owns it
  through ``loop.call_soon_threadsafe``;
* the **event loop** (FastAPI on uvicorn) parses requests, calls the engine's thread-safe
  ``add_request`` / ``abort``, and awaits its queue, turning outputs into JSON or into
  server-sent events in OpenAI's chunk format.

A client that goes away mid-stream aborts its request, so its KV blocks return at once. Every
error the project raises on purpose (``lifeofprompt.errors``) carries its HTTP status and
OpenAI error type; the server answers it in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, and keeps serving everyone else. The wire
format lives in ``openai_protocol.py``, the ``/metrics`` page in ``server_metrics.py``.

    python -m lifeofprompt serve --model smollm2-135m --port 8000

    from lifeofprompt.serving.server import ServerThread
    with ServerThread(engine) as server:          # 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..errors import InvalidRequestError, LifeOfPromptError, ModelNotFoundError, RequestNotFoundError
from .openai_protocol import (ChatCompletionRequest, CompletionRequest, chat_prompt_ids, completion_prompts, error_body,
                              error_response, openai_finish_reason, sampling_params_from, sse_event, usage_field)
from ..engine.sampling_params import SamplingParams
from .server_metrics import ServerStats, render_metrics

logger = logging.getLogger("lifeofprompt.server")


# ----------------------------------------------------------------------------- the engine thread


class EngineLoop:
    """Drives ``engine.step()`` in its own thread and routes each output to its waiting request.

    ``routes`` maps a request id to the asyncio loop and queue of the HTTP request that owns it.
    The route is registered *before* ``add_request``, so no output can arrive unclaimed; it is
    dropped when the request finishes or is aborted, so late outputs of an aborted request fall
    on the floor.
    """

    def __init__(self, engine, stats: "ServerStats | None" = None, idle_wait: float = 0.05):
        self.engine = engine
        self.stats = stats or ServerStats()
        self.idle_wait = idle_wait
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()        # set when work arrives, so an idle loop starts at once
        self.stopping = threading.Event()
        self.resumed = threading.Event()     # cleared by pause(): tests hold the engine still
        self.resumed.set()
        self.held = threading.Event()        # set while the thread sits paused
        self.thread: threading.Thread | None = None
        self.num_steps = 0
        self.last_error: str | None = None

    # -- lifecycle
    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.stopping.clear()
            self.thread = threading.Thread(target=self._run, name="lifeofprompt-engine", daemon=True)
            self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping.set()
        self.resumed.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout)
        self.thread = None

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def pause(self, timeout: float = 30.0) -> None:
        """Stop stepping after the current step and wait until the thread is held (requests still
        queue up in the engine's inbox): for tests of a full queue."""
        self.resumed.clear()
        self.wake.set()
        if self.alive and not self.held.wait(timeout):
            raise RuntimeError("the engine thread did not pause")

    def resume(self) -> None:
        self.resumed.set()
        self.wake.set()

    # -- called from the event loop
    def add(self, request_id: str, prompt, params: SamplingParams, queue: asyncio.Queue,
            loop: asyncio.AbstractEventLoop, arrival_time: float | None = None) -> None:
        """Register the route, then hand the request to the engine (its typed errors propagate)."""
        with self.lock:
            self.routes[request_id] = (loop, queue)
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
        except BaseException:
            with self.lock:
                self.routes.pop(request_id, None)
            raise
        self.wake.set()

    def abort(self, request_id: str) -> None:
        """Forget the route and free the request's blocks; a request that already finished is fine."""
        with self.lock:
            known = self.routes.pop(request_id, None) is not None
        if known:
            try:
                self.engine.abort(request_id)
            except RequestNotFoundError:
                pass
            self.wake.set()

    # -- the thread
    def _run(self) -> None:
        while not self.stopping.is_set():
            if not self.resumed.is_set():
                self.held.set()
                self.resumed.wait()
                self.held.clear()
            if self.stopping.is_set():
                break
            self.wake.clear()
            if not self.engine.has_unfinished_requests():
                self.wake.wait(self.idle_wait)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:   # a bug in a step must not kill the server: fail the requests in flight
                self.last_error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                logger.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all(exc)
                continue
            self.num_steps += 1
            for output in outputs:
                self._deliver(output)

    def _deliver(self, output) -> None:
        with self.lock:
            route = self.routes.get(output.request_id)
            if route is not None and output.finished:
                del self.routes[output.request_id]
        if output.finished:
            self.stats.observe_finished(output)
        if route is None:
            return
        loop, queue = route
        try:    # a request that failed alone gets its typed error; everyone else's outputs go on
            loop.call_soon_threadsafe(queue.put_nowait, output if output.error is None else output.error)
        except RuntimeError:           # the event loop is closed: the server is going down
            pass

    def _fail_all(self, exc: Exception) -> None:
        with self.lock:
            routes, self.routes = self.routes, {}
        for request_id, (loop, queue) in routes.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                pass
            try:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            except RuntimeError:
                pass


# ----------------------------------------------------------------------------- the app

CLIENT_GONE = object()       # put in a request's queue when its client disconnects
DISCONNECT_POLL_S = 0.5


class _EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends.

    The generator's own ``finally`` covers a client that leaves mid-stream; this covers one that
    leaves before the first chunk, when the generator has not started and has no ``finally`` to run.
    """

    def __init__(self, content, submission: "_Submission"):
        super().__init__(content, media_type="text/event-stream")
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.abort()


class _Submission:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs land in."""

    def __init__(self, loop_: EngineLoop, kind: str):
        self.engine_loop = loop_
        self.queue: asyncio.Queue = asyncio.Queue()
        self.id = f"{kind}-{uuid.uuid4().hex[:24]}"
        self.request_ids: list[str] = []
        self.finished: set[str] = set()

    def add(self, prompts: list, params: SamplingParams) -> None:
        """Add every prompt, or none: a prompt the engine refuses aborts the ones already added."""
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        try:
            for index, prompt in enumerate(prompts):
                request_id = f"{self.id}-{index}"
                self.engine_loop.add(request_id, prompt, params, self.queue, loop, arrival_time=arrival)
                self.request_ids.append(request_id)
        except BaseException:
            self.abort()
            raise

    async def outputs(self):
        """Yield ``(index, RequestOutput)`` as the engine thread delivers them, until all finish."""
        index_of = {rid: i for i, rid in enumerate(self.request_ids)}
        while len(self.finished) < len(self.request_ids):
            output = await self.queue.get()
            if output is CLIENT_GONE:
                return
            if isinstance(output, BaseException):
                raise output
            if output.finished:
                self.finished.add(output.request_id)
            yield index_of[output.request_id], output

    def abort(self) -> None:
        for request_id in self.request_ids:
            if request_id not in self.finished:
                self.engine_loop.abort(request_id)


def build_app(engine, model_name: str | None = None, engine_loop: EngineLoop | None = None):
    """The FastAPI app over an ``LLMEngine``; the engine thread starts and stops with the app."""
    model_name = model_name or getattr(engine, "model_name", None) or "lifeofprompt"
    engine_loop = engine_loop or EngineLoop(engine)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    app = FastAPI(title="lifeofprompt", description="An OpenAI-compatible server over a vLLM-style engine built from scratch.",
                  version="1", lifespan=lifespan)
    app.state.engine = engine
    app.state.engine_loop = engine_loop
    app.state.model_name = model_name

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if loc:
            message = f"{'.'.join(loc)}: {message}"
        return JSONResponse(error_body(message, "invalid_request_error", ".".join(loc) or None, 400), status_code=400)

    @app.exception_handler(LifeOfPromptError)
    async def _typed_error(request: Request, exc: LifeOfPromptError):
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception):   # a failed step: 500, still in OpenAI's shape
        return error_response(exc)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise ModelNotFoundError(f"the model {requested!r} does not exist; this server runs {model_name!r}")

    async def wait_or_disconnect(request: Request, submission: _Submission) -> dict[int, Any] | None:
        """Every final output by prompt index; None if the client went away first (its requests are aborted).

        A watcher polls the connection twice a second while the outputs arrive, so a client that
        gives up on a long completion frees its blocks within half a second, not at the end.
        """
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            submission.abort()
            submission.queue.put_nowait(CLIENT_GONE)

        watcher = asyncio.create_task(watch())
        finals: dict[int, Any] = {}
        try:
            async for index, output in submission.outputs():
                finals[index] = output
        except asyncio.CancelledError:
            submission.abort()
            raise
        finally:
            watcher.cancel()
        return finals if len(submission.finished) == len(submission.request_ids) else None

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(render_metrics(engine, engine_loop.stats, model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "lifeofprompt",
            "max_model_len": getattr(engine, "max_model_len", None)}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.echo or body.suffix or (body.best_of or 1) > 1:
            raise InvalidRequestError("echo, suffix and best_of are not supported", param="echo")
        params = sampling_params_from(body, default_max_tokens=16)
        submission = _Submission(engine_loop, "cmpl")
        submission.add(completion_prompts(body.prompt), params)
        if body.stream:
            return _EventStream(stream_completion(submission, body), submission)
        finals = await wait_or_disconnect(request, submission)
        if finals is None:
            return JSONResponse(error_body("client disconnected", "aborted", None, 499), status_code=499)
        choices = [{"index": i, "text": out.outputs[0].text, "logprobs": None,
                    "finish_reason": openai_finish_reason(out.outputs[0])} for i, out in sorted(finals.items())]
        if body.return_token_ids:
            for choice in choices:
                choice["token_ids"] = list(finals[choice["index"]].outputs[0].token_ids)
        return {"id": submission.id, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": usage_field(sum(len(o.prompt_token_ids) for o in finals.values()),
                                                    sum(len(o.outputs[0].token_ids) for o in finals.values()))}

    async def stream_choices(submission: _Submission, body, object_name: str, make_choice, opening=None):
        """Server-sent events for one streamed request: OpenAI's chunk envelope around each delta.

        ``make_choice(index, text, finish_reason)`` shapes a choice (completion text or chat delta);
        ``opening`` is a first choice to send before any text (the chat role).
        """
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(choices, usage=None):
            payload = {"id": submission.id, "object": object_name, "created": int(time.time()),
                       "model": model_name, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return sse_event(payload)

        if opening is not None:
            yield chunk([opening])
        async for kind, *piece in _stream_deltas(submission):
            if kind == "text":
                index, delta, new_ids, finish_reason = piece
                choice = make_choice(index, delta, finish_reason)
                if body.return_token_ids:
                    choice["token_ids"] = new_ids
                yield chunk([choice])
            elif kind == "usage" and include_usage:
                yield chunk([], piece[0])
            elif kind == "error":
                yield sse_event(piece[0])
        yield "data: [DONE]\n\n"

    def stream_completion(submission: _Submission, body: CompletionRequest):
        return stream_choices(submission, body, "text_completion", lambda index, text, finish: {
            "index": index, "text": text, "logprobs": None, "finish_reason": finish})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        params = sampling_params_from(body, default_max_tokens=None)
        prompt_ids = chat_prompt_ids(tokenizer, body.messages)
        submission = _Submission(engine_loop, "chatcmpl")
        submission.add([prompt_ids], params)
        if body.stream:
            return _EventStream(stream_chat(submission, body), submission)
        finals = await wait_or_disconnect(request, submission)
        if finals is None:
            return JSONResponse(error_body("client disconnected", "aborted", None, 499), status_code=499)
        out = finals[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": out.outputs[0].text},
                  "logprobs": None, "finish_reason": openai_finish_reason(out.outputs[0])}
        if body.return_token_ids:
            choice["token_ids"] = list(out.outputs[0].token_ids)
        return {"id": submission.id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [choice],
                "usage": usage_field(len(out.prompt_token_ids), len(out.outputs[0].token_ids))}

    def stream_chat(submission: _Submission, body: ChatCompletionRequest):
        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return stream_choices(submission, body, "chat.completion.chunk", lambda index, text, finish: {
            "index": index, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish},
            opening)

    return app


async def _stream_deltas(submission: _Submission):
    """``("text", index, new text, new token ids, finish_reason)`` per output that adds text or finishes, then
    ``("usage", totals)``; or ``("error", body)`` if the engine failed the request mid-stream.

    Text is sent as the difference from what this client already has, so an engine that holds
    back a partial character (or a possible stop string) is streamed correctly. If the client
    disconnects, the generator is closed here and the requests still running are aborted.
    """
    sent, sent_ids = {}, {}
    prompt_tokens = completion_tokens = 0
    try:
        try:
            async for index, output in submission.outputs():
                completion = output.outputs[0]
                delta = completion.text[sent.get(index, 0):]
                sent[index] = len(completion.text)
                new_ids = list(completion.token_ids[sent_ids.get(index, 0):])
                sent_ids[index] = len(completion.token_ids)
                finish_reason = openai_finish_reason(completion) if output.finished else None
                if output.finished:
                    prompt_tokens += len(output.prompt_token_ids)
                    completion_tokens += len(completion.token_ids)
                if delta or finish_reason:
                    yield "text", index, delta, new_ids, finish_reason
                else:                    # text held back (a partial character): the ids wait for it
                    sent_ids[index] -= len(new_ids)
        except Exception as exc:    # the engine failed mid-stream: say so in the stream, then [DONE]
            status, kind = getattr(exc, "http_status", 500), getattr(exc, "error_type", "internal_error")
            yield "error", error_body(str(exc), kind, getattr(exc, "param", None), status)
            return
        yield "usage", usage_field(prompt_tokens, completion_tokens)
    finally:
        submission.abort()


# ----------------------------------------------------------------------------- running it


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerThread:
    """uvicorn in a background thread, for tests and notebooks: ``with ServerThread(engine) as s: s.url``.

    Binds 127.0.0.1 on a free port by default; leaving the block stops uvicorn and the engine thread.
    """

    def __init__(self, engine, host: str = "127.0.0.1", port: int | None = None, model_name: str | None = None,
                 log_level: str = "warning"):
        import uvicorn

        self.engine = engine
        self.host, self.port = host, port or free_port(host)
        self.app = build_app(engine, model_name=model_name)
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=log_level,
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="lifeofprompt-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_loop(self) -> EngineLoop:
        return self.app.state.engine_loop

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine_loop.stop()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None) -> None:
    """Run the server in the foreground until Ctrl-C."""
    import uvicorn

    uvicorn.run(build_app(engine, model_name=model_name), host=host, port=port, log_level="info")
