"""``POST /v1/responses``, stateless: OpenAI's Responses API answered by the chat route.

A body becomes a chat request (``responses_protocol.chat_request_from``) and goes through
``Endpoints.chat_completions`` itself: the same prompt rendering, the same grammar for
``text.format`` and ``tools``, the same tool-call parsing, the same engine submission. Its answer
comes back as a ``response`` object, or, with ``stream: true``, as the Responses API's typed
events, translated from the chat stream's chunks as they arrive (``ResponseEvents``):

    response.created → response.in_progress →
      per output item: response.output_item.added →
        a message: response.content_part.added → response.output_text.delta … →
                   response.output_text.done → response.content_part.done
        a function call: response.function_call_arguments.delta … → response.function_call_arguments.done
      → response.output_item.done
    → response.completed (or response.incomplete when max_output_tokens cut it)

Each event is ``event: <type>`` and ``data: {"type": ..., "sequence_number": n, ...}``, numbered
from 0. A tool call streams as the chat stream sends it (its name first, then its arguments piece by
piece as they are generated): the translation only follows chat's ``tool_calls`` deltas by index.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..errors import InvalidRequestError
from .http_errors import error_responses
from .responses_protocol import (
    ResponsesRequest,
    call_status,
    chat_request_from,
    function_call_item,
    message_item,
    new_id,
    response_from_chat,
    response_object,
    responses_param,
    status_of,
)
from .submission import EventStream


class ResponseEvents:
    """One streamed response: chat chunks in, the Responses API's typed events out."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str):
        self.body, self.response_id, self.model = body, response_id, model
        self.sequence_number = 0
        self.output: list[dict] = []  # items done
        self.item: dict | None = None  # the item being streamed
        self.call_index: int | None = None  # chat's index of the tool call being streamed
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def response(self, **state) -> dict:
        return response_object(self.body, self.response_id, self.model, **state)

    # ------------------------------------------------------------------ items
    def open_item(self, item: dict) -> list[str]:
        events = self.close_item()
        self.item = item
        where = dict(item_id=item["id"], output_index=len(self.output))
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=dict(item)))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", **where, content_index=0, part=part))
        return events

    def close_item(self) -> list[str]:
        item, events = self.item, []
        if item is None:
            return events
        where = dict(item_id=item["id"], output_index=len(self.output))
        if item["type"] == "message":
            status, _ = status_of(self.finish_reason)
            item["status"] = "incomplete" if status == "incomplete" else "completed"
            part = item["content"][0]
            text = dict(content_index=0, text=part["text"], logprobs=[])
            events.append(self.event("response.output_text.done", **where, **text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            item["status"] = call_status(item["arguments"])
            arguments = dict(arguments=item["arguments"], name=item["name"])
            events.append(self.event("response.function_call_arguments.done", **where, **arguments))
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.item, self.call_index = None, None
        return events

    def text(self, delta: str) -> list[str]:
        events = (
            []
            if self.item is not None and self.item["type"] == "message"
            else self.open_item(message_item("", "in_progress"))
        )
        self.item["content"][0]["text"] += delta
        where = dict(item_id=self.item["id"], output_index=len(self.output), content_index=0)
        return [*events, self.event("response.output_text.delta", **where, delta=delta, logprobs=[])]

    def tool_call(self, delta: dict) -> list[str]:
        """A chat ``tool_calls`` delta: a new index opens a function_call item; arguments stream into it."""
        events = []
        function = delta.get("function") or {}
        if delta.get("index", 0) != self.call_index or self.item is None:
            call_id = delta.get("id") or new_id("call")
            events += self.open_item(function_call_item(call_id, function.get("name") or "", "", "in_progress"))
            self.call_index = delta.get("index", 0)
        if function.get("name") and not self.item["name"]:
            self.item["name"] = function["name"]
        if function.get("arguments"):
            self.item["arguments"] += function["arguments"]
            where = dict(item_id=self.item["id"], output_index=len(self.output))
            events.append(self.event("response.function_call_arguments.delta", **where, delta=function["arguments"]))
        return events

    # ------------------------------------------------------------------ the stream
    def chunk(self, chunk: dict) -> list[str]:
        """The events one chat chunk makes (usage and the finish reason are kept for the end)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self.text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.tool_call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def failed(self, error: dict) -> list[str]:
        detail = error.get("error") or {}
        events = [self.event("error", code=detail.get("code"), message=detail.get("message", ""), param=None)]
        failure = {"code": str(detail.get("type") or "server_error"), "message": detail.get("message", "")}
        response = dict(self.response(status="failed", output=self.output), error=failure)
        return [*events, self.event("response.failed", response=response)]

    async def translate(self, chat_stream):
        """The events of the whole response, from the chat route's server-sent events."""
        yield self.event("response.created", response=self.response())
        yield self.event("response.in_progress", response=self.response())
        try:
            async for line in chat_stream:
                data = line[len("data: ") :].strip() if line.startswith("data: ") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for event in self.failed(chunk) if "error" in chunk else self.chunk(chunk):
                    yield event
                if "error" in chunk:
                    return
            events = self.open_item(message_item("", "in_progress")) if not self.output and self.item is None else []
            for event in events + self.close_item():
                yield event
            status, incomplete = status_of(self.finish_reason)
            final = self.response(status=status, incomplete_details=incomplete, output=self.output, usage=self.usage)
            yield self.event("response.incomplete" if status == "incomplete" else "response.completed", response=final)
        finally:
            await chat_stream.aclose()


def add_responses_route(app, endpoints) -> None:
    """``POST /v1/responses`` on the app, answered through ``endpoints.chat_completions``."""

    @app.post("/v1/responses", responses=error_responses(400, 401, 404, 413, 500, 503))
    async def create_response(body: ResponsesRequest, request: Request):
        response_id = new_id("resp")
        try:
            chat = chat_request_from(body)
            answer = await endpoints.chat_completions(chat, request)
        except ValidationError as exc:
            raise InvalidRequestError(f"input: {exc.errors()[0]['msg']}", param="input") from None
        except InvalidRequestError as exc:
            exc.param = responses_param(exc.param)  # chat's name for the field → the one the client sent
            raise
        if isinstance(answer, JSONResponse):  # the client went away
            return answer
        if body.stream:
            events = ResponseEvents(body, response_id, endpoints.model_name)
            return EventStream(events.translate(answer.body_iterator), answer.submission)
        return response_from_chat(body, answer, response_id)
