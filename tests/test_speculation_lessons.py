"""Chapter 14's arithmetic against a simulated drafter whose acceptance is known."""

import random

import pytest

from lifeofprompt.lessons.speculation import (
    accepted_fraction,
    alpha_from_accepted_fraction,
    alpha_from_counts,
    benchmark_rows,
    expected_tokens_per_step,
    predicted_speedup,
)


def simulate(alpha: float, k: int, steps: int, seed: int = 0):
    """Verify steps of a coin-flip drafter: the yield of each, and the engine's per-position counts."""
    rng = random.Random(seed)
    accepted, reached, yields = [0] * k, [0] * k, []
    for _ in range(steps):
        run = 0
        for i in range(k):
            reached[i] += 1
            if rng.random() >= alpha:
                break
            accepted[i] += 1
            run += 1
        yields.append(run + 1)
    return yields, accepted, reached


@pytest.mark.parametrize("alpha,k", [(0.0, 3), (0.3, 1), (0.6, 4), (0.9, 8), (1.0, 5)])
def test_the_formulas_match_a_simulated_drafter(alpha, k):
    yields, accepted, reached = simulate(alpha, k, 20000)
    assert sum(yields) / len(yields) == pytest.approx(expected_tokens_per_step(alpha, k), rel=0.02)
    assert sum(accepted) / (k * len(yields)) == pytest.approx(accepted_fraction(alpha, k), abs=0.01)
    assert alpha_from_counts(accepted, reached) == pytest.approx(alpha, abs=0.01)


def test_the_accepted_fraction_is_not_alpha_and_inverts():
    assert accepted_fraction(0.8, 4) < 0.8  # drafts after a rejection are wasted
    assert accepted_fraction(0.8, 1) == pytest.approx(0.8)
    assert alpha_from_accepted_fraction(accepted_fraction(0.7, 5), 5) == pytest.approx(0.7, abs=1e-9)
    # the naive reading (fraction as α) underestimates the yield
    fraction = accepted_fraction(0.8, 4)
    assert expected_tokens_per_step(fraction, 4) < expected_tokens_per_step(0.8, 4)


def test_edges_and_bad_input():
    assert expected_tokens_per_step(1.0, 3) == 4 and expected_tokens_per_step(0.0, 3) == 1
    assert predicted_speedup(0.0, 4, verify_cost=1.1) < 1 < predicted_speedup(0.8, 4, verify_cost=1.1)
    for bad in (
        lambda: expected_tokens_per_step(1.2, 3),
        lambda: accepted_fraction(0.5, 0),
        lambda: alpha_from_counts([0, 0], [0, 0]),
        lambda: alpha_from_counts([3], [2]),
    ):
        with pytest.raises(ValueError):
            bad()


def test_benchmark_rows_put_each_run_in_a_line_with_its_ratio():
    run = lambda plain, lookup: {
        "batch": 1,
        "none": {"tokens_per_s": plain},
        "ngram": {"tokens_per_s": lookup},  # noqa: E731
        "ngram_speedup": lookup / plain,
    }
    lines = benchmark_rows({"runs": {"code_batch1": run(50.0, 77.7), "open_batch8": {**run(186.7, 147.6), "batch": 8}}})
    assert lines[1].split() == ["code", "1", "50.0", "77.7", "1.55x"]
    assert lines[2].split() == ["open", "8", "186.7", "147.6", "0.79x"]
