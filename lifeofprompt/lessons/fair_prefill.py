"""Fair chunked prefill, measured on the real engine: a short request's wait beside a long prompt.

A long prompt is prefilled in chunks of the step's token budget. Without a per-request cap it takes
the whole budget every step, so a short request that arrives meanwhile waits for the rest of the
long prefill before its own first token. With ``long_prefill_token_threshold`` (the scheduler's
``fair_chunk``) the long prompt takes at most that many tokens a step while anyone else waits or
runs, and the short request's prefill rides in the next step.

``short_beside_long`` drives an ``LLMEngine`` directly (no HTTP): the long prompt prefills alone
for ``arrive_after`` steps, then the short request arrives. Its time to first token comes from its
own ``RequestMetrics`` (arrival to first token), and every step from the long prompt's arrival is
kept with its duration and each request's share, so a figure can draw the timeline. Chapter 09
(``09_chunked_prefill.ipynb``) draws it; ``benchmarks/fair_prefill.py`` measures it with the mixed
workload's throughput.

``simulated_short_beside_long`` plays the same scene on the simulator (``lessons.simulator``: the
same scheduler on the roofline clock), so chapter 09 can put the two side by side, and
``format_runs`` prints them as one table: steps always, seconds when asked (steps depend on the
scheduler alone; seconds on the machine and its load).
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

    threshold: int | None  # the engine's long_prefill_token_threshold (None: off)
    long_len: int
    short_len: int
    short_arrival_s: float  # since the long prompt arrived
    ttft_s: float  # the short request's arrival to its first token
    steps_to_first_token: int  # steps from its arrival to its first token (the step that gave it included)
    spans: list[StepSpan] = field(default_factory=list)
    long_first_token_s: float | None = None  # when the long prompt's prefill ended (None: aborted first)

    @property
    def first_token_s(self) -> float:
        return self.short_arrival_s + self.ttft_s

    @property
    def after_arrival(self) -> list[StepSpan]:
        return [s for s in self.spans if s.start_s >= self.short_arrival_s]

    @property
    def long_prefill_steps(self) -> int | None:
        """Steps from the long prompt's arrival to the end of its prefill (None: aborted before)."""
        done = 0
        for i, span in enumerate(self.spans):
            done += span.long_tokens
            if done >= self.long_len:
                return i + 1
        return None

    @property
    def first_token_step_s(self) -> float:
        """The duration of the step that gave the short request its first token."""
        return self.after_arrival[self.steps_to_first_token - 1].duration_s

    def as_dict(self) -> dict:
        """The benchmark's JSON fields: TTFT, steps to it, and the steps after the short request arrived."""
        step_s = [s.duration_s for s in self.after_arrival]
        return {
            "ttft_s": self.ttft_s,
            "steps_to_first_token": self.steps_to_first_token,
            "step_s": step_s,
            "max_step_s": max(step_s),
            "first_token_step_s": self.first_token_step_s,
        }


def synthetic_ids(vocab_size: int, length: int, stride: int = 7919) -> list[int]:
    """A prompt of ``length`` token ids that no other prompt shares (the prefix cache stays out of it)."""
    return [100 + (i * stride) % (vocab_size - 200) for i in range(length)]


def short_beside_long(
    engine, long_ids, short_ids, arrive_after: int = 1, short_max_tokens: int = 4, finish: bool = True
) -> ShortBesideLong:
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
    engine.add_request(
        "short", list(short_ids), SamplingParams(temperature=0, max_tokens=short_max_tokens, ignore_eos=True)
    )
    short_metrics = engine.requests["short"].metrics
    arrival_step = len(engine.step_records)
    while engine.has_unfinished_requests():
        engine.step()
        if not finish and "short" not in engine.requests and "long" in engine.requests:
            engine.abort("long")
    spans = _spans(list(engine.step_records)[first_step:], origin, "long", "short")
    steps_to_first = _steps_to_first_token(list(engine.step_records)[arrival_step:], "short", len(short_ids))
    return ShortBesideLong(
        engine.scheduler.config.long_prefill_token_threshold,
        len(long_ids),
        len(short_ids),
        short_metrics.arrival_time - origin,
        short_metrics.first_token_time - short_metrics.arrival_time,
        steps_to_first,
        spans,
        None if long_metrics.first_token_time is None else long_metrics.first_token_time - origin,
    )


def _spans(records, origin: float, long_id: str, short_id: str) -> list[StepSpan]:
    return [
        StepSpan(
            r.start_time - origin,
            r.end_time - origin,
            sum(s.num_tokens for s in r.scheduled if s.request_id == long_id),
            sum(s.num_tokens for s in r.scheduled if s.request_id == short_id),
        )
        for r in records
    ]


def _steps_to_first_token(records_after_arrival, short_id: str, short_len: int) -> int:
    """Steps from the short request's arrival to the one that finished its prompt (and sampled its first token)."""
    return next(
        i + 1
        for i, r in enumerate(records_after_arrival)
        if any(s.request_id == short_id and s.end >= short_len for s in r.scheduled)
    )


def simulated_short_beside_long(sim, long_len: int, short_len: int, short_max_tokens: int = 4) -> ShortBesideLong:
    """The same scene on a fresh ``Simulator``: its scheduler, its threshold, its roofline clock.

    The long prompt arrives at 0 s and its first step runs alone; the short request is sent a
    nanosecond later, so the simulator takes it in between the first and the second step, as
    ``short_beside_long(arrive_after=1)`` does on the engine. Both run to the end (simulated time
    costs nothing). Fresh: a simulator that has served these prompts before would find them cached.
    """
    from ..loadtest.arrivals import at_times
    from .simulator import SimRequest

    result = sim.run([SimRequest(long_len, 1), SimRequest(short_len, short_max_tokens)], at_times([0.0, 1e-9]))
    long_timing, short_timing = result.timings
    arrival = short_timing.arrival_time
    after = [r for r in result.steps if r.start_time >= arrival]
    return ShortBesideLong(
        sim.scheduler.config.long_prefill_token_threshold,
        long_len,
        short_len,
        arrival,
        short_timing.first_token_time - arrival,
        _steps_to_first_token(after, "r1", short_len),
        _spans(result.steps, 0.0, "r0", "r1"),
        long_timing.first_token_time,
    )


def format_runs(runs: dict[str, ShortBesideLong], seconds: bool = True) -> str:
    """One line per run: the threshold, the short request's first token and the long prompt's prefill
    in steps (and seconds), and the long prompt's tokens in each step until the short one's first token."""
    width = max(len(name) for name in runs) + 2

    def when(steps, s):
        text = "-" if steps is None else f"{steps} step{'s' if steps != 1 else ''}"
        return f"{text}, {s:.2f} s" if seconds and s is not None else text

    cols = 22 if seconds else 18
    lines = [
        f"{'':{width}}{'threshold':>10}  {'short: first token':<{cols}}  {'long: prefill done':<{cols}}  "
        "long prompt's tokens per step, to the short one's first token"
    ]
    for name, run in runs.items():
        shown = len(run.spans) - len(run.after_arrival) + run.steps_to_first_token
        chunks = " ".join(str(s.long_tokens) for s in run.spans[:shown])
        threshold = "off" if run.threshold is None else str(run.threshold)
        lines.append(
            f"{name:{width}}{threshold:>10}  {when(run.steps_to_first_token, run.ttft_s):<{cols}}  "
            f"{when(run.long_prefill_steps, run.long_first_token_s):<{cols}}  {chunks}"
        )
    return "\n".join(lines)


def short_alone(engine, short_ids) -> float:
    """The short request's time to first token on an idle engine (the figure's reference)."""
    engine.add_request("alone", list(short_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    metrics = engine.requests["alone"].metrics
    engine.run_until_done()
    return metrics.first_token_time - metrics.arrival_time
