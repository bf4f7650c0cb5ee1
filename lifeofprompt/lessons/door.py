"""The server's door, knocked on (chapter 12, the server): raw HTTP answers, status, headers and OpenAI-shaped errors.

The ``openai`` client turns errors into exceptions and retries 503s by itself; to *show* what
the server answers, these helpers send plain HTTP and keep everything: the status, the headers
that matter (``Retry-After``) and the JSON body. ``burst`` sends many requests at the same moment,
as a crowd of clients would, to fill the engine's seats and its waiting queue.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class Answer:
    status: int
    body: dict
    retry_after: str | None = None

    @property
    def error(self) -> dict:
        """The ``{"message", "type", "param", "code"}`` of an error answer (empty for a success)."""
        return self.body.get("error", {}) if isinstance(self.body, dict) else {}


def post(
    url: str,
    path: str,
    body: dict | None = None,
    api_key: str | None = None,
    content: bytes | None = None,
    timeout: float = 120.0,
) -> Answer:
    """POST ``body`` as JSON (or raw ``content``) to ``url + path``, with the key as a Bearer token when given."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
        reply = httpx.post(url + path, content=content, headers=headers, timeout=timeout)
    else:
        reply = httpx.post(url + path, json=body, headers=headers, timeout=timeout)
    try:
        parsed = reply.json()
    except ValueError:
        parsed = {"text": reply.text}
    return Answer(reply.status_code, parsed, reply.headers.get("retry-after"))


def get(url: str, path: str, api_key: str | None = None) -> Answer:
    import httpx

    reply = httpx.get(url + path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=30.0)
    try:
        parsed = reply.json()
    except ValueError:
        parsed = {"text": reply.text}
    return Answer(reply.status_code, parsed, reply.headers.get("retry-after"))


def burst(url: str, path: str, body: dict, count: int, api_key: str | None = None) -> list[Answer]:
    """``count`` copies of one request, all sent at once; the answers in the order they were sent."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(post, url, path, body, api_key) for _ in range(count)]
        return [f.result() for f in futures]
