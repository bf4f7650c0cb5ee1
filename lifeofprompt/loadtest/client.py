"""A load tester for any OpenAI-compatible endpoint: random arrivals, streamed, timed per chunk.

It answers the serving questions of chapter 13 from the client's side of the wire, the side
a user sees:

* **when** requests are sent comes from ``lifeofprompt.loadtest.arrivals`` (Poisson at a rate, a closed
  loop of N clients, or all at once), seeded;
* **what** is sent: prompts of fixed or sampled length, as random token ids (exact lengths;
  OpenAI's ``prompt`` may be a list of ints) or random words, asking for fixed or sampled
  output lengths with ``ignore_eos`` so every request runs to its length;
* **how long** it took: each request streams; the clock reads the first chunk that carries text
  (time to first token) and every later one; ``lifeofprompt.latency`` turns those times into
  TTFT, TPOT, ITL, end-to-end latency, p50/p90/p99 and the achieved arrival rate.

It stops by itself: after ``num_requests``, and at ``max_duration`` seconds, when requests
still in flight are cancelled and counted as failed.

    python -m lifeofprompt loadtest --url http://127.0.0.1:8000/v1 --rate 2 --num-requests 40 --json out.json
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .. import latency as metrics
from ..errors import InvalidRequestError
from . import arrivals

SCHEMA = "lifeofprompt.loadtest/1"
WORDS = (
    "the a of and to in is was for on with as by at from it that this be are have one time day "
    "summer prompt token cache block model queue server request answer story light river city "
    "morning music garden window road paper house water friend table green quiet long small"
).split()


@dataclass
class LoadTestConfig:
    """Everything that defines one load test (it is stored, whole, beside the results)."""

    url: str = "http://127.0.0.1:8000/v1"  # the OpenAI base URL, ending in /v1
    model: str | None = None  # None: the first model that /v1/models lists
    endpoint: str = "completions"  # "completions" or "chat"
    arrival: str = "poisson"  # "poisson", "closed_loop" or "all_at_once"
    num_requests: int = 50
    rate: float | None = None  # requests per second (poisson)
    num_clients: int | None = None  # closed loop
    prompt_len: int | tuple[int, int] = 32  # tokens (ids) or words (text); (low, high) samples uniformly
    output_len: int | tuple[int, int] = 16  # max_tokens per request
    prompt_kind: str = "ids"  # "ids" (exact lengths) or "text" (random words)
    token_id_range: tuple[int, int] = (1000, 30000)  # random ids are drawn from [low, high)
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM's extension: every request runs to max_tokens
    seed: int = 0
    max_duration: float = 120.0  # seconds; nothing runs past it
    request_timeout: float = 120.0  # seconds per request
    api_key: str | None = None

    def __post_init__(self):
        if self.endpoint not in ("completions", "chat"):
            raise InvalidRequestError(
                f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}", param="endpoint"
            )
        if self.prompt_kind not in ("ids", "text"):
            raise InvalidRequestError(
                f"prompt_kind must be 'ids' or 'text', got {self.prompt_kind!r}", param="prompt_kind"
            )
        if self.endpoint == "chat" and self.prompt_kind == "ids":
            raise InvalidRequestError("the chat endpoint takes text: use prompt_kind='text'", param="prompt_kind")
        if not self.max_duration > 0 or not self.request_timeout > 0:
            raise InvalidRequestError("max_duration and request_timeout must be > 0 seconds", param="max_duration")
        self.pattern()  # validates the arrival fields

    def pattern(self) -> arrivals.ArrivalPattern:
        return arrivals.ArrivalPattern(
            self.arrival, self.num_requests, rate=self.rate, num_clients=self.num_clients, seed=self.seed
        )


@dataclass
class RequestRecord(metrics.RequestTiming):
    """One request as the client saw it (times on the client's monotonic clock, seconds)."""

    index: int = 0
    status: int | None = None  # HTTP status


@dataclass
class LoadTestResult:
    config: LoadTestConfig
    records: list[RequestRecord]
    start_time: float  # monotonic time the run began
    duration: float  # seconds from the start to the last request's end
    num_not_sent: int  # requests the time limit kept from being sent
    summary: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON document: config, summary, and every request with times relative to the start."""
        from ..env import env_info

        t0 = self.start_time

        def rel(t):
            return None if t is None else t - t0

        requests = [
            {
                "index": r.index,
                "status": r.status,
                "error": r.error,
                "arrival_time": rel(r.arrival_time),
                "first_token_time": rel(r.first_token_time),
                "finished_time": rel(r.finished_time),
                "token_times": [t - t0 for t in r.token_times],
                "num_prompt_tokens": r.num_prompt_tokens,
                "num_output_tokens": metrics.num_output_tokens(r),
                "ttft_s": metrics.ttft(r),
                "tpot_s": metrics.tpot(r),
                "e2e_s": metrics.e2e_latency(r),
            }
            for r in self.records
        ]
        config = asdict(self.config)
        config.pop("api_key", None)
        return _finite(
            {
                "schema": SCHEMA,
                "config": config,
                "client": env_info(),
                "pattern": self.config.pattern().describe(),
                "num_not_sent": self.num_not_sent,
                "summary": self.summary,
                "requests": requests,
            }
        )

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def format(self) -> str:
        head = f"{self.config.pattern().describe()} against {self.config.url}"
        if self.num_not_sent:
            head += f"\n{self.num_not_sent} requests not sent: the {self.config.max_duration:g} s time limit came first"
        errors = sorted({r.error for r in self.records if r.error})
        tail = "".join(f"\n  error: {e}" for e in errors[:5])
        table = metrics.format_summary(self.summary).splitlines()
        if math.isnan(self.summary["queue_s"]["p50"]):  # a client cannot see the server's queue time
            table = [line for line in table if not line.startswith("queue")]
        return head + "\n" + "\n".join(table) + tail


def _finite(value):
    """NaN and infinity become null, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ----------------------------------------------------------------------------- the workload


def make_prompts(config: LoadTestConfig) -> tuple[list, list[int]]:
    """Seeded prompts and output lengths, one per request (ids or words, as configured)."""
    n = config.num_requests
    prompt_lens = arrivals.sample_lengths(n, config.prompt_len, seed=config.seed + 1)
    output_lens = arrivals.sample_lengths(n, config.output_len, seed=config.seed + 2)
    rng = np.random.default_rng(config.seed + 3)
    low, high = config.token_id_range
    if config.prompt_kind == "ids":
        prompts = [[int(x) for x in rng.integers(low, high, length)] for length in prompt_lens]
    else:
        prompts = [" ".join(rng.choice(WORDS, length)) for length in prompt_lens]
    return prompts, output_lens


def request_body(config: LoadTestConfig, model: str, prompt, max_tokens: int) -> dict:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


# ----------------------------------------------------------------------------- one request


async def stream_one(client, url: str, body: dict, record: RequestRecord) -> None:
    """POST one streaming request and time its chunks into ``record`` (errors land in ``record.error``)."""
    async with client.stream("POST", url, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            try:
                message = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = text[:200]
            record.error = f"HTTP {response.status_code}: {message}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            now = time.monotonic()
            if chunk.get("error"):
                record.error = f"stream error: {chunk['error'].get('message')}"
                return
            for choice in chunk.get("choices") or []:
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    if record.first_token_time is None:
                        record.first_token_time = now
                    record.token_times.append(now)
            usage = chunk.get("usage")
            if usage:
                record.num_output_tokens = usage.get("completion_tokens")
                record.num_prompt_tokens = usage.get("prompt_tokens", record.num_prompt_tokens)
    if record.first_token_time is None:
        record.error = "the stream ended without any text"
        return
    record.finished_time = time.monotonic()


async def first_model(client, url: str) -> str:
    response = await client.get(url.rstrip("/") + "/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# ----------------------------------------------------------------------------- the run


async def run_async(config: LoadTestConfig) -> LoadTestResult:
    import httpx

    prompts, output_lens = make_prompts(config)
    path = "/chat/completions" if config.endpoint == "chat" else "/completions"
    url = config.url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout, connect=10.0)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = config.model or await first_model(client, config.url)
        start = time.monotonic()
        deadline = start + config.max_duration

        async def send(i: int) -> None:
            record = RequestRecord(
                arrival_time=time.monotonic(),
                index=i,
                num_prompt_tokens=len(prompts[i]) if config.prompt_kind == "ids" else 0,
            )
            records.append(record)
            body = request_body(config, model, prompts[i], output_lens[i])
            try:
                await asyncio.wait_for(
                    stream_one(client, url, body, record),
                    timeout=max(0.0, min(config.request_timeout, deadline - time.monotonic())),
                )
            except asyncio.TimeoutError:
                record.error = "cancelled: the time limit came first"
            except Exception as exc:  # a refused connection, a broken stream: that request failed
                record.error = f"{type(exc).__name__}: {exc}"
            if record.error:
                record.finished_time = None

        sent = await arrivals.drive(config.pattern(), send, max_duration=config.max_duration)
    records.sort(key=lambda r: r.index)
    ends = [r.finished_time for r in records if r.finished_time is not None]
    duration = (max(ends) - start) if ends else time.monotonic() - start
    summary = metrics.summarize(records, duration=duration)
    return LoadTestResult(config, records, start, duration, config.num_requests - sent, summary)


def run_loadtest(config: LoadTestConfig | None = None, **kwargs) -> LoadTestResult:
    """Run a load test and wait for it (works in a notebook, whose event loop is already running)."""
    config = config or LoadTestConfig(**kwargs)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_async(config))
    result: dict = {}

    def target():
        try:
            result["value"] = asyncio.run(run_async(config))
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="lifeofprompt-loadtest")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def parse_length(text: str) -> int | tuple[int, int]:
    """``"32"`` → 32; ``"16:64"`` → (16, 64), sampled uniformly per request."""
    try:
        if ":" in text:
            low, high = text.split(":")
            return int(low), int(high)
        return int(text)
    except ValueError:
        raise InvalidRequestError(f"a length is N or LOW:HIGH, got {text!r}") from None


def waiting_over_time(result: LoadTestResult, step: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """How many requests were sent but had no first token yet, sampled every ``step`` seconds.

    Seen from the client this is the queue (plus the prefill in progress): once arrivals outpace
    the server it keeps growing until they stop.
    """
    t0 = result.start_time
    spans = [
        (r.arrival_time - t0, (r.first_token_time or r.arrival_time) - t0) for r in result.records if r.first_token_time
    ]
    end = max((b for _, b in spans), default=0.0)
    times = np.arange(0.0, end + step, step)
    counts = np.array([sum(a <= t < b for a, b in spans) for t in times])
    return times, counts
