"""When requests arrive: all at once, a closed loop of N clients, Poisson at a rate, or at given times.

Three ways to load a server, and they answer different questions:

* **all at once** — every request at t = 0: the batch-inference view, best-case throughput.
* **closed loop of N clients** — each client sends its next request the moment its last one
  finishes: at most N in flight, so it measures capacity, never the queue.
* **Poisson at a rate** — independent users: gaps drawn from an exponential distribution with
  mean 1 / rate (seeded). Arrivals bunch by chance, so a queue forms even below capacity,
  and the slowest first tokens are the ones that waited in it.

A fourth, ``at_times``, sends each request at a time given in advance: a recorded trace, or a
lesson's scene (a short request that arrives while a long prompt prefills).

One ``ArrivalPattern`` describes the load; ``Dispatcher`` releases requests from it in a
synchronous loop (the engine and the simulator), ``drive`` in an asyncio program (the load
tester). Nothing here knows about models or HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidRequestError

KINDS = ("all_at_once", "closed_loop", "poisson", "at_times")


@dataclass(frozen=True)
class ArrivalPattern:
    kind: str  # "all_at_once" | "closed_loop" | "poisson"
    num_requests: int
    rate: float | None = None  # requests per second (poisson)
    num_clients: int | None = None  # clients in the closed loop
    seed: int | None = 0  # poisson gaps are drawn from this seed
    times: tuple[float, ...] | None = None  # at_times: each request's send time, in seconds from the start

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"arrival kind must be one of {KINDS}, got {self.kind!r}", param="kind")
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise InvalidRequestError(
                f"num_requests must be an integer >= 1, got {self.num_requests!r}", param="num_requests"
            )
        if self.kind == "poisson" and not (isinstance(self.rate, (int, float)) and self.rate > 0):
            raise InvalidRequestError(f"a Poisson load needs a rate > 0 requests/s, got {self.rate!r}", param="rate")
        if self.kind == "closed_loop" and not (isinstance(self.num_clients, int) and self.num_clients >= 1):
            raise InvalidRequestError(
                f"a closed loop needs num_clients >= 1, got {self.num_clients!r}", param="num_clients"
            )
        if self.kind == "at_times":
            times = list(self.times or ())
            if len(times) != self.num_requests or any(t < 0 for t in times) or times != sorted(times):
                raise InvalidRequestError(
                    f"at_times needs {self.num_requests} non-decreasing times >= 0, got {self.times!r}", param="times"
                )

    @property
    def is_closed_loop(self) -> bool:
        return self.kind == "closed_loop"

    def send_times(self) -> list[float]:
        """Offsets in seconds from the start at which each request is sent (open loops only)."""
        if self.kind == "all_at_once":
            return [0.0] * self.num_requests
        if self.kind == "poisson":
            gaps = np.random.default_rng(self.seed).exponential(1.0 / self.rate, self.num_requests)
            return [float(t) for t in np.cumsum(gaps)]
        if self.kind == "at_times":
            return [float(t) for t in self.times]
        raise InvalidRequestError("a closed loop has no send times: each client sends when its last request finishes")

    def describe(self) -> str:
        if self.kind == "all_at_once":
            return f"{self.num_requests} requests all at once"
        if self.kind == "poisson":
            return f"{self.num_requests} requests, Poisson at {self.rate:g} req/s (seed {self.seed})"
        if self.kind == "at_times":
            return f"{self.num_requests} requests at given times, the last at {self.times[-1]:g} s"
        return f"{self.num_requests} requests from a closed loop of {self.num_clients} clients"


def all_at_once(num_requests: int) -> ArrivalPattern:
    return ArrivalPattern("all_at_once", num_requests)


def poisson(num_requests: int, rate: float, seed: int | None = 0) -> ArrivalPattern:
    return ArrivalPattern("poisson", num_requests, rate=rate, seed=seed)


def closed_loop(num_requests: int, num_clients: int) -> ArrivalPattern:
    return ArrivalPattern("closed_loop", num_requests, num_clients=num_clients)


def at_times(times) -> ArrivalPattern:
    """Request ``i`` is sent at ``times[i]`` seconds (non-decreasing)."""
    times = tuple(float(t) for t in times)
    return ArrivalPattern("at_times", len(times), times=times)


# ----------------------------------------------------------------------------- synchronous release


class Dispatcher:
    """Releases request indices 0, 1, … as the pattern allows, for a loop that owns the clock.

    Open loops release by time (``due(now)``); a closed loop releases one request per free
    client, and a client frees up when the loop reports ``finished()``.
    """

    def __init__(self, pattern: ArrivalPattern):
        self.pattern = pattern
        self.times = None if pattern.is_closed_loop else pattern.send_times()
        self.num_sent = 0
        self.in_flight = 0

    @property
    def done(self) -> bool:
        return self.num_sent == self.pattern.num_requests

    def due(self, now: float) -> list[int]:
        """Indices to send now (``now`` in seconds since the start)."""
        out = []
        while not self.done:
            if self.times is not None and self.times[self.num_sent] > now:
                break
            if self.times is None and self.in_flight >= self.pattern.num_clients:
                break
            out.append(self.num_sent)
            self.num_sent += 1
            self.in_flight += 1
        return out

    def finished(self, count: int = 1) -> None:
        self.in_flight -= count

    def next_time(self) -> float | None:
        """When the next open-loop request is due (None: closed loop, or nothing left)."""
        if self.done or self.times is None:
            return None
        return self.times[self.num_sent]


# ----------------------------------------------------------------------------- asyncio release


async def drive(
    pattern: ArrivalPattern,
    send: Callable[[int], Awaitable[None]],
    max_duration: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Call ``await send(i)`` for each request as the pattern says; return how many were sent.

    Open loops start each send as its own task at its time; a closed loop runs
    ``num_clients`` workers that each send, wait, send the next. No new request starts after
    ``max_duration`` seconds; those already started are awaited.
    """
    start = clock()
    expired = (lambda: clock() - start >= max_duration) if max_duration is not None else (lambda: False)
    if pattern.is_closed_loop:
        counter = iter(range(pattern.num_requests))
        sent = 0

        async def worker():
            nonlocal sent
            for i in counter:
                if expired():
                    return
                sent += 1
                await send(i)

        await asyncio.gather(*(worker() for _ in range(pattern.num_clients)))
        return sent
    tasks = []
    for i, t in enumerate(pattern.send_times()):
        delay = start + t - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if expired():
            break
        tasks.append(asyncio.ensure_future(send(i)))
    await asyncio.gather(*tasks)
    return len(tasks)


# ----------------------------------------------------------------------------- request lengths


def sample_lengths(num_requests: int, spec: int | tuple[int, int], seed: int | None = 0) -> list[int]:
    """Token counts: a fixed ``int``, or uniform over ``(low, high)`` inclusive, seeded."""
    if isinstance(spec, int):
        if spec < 1:
            raise InvalidRequestError(f"a length must be >= 1, got {spec}")
        return [spec] * num_requests
    low, high = spec
    if not 1 <= low <= high:
        raise InvalidRequestError(f"a length range needs 1 <= low <= high, got {spec}")
    return [int(x) for x in np.random.default_rng(seed).integers(low, high + 1, num_requests)]
