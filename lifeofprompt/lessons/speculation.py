"""Speculative decoding in numbers (notebook 14): what a verify step is worth, and how to read the counts.

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

``first_layers(model, L)`` makes the self-speculative draft chapter 14, its benchmark
(``benchmarks/bench_spec.py``) and the tests use: the model's own first L layers, its final norm and
LM head, sharing the weights. The engine takes it as any other draft model.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from torch import nn

from ..errors import SpeculativeConfigError


def first_layers(model, num_layers: int):
    """The model's first ``num_layers`` layers, with its final norm and LM head: a draft sharing its weights."""
    if not 1 <= num_layers <= model.config.num_layers:
        raise SpeculativeConfigError(
            f"first_layers wants 1..{model.config.num_layers} layers, got {num_layers}", param="model"
        )
    draft = copy.copy(model)  # the same modules, a separate module dict for the layers
    draft._modules = dict(model._modules)
    draft.layers = nn.ModuleList(list(model.layers)[:num_layers])
    draft.config = dataclasses.replace(
        model.config, num_layers=num_layers, name=f"{model.config.name}-first{num_layers}"
    )
    draft.source = f"{getattr(model, 'source', model.config.name)}: its first {num_layers} layers + norm + LM head"
    return draft


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
    draft_lengths: list[int] = field(default_factory=list)  # drafts each verify step checked, in order

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

    @property
    def mean_drafts(self) -> float:
        """Drafts a verify step checked on average (``k`` where the run did not record its steps)."""
        return sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else float(self.k)

    @property
    def expected_at_drafts(self) -> float:
        """The formula at this run's α, averaged over the draft counts its verify steps really checked.

        A verify of fewer than k drafts (the end of an answer, a short lookup match, the engine's
        pricing) can yield at most that many plus one, so this, not the formula at k, is what the
        measured ``tokens_per_step`` should match."""
        if not self.draft_lengths:
            return expected_tokens_per_step(self.alpha, self.k)
        return sum(expected_tokens_per_step(self.alpha, n) for n in self.draft_lengths) / len(self.draft_lengths)


# ----------------------------------------------------------------------------- the workloads

# Repetitive work, where prompt lookup should fire: a function is in the prompt and the answer
# repeats most of it. And open-ended text, where it rarely does. benchmarks/bench_spec.py and
# notebook 14 measure these same conversations.
SNIPPETS = (
    "def total_price(items, tax):\n    total = 0\n    for item in items:\n"
    "        total = total + item.price * item.count\n"
    "    return total * (1 + tax)\n",
    "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n            return user\n"
    "    return None\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n\n    def top(self, n):\n"
    "        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]\n",
    "def read_lines(path):\n    lines = []\n    with open(path) as f:\n        for line in f:\n"
    "            lines.append(line.strip())\n    return lines\n",
)
EDITS = (
    "Add type hints to this Python code. Reply with the full code only.",
    "Rename every variable to a longer, clearer name. Reply with the full code only.",
    "Add a docstring to each function. Reply with the full code only.",
    "Rewrite this code so that it uses snake_case and four-space indentation. Reply with the full code only.",
)
OPEN_QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe a perfect autumn day in a small mountain village.",
    "What are three good habits for learning a new language, and why?",
    "Write a poem about the sea at night.",
    "Tell me about the history of the bicycle.",
    "Give advice to someone starting their first job.",
    "Describe how bread is made, step by step.",
)


def workloads() -> dict[str, list[list[dict]]]:
    """Chat conversations: ``code``, 8 edits (4 snippets × 2 edits), and ``open``, 8 open-ended requests."""
    code = [
        [{"role": "user", "content": f"{EDITS[(i + j) % len(EDITS)]}\n\n```python\n{s}```"}]
        for i, s in enumerate(SNIPPETS)
        for j in range(2)
    ]
    return {"code": code, "open": [[{"role": "user", "content": q}] for q in OPEN_QUESTIONS]}


# ----------------------------------------------------------------------------- measuring


def measure_step_rows(runner, rows_list, context: int = 128, repeats: int = 5) -> dict[int, float]:
    """Seconds of one forward of ``rows`` new rows after ``context`` cached tokens (fastest of ``repeats``).

    A verify step of k drafts is a forward of k + 1 rows per sequence; one row is a plain decode.
    The ratio is ``predicted_speedup``'s ``verify_cost``.
    """
    import math
    import time

    import torch

    from ..engine.sampling_params import SamplingParams
    from ..engine.sequence import Sequence

    out = {}
    for rows in rows_list:
        seq = Sequence("timing", [1] * (context + rows), SamplingParams(temperature=0))
        seq.num_computed_tokens = context
        seq.block_table = list(range(math.ceil((context + rows) / runner.resolved.block_size)))
        best = float("inf")
        with torch.no_grad():
            for _ in range(repeats + 1):
                inputs = runner.prepare([seq], [rows])
                start = time.perf_counter()
                runner.model(*inputs)
                best = min(best, time.perf_counter() - start)
        out[rows] = best
    return out


def run_requests(llm, prompts, max_tokens: int, batch: int, label: str, k: int = 0) -> SpeculationRun:
    """Greedy answers to ``prompts`` in groups of ``batch``; the time, the tokens and the engine's acceptance counts."""
    import time

    from ..engine.sampling_params import SamplingParams

    stats = llm.engine.spec_stats
    counts = lambda: (stats.num_drafts, list(stats.num_accepted_tokens_per_pos), list(stats.num_reached_per_pos))  # noqa: E731
    before = counts() if stats is not None else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seconds, tokens, lengths = 0.0, 0, []
    for i in range(0, len(prompts), batch):
        start = time.perf_counter()
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        lengths += [len(s.draft_token_ids) for o in outs for s in (o.metrics.spec_steps or ()) if s.draft_token_ids]
    if stats is None:
        return SpeculationRun(label, 0, tokens, seconds, 0, [], [])
    after = counts()
    return SpeculationRun(
        label,
        k or stats.num_speculative_tokens,
        tokens,
        seconds,
        after[0] - before[0],
        [a - b for a, b in zip(after[1], before[1])],
        [a - b for a, b in zip(after[2], before[2])],
        lengths,
    )


def benchmark_rows(result: dict) -> list[str]:
    """``benchmarks/bench_spec.py``'s result as table lines: workload, batch, tok/s without and with
    prompt lookup, and the ratio (each the best of alternating rounds)."""
    lines = [f"{'workload':8s} {'batch':>5s} {'plain tok/s':>12s} {'lookup tok/s':>13s} {'speedup':>8s}"]
    for name, row in result["runs"].items():
        workload = name.split("_batch")[0]
        lines.append(
            f"{workload:8s} {row['batch']:5d} {row['none']['tokens_per_s']:12.1f} "
            f"{row['ngram']['tokens_per_s']:13.1f} {row['ngram_speedup']:7.2f}x"
        )
    return lines
