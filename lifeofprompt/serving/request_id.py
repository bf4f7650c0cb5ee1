"""``X-Request-Id``: every answer carries the id its request came with, so a client (or a proxy's log)
can match the two, as vLLM does.

When the request has no ``X-Request-Id``, the server makes one up (a random hex uuid4, as vLLM's
``--enable-request-id-headers`` does), so every answer has one to quote in a bug report. The id is
set on the response's first message, before the body: a streamed answer has it too, and so does
every error, the door's own 401 and 413 included (this middleware is the outermost).
"""

from __future__ import annotations

import uuid

HEADER = b"x-request-id"


class RequestIdMiddleware:
    """ASGI middleware: the request's ``X-Request-Id`` (or a new one) on its response's headers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(HEADER)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or [] if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)
