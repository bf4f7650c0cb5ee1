"""Chapter 10's timeline of decode steps: when the forward ran, and when the host worked, with and without
async scheduling.

``recorded_timeline(engine)`` wraps, on this one engine only, the calls a step is made of: the
scheduler's ``schedule``, the runner's ``prepare`` (the step's inputs), ``run_model`` (the forward),
``sample_step`` and the output processor's ``process`` (text and outputs). Each call appends
``(what, thread, start, end)`` to a list while the block runs; the engine's own code is unchanged, and
the wrappers are removed on the way out. With async scheduling the forward runs on the forward thread
and the rest on the engine's thread, so the two lanes of the figure are the two threads.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

# what each piece of a step is called in the figure, and where it lives on the engine
STEP_PARTS = {
    "schedule": ("scheduler", "schedule"),
    "inputs": ("runner", "prepare"),
    "forward": ("runner", "run_model"),
    "sample": ("runner", "sample_step"),
    "outputs": ("outputs", "process"),
}


@dataclass(frozen=True)
class Span:
    what: str  # a key of STEP_PARTS
    thread: str  # "engine" or "forward"
    start: float  # seconds (time.perf_counter)
    end: float


@contextmanager
def recorded_timeline(engine):
    """Record every step part's calls on ``engine`` while the block runs; yields the list of ``Span``s."""
    spans: list[Span] = []
    engine_thread = threading.get_ident()
    owners = {name: getattr(engine, owner) for name, (owner, _) in STEP_PARTS.items()}

    def timed(what, call):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                thread = "engine" if threading.get_ident() == engine_thread else "forward"
                spans.append(Span(what, thread, start, time.perf_counter()))

        return wrapper

    for what, (_, method) in STEP_PARTS.items():
        setattr(owners[what], method, timed(what, getattr(owners[what], method)))
    try:
        yield spans
    finally:
        for what, (_, method) in STEP_PARTS.items():
            delattr(owners[what], method)  # the class's method shows through again


def forwards(spans: list[Span]) -> list[Span]:
    """The forwards, in the order they started."""
    return sorted((s for s in spans if s.what == "forward"), key=lambda s: s.start)


def forward_gaps(spans: list[Span]) -> list[float]:
    """Seconds between one forward's end and the next one's start: the time the model waited for the host."""
    ran = forwards(spans)
    return [b.start - a.end for a, b in zip(ran, ran[1:])]


def time_per_token(spans: list[Span]) -> float:
    """Seconds from the first forward's start to the last one's end, per forward (one token each at batch 1)."""
    ran = forwards(spans)
    return (ran[-1].end - ran[0].start) / len(ran)
