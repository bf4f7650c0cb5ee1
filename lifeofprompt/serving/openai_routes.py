"""The OpenAI endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, and ``/health``, ``/metrics``.

``Endpoints`` holds what every route needs (the engine and its thread, the served name, the door's
limits, the prompt tokenizer) and the steps the two generating routes share: a request's prompts
measured and tokenized off the event loop, then its answers whole, or as server-sent events in
OpenAI's chunk envelope. ``server.build_app`` puts them on the app (``add_to``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..engine.llm import render_chat
from ..errors import InvalidRequestError, ModelNotFoundError
from .choices import Choices
from .http_errors import error_body, error_responses
from .limits import check_prompt_chars, longest_token_chars
from .openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    check_text,
    completion_prompt_logprobs,
    completion_prompts,
    num_logprobs,
    plain_messages,
    sampling_params_from,
    sse_event,
    usage_field,
)
from .server_metrics import render_metrics
from .submission import EventStream, Submission, stream_deltas, wait_or_disconnect
from .tools import parse_tools, tool_conversation, tool_mode, tool_structure, tools_error

POST_ERRORS = error_responses(400, 401, 404, 413, 500, 503)


class Endpoints:
    def __init__(self, engine, engine_loop, model_name: str, limits, prompt_tokenizer):
        self.engine, self.engine_loop, self.model_name = engine, engine_loop, model_name
        self.limits, self.prompt_tokenizer = limits, prompt_tokenizer
        self.chars_per_token = longest_token_chars(engine.tokenizer)
        self.created = int(time.time())

    def add_to(self, app) -> None:
        app.get("/health", response_model=Health, responses={503: {"model": Health}})(self.health)
        app.get("/metrics", response_class=PlainTextResponse)(self.metrics)
        app.get("/v1/models", response_model=ModelList, responses=error_responses(401))(self.models)
        card = app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404))
        card(self.model)
        app.post("/v1/completions", response_model=CompletionResponse, responses=POST_ERRORS)(self.completions)
        chat = app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=POST_ERRORS)
        chat(self.chat_completions)

    # ---------------------------------------------------------------- the routes
    async def health(self):
        loop = self.engine_loop
        if not loop.alive or loop.draining:
            return JSONResponse({"status": "shutting down" if loop.draining else "engine thread stopped"}, 503)
        return {"status": "ok"}

    async def metrics(self):
        text = render_metrics(self.engine, self.engine_loop.stats, self.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def card(self) -> dict:
        return dict(
            id=self.model_name,
            object="model",
            created=self.created,
            owned_by="lifeofprompt",
            max_model_len=self.engine.max_model_len,
        )

    async def models(self):
        return {"object": "list", "data": [self.card()]}

    async def model(self, model_id: str):
        """One model's card (``client.models.retrieve``); a name this server does not run is a 404."""
        self.check_model(model_id)
        return self.card()

    async def completions(self, body: CompletionRequest, request: Request):
        """``echo`` puts the prompt before each answer (every one of the ``n``; streamed: in each choice's first
        chunk), with logprobs its tokens' first (``choices.py``); ``max_tokens: 0`` + ``echo`` + ``logprobs``
        is lm-evaluation-harness's log-likelihood request: the prompt scored, nothing generated. vLLM's
        ``prompt_logprobs: N`` returns each prompt token's top N as the choice's ``prompt_logprobs``."""
        self.check_model(body.model)
        params = sampling_params_from(body, default_max_tokens=16)
        params = replace(params, prompt_logprobs=completion_prompt_logprobs(body))
        check_text(body.prompt, "prompt")
        check_text(body.stop, "stop")
        submission = Submission(self.engine_loop, "cmpl")
        submission.add(await self.completion_inputs(completion_prompts(body.prompt)), params)
        choices = Choices(
            self.prompt_tokenizer,
            chat=False,
            n=body.n,
            num_logprobs=num_logprobs(body),
            return_token_ids=body.return_token_ids,
            echo=bool(body.echo),
            prompt_logprobs=body.prompt_logprobs,
        )
        if body.stream:
            return EventStream(self.stream_choices(submission, body, "text_completion", choices), submission)
        return await self.whole_response(request, submission, "text_completion", choices)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        tools = parse_tools(body.tools)
        mode = tool_mode(tools, body.tool_choice)
        parallel = body.parallel_tool_calls is not False
        structure = tool_structure(tools, mode, parallel) if mode is not None else None
        params = sampling_params_from(body, default_max_tokens=None, tool_structure=structure)
        check_text([m.model_dump() for m in body.messages], "messages")
        check_text(body.stop, "stop")
        submission = Submission(self.engine_loop, "chatcmpl")
        shown = [t.model_dump(exclude_none=True) for t in tools] if mode is not None else None
        try:
            submission.add([await self.chat_input(body.messages, shown)], params)
        except InvalidRequestError as exc:
            raise (tools_error(exc) if structure is not None else exc) from None
        choices = Choices(
            self.prompt_tokenizer,
            chat=True,
            n=body.n,
            num_logprobs=num_logprobs(body),
            tool_mode=mode,
            return_token_ids=body.return_token_ids,
        )
        if body.stream:
            return EventStream(self.stream_choices(submission, body, "chat.completion.chunk", choices), submission)
        return await self.whole_response(request, submission, "chat.completion", choices)

    # ---------------------------------------------------------------- their shared steps
    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ModelNotFoundError(f"the model {requested!r} does not exist; this server runs {self.model_name!r}")

    async def completion_inputs(self, prompts: list) -> list:
        """Text prompts measured, then tokenized off the event loop; token-id prompts as they are."""
        most = self.limits.max_prompts_per_request
        if len(prompts) > most:
            raise InvalidRequestError(f"at most {most} prompts per request, got {len(prompts)}", param="prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            check_prompt_chars(len(text), self.engine.max_model_len, self.chars_per_token)
        if not texts:
            return prompts

        def encode(tok, items):
            return [list(tok.encode(t, add_special_tokens=False)) for t in items]

        encoded = iter(await self.prompt_tokenizer.run(encode, texts))
        return [{"prompt": p, "prompt_token_ids": next(encoded)} if isinstance(p, str) else p for p in prompts]

    async def chat_input(self, messages, tools: list[dict] | None = None) -> list[int]:
        """The conversation rendered and tokenized; tools and tool turns as ``tools.tool_conversation`` says."""
        chat, tools = tool_conversation(self.engine.tokenizer, plain_messages(messages), tools)
        chars = sum(len(m["content"]) for m in chat)  # a lower bound of the rendered prompt's characters
        check_prompt_chars(chars, self.engine.max_model_len, self.chars_per_token, "messages")
        return await self.prompt_tokenizer.run(lambda tok, chat: render_chat(tok, chat, tools=tools)[1], chat)

    def envelope(self, submission: Submission, object_name: str, choices: list) -> dict:
        return dict(
            id=submission.id, object=object_name, created=int(time.time()), model=self.model_name, choices=choices
        )

    async def whole_response(self, request: Request, submission: Submission, object_name: str, choices: Choices):
        """Every answer of every prompt, once all are done; usage counts each prompt once and every answer."""
        finals = await wait_or_disconnect(request, submission)
        if finals is None:
            return JSONResponse(error_body("client disconnected", "aborted", None, 499), status_code=499)
        usage = usage_field(
            sum(len(o.prompt_token_ids) for o in finals.values()),
            sum(len(c.token_ids) for o in finals.values() for c in o.outputs),
        )
        return dict(self.envelope(submission, object_name, await choices.whole(finals)), usage=usage)

    async def stream_choices(self, submission: Submission, body, object_name: str, choices: Choices):
        """Server-sent events for one streamed request: OpenAI's chunk envelope around each delta
        (``Choices.delta`` shapes them); chat opens each choice with its role.

        ``stream_options.include_usage`` adds a last chunk with the totals (every other chunk says
        ``"usage": null``); with it, vLLM's ``continuous_usage_stats`` (guidellm, aiperf send both) also puts
        usage on every chunk (alone it does nothing, as in vLLM). As vLLM counts it, a chunk's usage is its own
        choice's: that choice's prompt, and the tokens that choice has generated so far (with
        ``n > 1`` or several prompts, each choice counts alone; the last chunk has the totals).
        """
        options = body.stream_options or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        generated: dict[int, int] = {}  # choice -> tokens so far

        def chunk(items, usage=None):
            payload = self.envelope(submission, object_name, items)
            return sse_event(dict(payload, usage=usage) if include_usage else payload)

        def usage_so_far(index: int) -> dict | None:
            if not continuous:
                return None
            return usage_field(submission.prompt_lengths[index // choices.n], generated.get(index, 0))

        if choices.chat:
            for opening in choices.openings(len(submission.request_ids)):
                yield chunk([opening], usage_so_far(opening["index"]))
        async for kind, *piece in stream_deltas(submission, choices.n):
            if kind == "text":
                generated[piece[0]] = generated.get(piece[0], 0) + len(piece[2])
                for choice in await choices.deltas(*piece):
                    yield chunk([choice], usage_so_far(piece[0]))
            elif kind == "prompt":
                await choices.echo_in_stream(*piece)
            elif kind == "usage" and include_usage:
                yield chunk([], piece[0])
            elif kind == "error":
                yield sse_event(piece[0])
        yield "data: [DONE]\n\n"
