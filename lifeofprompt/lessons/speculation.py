"""Speculative decoding in numbers (notebook 10): what a verify step is worth, and how to read the counts.

Model the drafter as a coin: each draft token is accepted with probability α, independently,
until the first rejection. A verify step of k drafts then yields the accepted run plus the
model's own next token, so its expected yield is

    E[tokens per step] = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)

(k + 1 when α = 1). The engine counts, per draft position i, how often that position was
*reached* (every draft before it accepted) and how often it was *accepted*
(``SpecDecodeStats.num_reached_per_pos`` / ``num_accepted_tokens_per_pos``). Every reached
position is one toss of the coin, so α's estimate is accepted ÷ reached over all positions.

The fraction of drafted tokens that were accepted is a different number: a step drafts k
tokens whatever happens, and the expected accepted count is α + … + α^k, so

    accepted ÷ drafted = (α − α^(k+1)) / (k (1 − α)),

which is below α for every k > 1 (the positions after a rejection are drafted and wasted).

Whether it pays is the roofline's question (notebook 05): a decode step that reads all the
weights for one token per sequence costs about as much for k + 1 rows. ``predicted_speedup``
folds in what the verify step costs over a plain step and what the drafter costs.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a verify step of ``k`` drafts yields on average, for a per-token acceptance ``alpha``."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha is a probability, got {alpha}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def accepted_fraction(alpha: float, k: int) -> float:
    """Expected accepted ÷ drafted tokens for ``k`` drafts per step: ``(α − α^(k+1)) / (k (1 − α))``."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    return (expected_tokens_per_step(alpha, k) - 1) / k


def alpha_from_counts(accepted_per_pos: list[int], reached_per_pos: list[int]) -> float:
    """Per-token acceptance from the per-position counts: accepted ÷ reached over every position.

    Position ``i`` is reached only when drafts ``0 .. i-1`` were all accepted; each reach is one
    Bernoulli trial of the same α, so this ratio is α's maximum-likelihood estimate.
    """
    reached = sum(reached_per_pos)
    if reached == 0:
        raise ValueError("no draft position was reached: nothing was drafted")
    if any(a > r for a, r in zip(accepted_per_pos, reached_per_pos)):
        raise ValueError("a position was accepted more often than it was reached")
    return sum(accepted_per_pos) / reached


def alpha_from_accepted_fraction(fraction: float, k: int) -> float:
    """The α that gives ``accepted_fraction(α, k) == fraction`` (bisection: the fraction rises with α)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"a fraction, got {fraction}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if accepted_fraction(mid, k) < fraction else (low, mid)
    return (low + high) / 2


def predicted_speedup(alpha: float, k: int, verify_cost: float = 1.0, draft_cost: float = 0.0) -> float:
    """Tokens per unit time with speculation over without it.

    ``verify_cost``: a verify step's time over a plain decode step's (≈ 1 while the step is
    memory-bound; it grows once k + 1 rows per sequence make it compute-bound, at larger
    batches). ``draft_cost``: the drafter's time per step, in plain decode steps (≈ 0 for
    prompt lookup; k × a small model's step for a draft model).
    """
    return expected_tokens_per_step(alpha, k) / (verify_cost + draft_cost)


@dataclass
class SpeculationRun:
    """What one measured run gave: for the notebook's table and its place on the plot."""

    label: str
    k: int
    output_tokens: int
    seconds: float
    verify_steps: int
    accepted_per_pos: list[int]
    reached_per_pos: list[int]

    @property
    def alpha(self) -> float:
        return alpha_from_counts(self.accepted_per_pos, self.reached_per_pos)

    @property
    def tokens_per_step(self) -> float:
        """Tokens per verify step measured (the expected value's observed counterpart)."""
        return 1 + sum(self.accepted_per_pos) / self.verify_steps if self.verify_steps else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds
