"""Latency and throughput from per-request timestamps: the one metrics module, at the package's base
because three layers read it (the server's ``/metrics``, the load tester, the chapters' simulator).

Every number a serving study reads comes from five timestamps per request, all on one
monotonic clock (seconds): when it arrived, when it was first scheduled, when its first
token came out, the time of every output token, and when it finished. The engine fills them
in ``RequestMetrics``; the load tester fills them from the client's side of the wire; the
simulator fills them from its predicted clock. This module only reads them, so the three
agree on what "time to first token" means.

* TTFT  (time to first token)  = first_token_time - arrival_time: queueing + prefill.
* TPOT  (time per output token) = (finished_time - first_token_time) / (output tokens - 1):
  the mean decode pace a user sees after the first token (vLLM's definition).
* ITL   (inter-token latency)  = the gaps between consecutive output tokens, pooled.
* E2E   (end-to-end latency)   = finished_time - arrival_time.
* queue time                   = first_scheduled_time - arrival_time.

Percentiles use linear interpolation (numpy's default): with 60 requests, p99 is close to the
second slowest, which is why it moves so much from run to run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    """A plain record of one request's times (seconds, one monotonic clock) and token counts.

    Anything with these attribute names works in this module (``RequestMetrics`` of the
    engine does); this class is for the load tester and the simulator.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int | None = None  # None: len(token_times)
    error: str | None = None  # set when the request failed (it counts as failed, not as latency)


def _get(record: Any, name: str, default=None):
    if isinstance(record, dict):
        return record.get(name, default)
    return getattr(record, name, default)


def num_output_tokens(record) -> int:
    n = _get(record, "num_output_tokens")
    return int(n) if n is not None else len(_get(record, "token_times") or [])


def succeeded(record) -> bool:
    return _get(record, "error") is None and _get(record, "finished_time") is not None


# ----------------------------------------------------------------------------- per request


def ttft(record) -> float | None:
    first = _get(record, "first_token_time")
    return None if first is None else first - _get(record, "arrival_time")


def queue_time(record) -> float | None:
    scheduled = _get(record, "first_scheduled_time")
    return None if scheduled is None else scheduled - _get(record, "arrival_time")


def e2e_latency(record) -> float | None:
    finished = _get(record, "finished_time")
    return None if finished is None else finished - _get(record, "arrival_time")


def tpot(record) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    n = num_output_tokens(record)
    first, finished = _get(record, "first_token_time"), _get(record, "finished_time")
    if n < 2 or first is None or finished is None:
        return None
    return (finished - first) / (n - 1)


def inter_token_latencies(record) -> list[float]:
    times = list(_get(record, "token_times") or [])
    return [b - a for a, b in zip(times, times[1:])]


# ----------------------------------------------------------------------------- summaries


def percentiles(values: Iterable[float], ps: Iterable[float] = PERCENTILES) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99", ...}`` of the values (NaN when there are none)."""
    values = np.asarray([v for v in values if v is not None], dtype=float)
    out = {"mean": float(values.mean()) if values.size else float("nan")}
    for p in ps:
        out[f"p{p:g}"] = float(np.percentile(values, p)) if values.size else float("nan")
    return out


def achieved_arrival_rate(records) -> float:
    """Requests per second actually offered: (n - 1) / (last arrival - first arrival)."""
    arrivals = sorted(_get(r, "arrival_time") for r in records)
    if len(arrivals) < 2 or arrivals[-1] == arrivals[0]:
        return float("inf") if len(arrivals) >= 2 else float("nan")
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def summarize(records, duration: float | None = None, ps: Iterable[float] = PERCENTILES) -> dict:
    """Everything a load test reports, from a list of request records.

    ``duration`` is the wall time of the run; by default from the first arrival to the last
    finish. Latencies are over the requests that succeeded; throughput counts their tokens.
    """
    records = list(records)
    ok = [r for r in records if succeeded(r)]
    if duration is None:
        starts = [_get(r, "arrival_time") for r in records]
        ends = [_get(r, "finished_time") for r in ok]
        duration = (max(ends) - min(starts)) if ends else 0.0
    output_tokens = sum(num_output_tokens(r) for r in ok)
    prompt_tokens = sum(int(_get(r, "num_prompt_tokens") or 0) for r in ok)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: float("nan"))
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(output_tokens + prompt_tokens),
        "achieved_arrival_rate": achieved_arrival_rate(records),
        "ttft_s": percentiles((ttft(r) for r in ok), ps),
        "tpot_s": percentiles((tpot(r) for r in ok), ps),
        "itl_s": percentiles((gap for r in ok for gap in inter_token_latencies(r)), ps),
        "e2e_s": percentiles((e2e_latency(r) for r in ok), ps),
        "queue_s": percentiles((queue_time(r) for r in ok), ps),
    }


def format_summary(summary: dict) -> str:
    """A small fixed-width table of a ``summarize`` result, latencies in milliseconds."""
    lines = [
        f"requests      {summary['completed']} completed, {summary['failed']} failed, in {summary['duration_s']:.2f} s",
        f"throughput    {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s",
        f"arrival rate  {summary['achieved_arrival_rate']:.2f} req/s achieved",
        f"{'(ms)':14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"), ("queue", "queue_s")):
        row = summary[key]
        lines.append(
            f"{name:14}" + "".join(f"{row.get(k, float('nan')) * 1e3:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        )
    return "\n".join(lines)
