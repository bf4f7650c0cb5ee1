"""Arrival patterns: seeded Poisson gaps, closed-loop release, the asyncio driver."""

import asyncio

import numpy as np
import pytest

from lifeofprompt.errors import InvalidRequestError
from lifeofprompt.loadtest.arrivals import (
    Dispatcher,
    all_at_once,
    at_times,
    closed_loop,
    drive,
    poisson,
    sample_lengths,
)


def test_poisson_is_seeded_and_has_the_rate():
    a, b = poisson(2000, rate=4.0, seed=1).send_times(), poisson(2000, rate=4.0, seed=1).send_times()
    assert a == b and a != poisson(2000, rate=4.0, seed=2).send_times()
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 2000 / a[-1] == pytest.approx(4.0, rel=0.06)
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: std == mean


def test_open_loop_dispatch_by_time():
    d = Dispatcher(all_at_once(3))
    assert d.due(0.0) == [0, 1, 2] and d.done
    d = Dispatcher(poisson(3, rate=1.0, seed=0))
    t = d.times
    assert d.due(t[0] - 1e-9) == [] and d.next_time() == t[0]
    assert d.due(t[1]) == [0, 1] and d.due(10 * t[2]) == [2]


def test_given_times_are_kept():
    d = Dispatcher(at_times([0.0, 0.5, 0.5, 2.0]))
    assert d.due(0.0) == [0] and d.next_time() == 0.5
    assert d.due(0.49) == [] and d.due(0.5) == [1, 2] and d.due(5.0) == [3] and d.done
    assert "4 requests at given times" in at_times([0, 1, 1, 3]).describe()
    for bad in ([1.0, 0.5], [-1.0]):
        with pytest.raises(InvalidRequestError):
            at_times(bad)


def test_closed_loop_keeps_n_in_flight():
    d = Dispatcher(closed_loop(5, num_clients=2))
    assert d.due(0.0) == [0, 1] and d.due(100.0) == []
    d.finished()
    assert d.due(0.0) == [2]
    d.finished(2)
    assert d.due(0.0) == [3, 4] and d.done


def test_bad_patterns_are_rejected():
    with pytest.raises(InvalidRequestError):
        poisson(3, rate=0)
    with pytest.raises(InvalidRequestError):
        closed_loop(3, num_clients=0)
    with pytest.raises(InvalidRequestError):
        closed_loop(3, 1).send_times()


def test_drive_closed_loop_never_exceeds_clients():
    in_flight, peak, order = 0, 0, []

    async def send(i):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        order.append(i)
        await asyncio.sleep(0)
        in_flight -= 1

    assert asyncio.run(drive(closed_loop(7, num_clients=3), send)) == 7
    assert peak == 3 and sorted(order) == list(range(7))


def test_drive_open_loop_sends_everything():
    sent = []

    async def send(i):
        sent.append(i)

    assert asyncio.run(drive(poisson(4, rate=1000.0, seed=0), send)) == 4
    assert sent == [0, 1, 2, 3]


def test_sample_lengths():
    assert sample_lengths(3, 8) == [8, 8, 8]
    lengths = sample_lengths(50, (16, 32), seed=3)
    assert lengths == sample_lengths(50, (16, 32), seed=3)
    assert min(lengths) >= 16 and max(lengths) <= 32 and len(set(lengths)) > 5
