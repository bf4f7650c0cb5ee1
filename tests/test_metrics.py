"""The metrics module on hand-made records: every definition pinned to a number worked out by hand."""

import math

import pytest

from lifeofprompt.latency import (
    RequestTiming,
    achieved_arrival_rate,
    e2e_latency,
    format_summary,
    inter_token_latencies,
    percentiles,
    queue_time,
    summarize,
    tpot,
    ttft,
)


def record(arrival, scheduled, tokens, prompt=4, error=None):
    return RequestTiming(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=tokens[0] if tokens else None,
        finished_time=tokens[-1] if tokens else None,
        token_times=list(tokens),
        num_prompt_tokens=prompt,
        error=error,
    )


def test_per_request_definitions():
    r = record(1.0, 1.5, [2.0, 2.5, 3.5])
    assert ttft(r) == 1.0
    assert queue_time(r) == 0.5
    assert e2e_latency(r) == 2.5
    assert tpot(r) == 0.75  # (3.5 - 2.0) / (3 - 1)
    assert inter_token_latencies(r) == [0.5, 1.0]


def test_tpot_needs_two_tokens_and_dicts_work():
    assert tpot(record(0.0, 0.0, [1.0])) is None
    as_dict = {"arrival_time": 0.0, "first_token_time": 0.2, "finished_time": 1.2, "token_times": [0.2, 0.7, 1.2]}
    assert ttft(as_dict) == 0.2 and tpot(as_dict) == 0.5


def test_percentiles_interpolate_linearly():
    p = percentiles(range(1, 101))
    assert p["mean"] == 50.5 and p["p50"] == 50.5
    assert p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert math.isnan(percentiles([])["p99"])


def test_achieved_arrival_rate():
    rs = [record(t, t, [t + 1]) for t in (0.0, 0.5, 2.0)]
    assert achieved_arrival_rate(rs) == 1.0  # 2 gaps over 2 s
    assert achieved_arrival_rate(rs[:1]) != achieved_arrival_rate(rs[:1])  # NaN for one request


def test_summary_counts_failures_apart_and_formats():
    rs = [
        record(0.0, 0.0, [1.0, 2.0]),
        record(1.0, 1.0, [2.0, 3.0, 4.0], prompt=6),
        record(2.0, None, [], error="timeout"),
    ]
    s = summarize(rs)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["duration_s"] == 4.0  # first arrival to last finish
    assert (s["output_tokens"], s["prompt_tokens"]) == (5, 10)
    assert s["output_throughput"] == 1.25 and s["request_throughput"] == 0.5
    assert s["ttft_s"]["p50"] == 1.0 and s["tpot_s"]["mean"] == 1.0
    assert s["achieved_arrival_rate"] == 1.0
    text = format_summary(s)
    assert "2 completed, 1 failed" in text and "TTFT" in text and "1000.0" in text
