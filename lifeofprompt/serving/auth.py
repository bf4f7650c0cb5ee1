"""The door: an API key, a word when the server is reachable from elsewhere, and nothing else open.

As vLLM does: with ``--api-key`` (or ``LIFEOFPROMPT_API_KEY``) every request to ``/v1/*``,
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` needs ``Authorization: Bearer <key>``, compared in constant
time (``hmac.compare_digest``), else 401 in OpenAI's shape. ``/health`` and ``/metrics`` stay
open, for load balancers and Prometheus. Without a key, binding beyond loopback logs a warning:
anyone who can reach the port can use the model. The interactive docs (``/docs``, ``/redoc``,
``/openapi.json``) are off unless ``--enable-docs``; CORS is off unless ``--allowed-origins``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os

from .http_errors import error_json

API_KEY_ENV = "LIFEOFPROMPT_API_KEY"
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")

logger = logging.getLogger("lifeofprompt.server")


def api_key_from(value: str | None) -> str | None:
    """The key given on the command line, else the environment's; None (or empty) means no key."""
    key = value if value is not None else os.environ.get(API_KEY_ENV)
    return key or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server reachable beyond this machine without a key (else None)."""
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"binding {host!r} without an API key: anyone who can reach this port can use the model; "
        f"pass --api-key (or set {API_KEY_ENV}), or bind 127.0.0.1"
    )


class ApiKeyMiddleware:
    """ASGI middleware: a Bearer token on the protected paths, before anything else is done."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and scope["path"].startswith(PROTECTED_PREFIXES)
        ):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_json(
                    401, "a valid API key is required: send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
