"""Chapter 13's toy queue, run against the package outside the notebook.

The toy (``# toy: queue served in steps``) serves Poisson arrivals in steps with a fixed number of seats; its check
(``# check: queue served in steps``) asserts that its arrivals are ``arrivals.poisson``'s, that the package's
``Simulator`` (the engine's scheduler on a virtual clock, every step priced the same) gives every request the same
first-token time, and that ``metrics.summarize`` finds its median and p99. The ``broken`` tests change one rule of
the toy and expect the check to fail; the others hold the toy to what the chapter's prose and exercises say of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_notebook_toys import broken, cell_sources, run_cells

NOTEBOOK = "13_load_test.ipynb"
MARKERS = ("# toy: queue served in steps", "# check: queue served in steps")


def run(sources):
    from lifeofprompt.lessons import roofline

    namespace = {"__name__": "queue", "np": np, "roofline": roofline}
    for i, source in enumerate(sources):
        exec(compile(source, f"<13 cell {i}>", "exec"), namespace)
    return namespace


def test_the_queue_toy_takes_the_simulators_steps():
    ns = run(cell_sources(NOTEBOOK, *MARKERS))
    assert ns["toy_capacity"] == pytest.approx(8 / (16 * 0.03))


def test_p99_climbs_near_capacity_and_the_median_at_half_load_is_a_step_and_a_half():
    ns = run_cells(cell_sources(NOTEBOOK, MARKERS[0]), "queue")
    step, seats, out = 0.03, 8, 16
    capacity = seats / (out * step)
    p99 = {}
    for load in (0.5, 0.95):
        times = ns["poisson_arrivals"](5000, load * capacity, seed=0)
        waits = np.array(ns["serve_in_steps"](times, lambda n: step, seats, out)) - times
        p99[load] = np.percentile(waits, 99)
        if load == 0.5:
            assert np.median(waits) / step == pytest.approx(1.5, abs=0.25)  # exercise 2's answer
    assert p99[0.95] > 3 * p99[0.5]


def test_the_capacity_rule_of_exercise_1_is_what_the_toy_serves():
    ns = run_cells(cell_sources(NOTEBOOK, MARKERS[0]), "queue")
    curve = lambda n: 0.016 + 0.0015 * n  # noqa: E731 (any rising batching curve)
    seats, out = 16, 32
    flood = ns["poisson_arrivals"](3000, 3 * seats / (out * curve(seats)), seed=0)
    first = ns["serve_in_steps"](flood, curve, seats, out)
    served = 3000 / (max(first) + out * curve(seats) - flood[0])
    assert served == pytest.approx(seats / (out * curve(seats)), rel=0.05)


@pytest.mark.parametrize(
    "old, new",
    [
        ("running[waiting.popleft()] = output_len", "running[waiting.pop()] = output_len"),  # last come, first served
        ("len(running) < seats", "len(running) <= seats"),  # one seat too many
        ("if first[r] is None:", "if True:"),  # the last token's time instead of the first
    ],
    ids=["lifo", "extra-seat", "last-token"],
)
def test_the_queue_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run(broken(cell_sources(NOTEBOOK, *MARKERS), old, new))
