"""What the server's ``/metrics`` page says, in the Prometheus text format (version 0.0.4).

Two kinds of numbers. The engine's live state, read when the page is asked for: requests running
and waiting, KV blocks in use out of the pool, prefix-cache hits, preemptions. And what finished
requests measured, kept as histograms (time to first token, time per output token, end-to-end
latency) and counters (tokens, finished requests by reason), filled in by the engine thread.
No client library needed: the format is a few lines of text per metric.
"""

from __future__ import annotations

import threading

from .. import latency as request_metrics

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count."""

    def __init__(self, name: str, help: str, buckets):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = next((i for i, upper in enumerate(self.buckets) if value <= upper), len(self.buckets))
        self.counts[index] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for upper, n in zip(list(self.buckets) + [float("inf")], self.counts):
            cumulative += n
            le = "+Inf" if upper == float("inf") else repr(float(upper))
            lines.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return lines


class ServerStats:
    """What ``/metrics`` reports beyond the engine's live state: latencies and counts of finished requests.

    Filled by the engine thread when a request finishes, read by the event loop: one lock.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram(
            "lifeofprompt_time_to_first_token_seconds",
            "Time from arrival to the first output token (queueing + prefill).",
            TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "lifeofprompt_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "lifeofprompt_e2e_request_latency_seconds", "Time from arrival to the last output token.", E2E_BUCKETS
        )
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def observe_finished(self, output) -> None:
        completion = output.outputs[0]
        reason = completion.finish_reason or "unknown"
        times = output.metrics
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += len(output.prompt_token_ids or [])
            self.generation_tokens += len(completion.token_ids)
            if times is None or reason == "abort":
                return
            record = request_metrics.RequestTiming(
                arrival_time=times.arrival_time,
                first_token_time=times.first_token_time,
                finished_time=times.finished_time,
                num_output_tokens=len(completion.token_ids),
            )
            for histogram, value in (
                (self.ttft, request_metrics.ttft(record)),
                (self.tpot, request_metrics.tpot(record)),
                (self.e2e, request_metrics.e2e_latency(record)),
            ):
                if value is not None:
                    histogram.observe(value)


def _gauge(name: str, help: str, value, kind: str = "gauge") -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value!r}"]


def engine_state(engine) -> dict:
    """The live numbers ``/metrics`` reports, from the engine's parts (read without stopping it)."""
    blocks = engine.block_manager
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "kv_blocks_total": blocks.num_blocks,
        "kv_blocks_used": blocks.num_used_blocks,
        "prefix_cache_queries": blocks.hits + blocks.misses,  # full prompt blocks looked up at admission
        "prefix_cache_hits": blocks.hits,
        "preemptions": engine.scheduler.num_preemptions,
    }


def spec_decode_lines(engine) -> list[str]:
    """vLLM's ``spec_decode`` counters, when the engine speculates (nothing otherwise)."""
    spec = engine.spec_stats
    if spec is None:
        return []
    lines = _gauge(
        "lifeofprompt_spec_decode_num_drafts_total",
        "Verify steps that checked at least one draft token.",
        spec.num_drafts,
        "counter",
    )
    lines += _gauge(
        "lifeofprompt_spec_decode_num_draft_tokens_total",
        "Draft tokens proposed and verified.",
        spec.num_draft_tokens,
        "counter",
    )
    lines += _gauge(
        "lifeofprompt_spec_decode_num_accepted_tokens_total",
        "Draft tokens the model accepted.",
        spec.num_accepted_tokens,
        "counter",
    )
    name = "lifeofprompt_spec_decode_num_accepted_tokens_per_pos_total"
    lines += [
        f"# HELP {name} Accepted draft tokens by their position in the draft (0 = first).",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(spec.num_accepted_tokens_per_pos)]
    lines += _gauge(
        "lifeofprompt_spec_decode_draft_seconds_total", "Time spent proposing draft tokens.", spec.draft_time, "counter"
    )
    lines += _gauge(
        "lifeofprompt_spec_decode_verify_seconds_total",
        "Time of the engine steps that held a verify.",
        spec.verify_time,
        "counter",
    )
    return lines


def engine_series(engine) -> list[tuple]:
    """``(name, help, value, kind)`` of every series read off the engine."""
    state = engine_state(engine)
    total, used = state["kv_blocks_total"], state["kv_blocks_used"]
    queries, hits = state["prefix_cache_queries"], state["prefix_cache_hits"]
    return [
        ("num_requests_running", "Requests in the running batch.", state["running"], "gauge"),
        (
            "num_requests_waiting",
            "Requests in the waiting queue (arrived, not yet running, or preempted).",
            state["waiting"],
            "gauge",
        ),
        ("kv_cache_blocks_total", "KV cache blocks in the pool.", total, "gauge"),
        ("kv_cache_blocks_used", "KV cache blocks held by requests.", used, "gauge"),
        ("kv_cache_usage_ratio", "Fraction of the KV pool in use (0 to 1).", used / total if total else 0.0, "gauge"),
        ("prefix_cache_queries_total", "Full prompt blocks looked up in the prefix cache.", queries, "counter"),
        ("prefix_cache_hits_total", "Full prompt blocks found in the prefix cache.", hits, "counter"),
        (
            "prefix_cache_hit_rate",
            "Prefix-cache hits over queries, since start (0 to 1).",
            hits / queries if queries else 0.0,
            "gauge",
        ),
        (
            "num_preemptions_total",
            "Running requests evicted to free blocks (recomputed later).",
            state["preemptions"],
            "counter",
        ),
    ]


def render_metrics(engine, stats: ServerStats, model_name: str) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    lines = [
        "# HELP lifeofprompt_model_info The model this server runs.",
        "# TYPE lifeofprompt_model_info gauge",
        f'lifeofprompt_model_info{{model_name="{model_name}"}} 1',
    ]
    for name, text, value, kind in engine_series(engine):
        lines += _gauge(f"lifeofprompt_{name}", text, value, kind)
    lines += spec_decode_lines(engine)
    with stats.lock:
        lines += _gauge(
            "lifeofprompt_prompt_tokens_total", "Prompt tokens of finished requests.", stats.prompt_tokens, "counter"
        )
        generated = stats.generation_tokens
        lines += _gauge(
            "lifeofprompt_generation_tokens_total", "Tokens generated by finished requests.", generated, "counter"
        )
        lines += [
            "# HELP lifeofprompt_request_success_total Finished requests, by finish reason.",
            "# TYPE lifeofprompt_request_success_total counter",
        ]
        lines += [
            f'lifeofprompt_request_success_total{{finished_reason="{reason}"}} {n}'
            for reason, n in sorted(stats.finished.items())
        ]
        for histogram in (stats.ttft, stats.tpot, stats.e2e):
            lines += histogram.render()
    return "\n".join(lines) + "\n"
