"""One HTTP request's engine requests: adding them, awaiting their outputs, streaming their deltas.

A ``Submission`` holds the engine requests of one HTTP request (one per prompt) and the asyncio
queue the engine thread delivers their outputs to. A client that goes away aborts them, so their
KV blocks return at once: mid-stream (the generator's ``finally``), before the first chunk
(``EventStream``), or while it waits for a whole completion (``wait_or_disconnect`` polls the
connection twice a second).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.sampling_params import SamplingParams
from .engine_loop import EngineLoop
from .http_errors import stream_error_body
from .openai_protocol import openai_finish_reason, usage_field

CLIENT_GONE = object()  # put in a request's queue when its client disconnects
DISCONNECT_POLL_S = 0.5


class EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends.

    The generator's own ``finally`` covers a client that leaves mid-stream; this covers one that
    leaves before the first chunk, when the generator has not started and has no ``finally`` to run.
    """

    def __init__(self, content, submission: Submission):
        super().__init__(content, media_type="text/event-stream")
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.abort()


class Submission:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs land in."""

    def __init__(self, loop_: EngineLoop, kind: str):
        self.engine_loop = loop_
        self.queue: asyncio.Queue = asyncio.Queue()
        self.id = f"{kind}-{uuid.uuid4().hex[:24]}"
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self.prompt_lengths: list[int] = []  # tokens in each prompt, for usage on every chunk

    @staticmethod
    def prompt_length(prompt) -> int:
        """Tokens in a prompt as the routes give it: token ids, or ``{"prompt_token_ids": [...]}``."""
        return len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else len(prompt)

    def add(self, prompts: list, params: SamplingParams) -> None:
        """Add every prompt, or none: a prompt the engine refuses aborts the ones already added."""
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        try:
            for index, prompt in enumerate(prompts):
                request_id = f"{self.id}-{index}"
                self.engine_loop.add(request_id, prompt, params, self.queue, loop, arrival_time=arrival)
                self.request_ids.append(request_id)
                self.prompt_lengths.append(self.prompt_length(prompt))
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


async def wait_or_disconnect(request: Request, submission: Submission) -> dict[int, Any] | None:
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


async def stream_deltas(submission: Submission, n: int = 1):
    """``("text", choice, new text, new token ids, their logprob entries, finish_reason)`` per answer
    that adds text or finishes, then ``("usage", totals)``; or ``("error", body)`` if the engine
    failed the request mid-stream. ``choice`` is ``prompt index × n + answer index``, OpenAI's order.
    Before a prompt's first text, ``("prompt", prompt index, its first output)``: what ``echo`` sends.

    Text is sent as the difference from what this client already has, so an engine that holds
    back a partial character (or a possible stop string) is streamed correctly. If the client
    disconnects, the generator is closed here and the requests still running are aborted.
    """
    sent, sent_ids, done, prompts_seen = {}, {}, set(), set()
    prompt_tokens = completion_tokens = 0
    try:
        try:
            async for index, output in submission.outputs():
                if index not in prompts_seen:
                    prompts_seen.add(index)
                    yield "prompt", index, output
                if output.finished:
                    prompt_tokens += len(output.prompt_token_ids)
                for completion in output.outputs:
                    choice = index * n + completion.index
                    if choice in done:
                        continue
                    delta = completion.text[sent.get(choice, 0) :]
                    sent[choice] = len(completion.text)
                    start = sent_ids.get(choice, 0)
                    new_ids = list(completion.token_ids[start:])
                    entries = (
                        list(completion.logprobs[start : len(completion.token_ids)])
                        if completion.logprobs is not None
                        else None
                    )
                    finish_reason = openai_finish_reason(completion)
                    if finish_reason is not None:
                        done.add(choice)
                        completion_tokens += len(completion.token_ids)
                    if delta or finish_reason:
                        sent_ids[choice] = len(completion.token_ids)
                        yield "text", choice, delta, new_ids, entries, finish_reason
                    # else: text held back (a partial character): the ids wait for it
        except Exception as exc:  # the engine failed this request mid-stream: say so in the stream, then [DONE]
            yield "error", stream_error_body(exc)
            return
        yield "usage", usage_field(prompt_tokens, completion_tokens)
    finally:
        submission.abort()
