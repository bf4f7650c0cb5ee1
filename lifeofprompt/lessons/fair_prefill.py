"""Fair chunked prefill, measured on the real engine: a short request's wait beside a long prompt.

A long prompt is prefilled in chunks of the step's token budget. Without a per-request cap it takes
the whole budget every step, so a short request that arrives meanwhile waits for the rest of the
long prefill before its own first token. With ``long_prefill_token_threshold`` (the scheduler's
``fair_chunk``) the long prompt takes at most that many tokens a step while anyone else waits or
runs, and the short request's prefill rides in the next step.

``short_beside_long`` drives an ``LLMEngine`` directly (no HTTP): the long prompt prefills alone
for ``arrive_after`` steps, then the short request arrives. Its time to first token comes from its
own ``RequestMetrics`` (arrival to first token), and every step from the long prompt's arrival is
kept with its duration and each request's share, so a figure can draw the timeline. Notebook 09
draws it; ``benchmarks/fair_prefill.py`` measures it with the mixed workload's throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams


@dataclass
class StepSpan:
    """One engine step, in seconds since the long prompt arrived, and the tokens each request got in it."""

    start_s: float
    end_s: float
    long_tokens: int
    short_tokens: int

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class ShortBesideLong:
    """What the short request waited, and the steps around it."""

    threshold: int | None              # the engine's long_prefill_token_threshold (None: off)
    long_len: int
    short_len: int
    short_arrival_s: float             # since the long prompt arrived
    ttft_s: float                      # the short request's arrival to its first token
    steps_to_first_token: int          # steps from its arrival to its first token (the step that gave it included)
    spans: list[StepSpan] = field(default_factory=list)
    long_first_token_s: float | None = None   # when the long prompt's prefill ended (None: aborted first)

    @property
    def first_token_s(self) -> float:
        return self.short_arrival_s + self.ttft_s

    @property
    def after_arrival(self) -> list[StepSpan]:
        return [s for s in self.spans if s.start_s >= self.short_arrival_s]

    @property
    def first_token_step_s(self) -> float:
        """The duration of the step that gave the short request its first token."""
        return self.after_arrival[self.steps_to_first_token - 1].duration_s

    def as_dict(self) -> dict:
        """The benchmark's JSON fields: TTFT, steps to it, and the steps after the short request arrived."""
        step_s = [s.duration_s for s in self.after_arrival]
        return {"ttft_s": self.ttft_s, "steps_to_first_token": self.steps_to_first_token, "step_s": step_s,
                "max_step_s": max(step_s), "first_token_step_s": self.first_token_step_s}


def synthetic_ids(vocab_size: int, length: int, stride: int = 7919) -> list[int]:
    """A prompt of ``length`` token ids that no other prompt shares (the prefix cache stays out of it)."""
    return [100 + (i * stride) % (vocab_size - 200) for i in range(length)]


def short_beside_long(engine, long_ids, short_ids, arrive_after: int = 1, short_max_tokens: int = 4,
                      finish: bool = True) -> ShortBesideLong:
    """The long prompt prefills alone for ``arrive_after`` steps, then the short request arrives.

    ``finish=False`` aborts the long prompt once the short request is done (a notebook need not
    wait for the rest of a prefill it has already seen); ``True`` runs both to the end.
    """
    first_step = len(engine.step_records)
    engine.add_request("long", list(long_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    long_metrics = engine.requests["long"].metrics
    origin = long_metrics.arrival_time
    for _ in range(arrive_after):
        engine.step()
    engine.add_request("short", list(short_ids), SamplingParams(temperature=0, max_tokens=short_max_tokens,
                                                               ignore_eos=True))
    short_metrics = engine.requests["short"].metrics
    arrival_step = len(engine.step_records)
    while engine.has_unfinished_requests():
        engine.step()
        if not finish and "short" not in engine.requests and "long" in engine.requests:
            engine.abort("long")
    records = list(engine.step_records)[first_step:]
    spans = [StepSpan(r.start_time - origin, r.end_time - origin,
                      sum(s.num_tokens for s in r.scheduled if s.request_id == "long"),
                      sum(s.num_tokens for s in r.scheduled if s.request_id == "short")) for r in records]
    after = list(engine.step_records)[arrival_step:]
    steps_to_first = next(i + 1 for i, r in enumerate(after) if any(
        s.request_id == "short" and s.end >= len(short_ids) for s in r.scheduled))
    return ShortBesideLong(engine.scheduler.long_prefill_token_threshold, len(long_ids), len(short_ids),
                           short_metrics.arrival_time - origin,
                           short_metrics.first_token_time - short_metrics.arrival_time, steps_to_first, spans,
                           None if long_metrics.first_token_time is None else long_metrics.first_token_time - origin)


def short_alone(engine, short_ids) -> float:
    """The short request's time to first token on an idle engine (the figure's reference)."""
    engine.add_request("alone", list(short_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    metrics = engine.requests["alone"].metrics
    engine.run_until_done()
    return metrics.first_token_time - metrics.arrival_time
