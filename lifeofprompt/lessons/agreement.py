"""When two computations of the same model must pick the same tokens, and when they need not.

Two paths to the same logits (ours and transformers, bf16 and fp32, a cached and an uncached
forward, one batch and another, one CPU's kernels and another's) agree only up to rounding:
the order of a sum, the width of a vector register or the blocking of a matrix product moves
the last bits. Where the two best logits of a row are closer than that difference, either
token is a correct answer, and a test that insists on one of them fails on the next
processor. So an argmax is compared only where the reference's lead of its best token over
the second (its *top-2 margin*) exceeds a tolerance: the largest change of that margin
measured between the two paths, with room to spare. And every check also asserts that
enough rows or steps were decided, so a filter that lets everything through cannot pass.

* ``assert_argmax_agrees``: rows of logits (or chosen token ids) against reference logits,
  row by row. Teacher-forced comparisons have this shape: every row sees the same context.
* ``assert_greedy_agrees``: greedy sequences, step by step. After the first step where the
  two sequences differ they see different contexts and may go their own ways; that first
  difference must fall on a step the reference left undecided.

The two tolerances below are the ones this project measured (logits of SmolLM2-135M, values
up to ~30); a test of other paths measures its own.
"""

from __future__ import annotations

import torch

# fp32 against fp32: the five CPU product paths, cached against uncached decoding, ours against
# transformers, AVX-512 against forced AVX2 kernels, 1 and 2 threads: top-2 margins moved by at
# most 7e-5 over the 704 greedy steps of tests/data/engine_parity_smollm2.json. 70x that.
FP32_TOLERANCE = 5e-3
# bf16 against fp32 weights and activations, teacher-forced over the same 778 rows: margins moved
# by at most 0.58 (native AVX-512 BF16) and 0.46 (AVX2 emulation); every flipped argmax had a
# margin of 0.21 or less.
BF16_TOLERANCE = 0.75


# A way of computing the model that changes its numbers on purpose (integer activations, a compressed KV
# cache) is on by default only where it moves the top-2 margins of the story's teacher-forced rows by at
# most this much (bf16 moves them by up to 0.36 there) and the perplexity of the long shipped text by
# at most PERPLEXITY_SHIFT (lessons/perplexity.py).
MARGIN_SHIFT = 0.5
PERPLEXITY_SHIFT = 0.005


def margin_shift(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest change, over the rows, of the reference's top-2 margin: per row, the gap between the
    reference's two best tokens as the candidate's logits put it, against the reference's own gap. What
    decides whether a near tie can flip, so a way that moves it little keeps the reference's choices."""
    reference, candidate = reference.float(), candidate.float()
    top = reference.topk(2, dim=-1).indices
    gap = lambda logits: logits.gather(-1, top[..., :1]) - logits.gather(-1, top[..., 1:])  # noqa: E731
    return (gap(candidate) - gap(reference)).abs().max().item()


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the best logit minus the second best: ``[..., vocab] -> [...]`` (fp32)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@torch.no_grad()
def teacher_forced_logits(model, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """The logits that chose each of ``new_ids`` after ``prompt_ids``: one uncached forward, ``[len(new_ids), vocab]``.

    Row ``i`` is the model's prediction after ``prompt_ids + new_ids[:i]``. Works for our
    ``LlamaForCausalLM`` and for transformers' (whose output holds ``.logits``).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(new_ids)[:-1]], device=device)
    out = model(ids)
    logits = getattr(out, "logits", out)
    return logits[0, len(prompt_ids) - 1 :].float().cpu()


def assert_argmax_agrees(candidate, reference: torch.Tensor, tolerance, min_decided: int) -> int:
    """Row by row, ``candidate``'s choice is the reference's argmax wherever the reference decides it.

    ``candidate``: logits ``[rows, vocab]``, or the token ids chosen per row (a list or a 1-d
    tensor). ``reference``: logits ``[rows, vocab]``. A row is *decided* when the reference's
    top-2 margin exceeds ``tolerance`` (a number, or one per row); there the two choices must
    be equal. At least ``min_decided`` rows must be decided. Returns how many were.
    Raises ``AssertionError`` naming the first disagreeing row.
    """
    reference = reference.detach().float().cpu()
    if isinstance(candidate, torch.Tensor) and candidate.dim() == 2:
        chosen = candidate.detach().float().cpu().argmax(-1)
    else:
        chosen = torch.as_tensor(candidate, dtype=torch.long).cpu().flatten()
    assert reference.dim() == 2 and chosen.shape == reference.shape[:1], (
        f"{tuple(chosen.shape)} choices against reference logits of shape {tuple(reference.shape)}"
    )
    margins = top2_margins(reference)
    decided = margins > torch.as_tensor(tolerance, dtype=torch.float32)
    best = reference.argmax(-1)
    wrong = (decided & (chosen != best)).nonzero().flatten().tolist()
    if wrong:
        i = wrong[0]
        raise AssertionError(
            f"{len(wrong)} decided row(s) disagree; row {i}: chose {int(chosen[i])}, the reference "
            f"{int(best[i])} by a margin of {margins[i].item():.3g} (> tolerance {tolerance})"
        )
    count = int(decided.sum())
    if count < min_decided:
        raise AssertionError(
            f"only {count} of {len(margins)} rows decided (top-2 margin > {tolerance}); "
            f"at least {min_decided} needed, so the comparison would say too little"
        )
    return count


def assert_greedy_agrees(sequences, references, margins, tolerance: float, min_steps: int) -> list[int]:
    """Greedy token sequences against reference sequences, step by step, until they legitimately part.

    ``sequences`` and ``references``: lists of token-id lists (one pair per prompt);
    ``margins``: per reference, the top-2 margin of the logits that chose each of its tokens.
    Each pair must be equal up to its first difference, and that difference must come at a step
    whose reference margin is at most ``tolerance`` (a near tie: either token is right, and the
    rest of the sequence follows from a different context). The steps compared, summed over all
    pairs, must reach ``min_steps``. Returns the steps compared per pair.
    """
    assert len(sequences) == len(references) == len(margins), "one reference and one margin list per sequence"
    compared = []
    for k, (got, want, margin) in enumerate(zip(sequences, references, margins)):
        got, want, margin = list(got), list(want), [float(m) for m in margin]
        assert len(margin) >= len(want), f"sequence {k}: {len(margin)} margins for {len(want)} reference tokens"
        n = min(len(got), len(want))
        first = next((i for i in range(n) if got[i] != want[i]), n)
        if first < n and margin[first] > tolerance:
            raise AssertionError(
                f"sequence {k} parts from the reference at step {first}: {got[first]} instead of "
                f"{want[first]}, which led by {margin[first]:.3g} (> tolerance {tolerance})"
            )
        compared.append(first)
    if sum(compared) < min_steps:
        raise AssertionError(
            f"only {sum(compared)} steps compared before the sequences parted at near ties "
            f"(per sequence: {compared}); at least {min_steps} needed"
        )
    return compared
