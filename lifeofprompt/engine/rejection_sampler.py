"""Which drafted tokens a verify step keeps: greedy agreement, or the rejection rule of speculative sampling.

A verify step gives logits for k + 1 rows: row ``i`` is the model's prediction after the request's
tokens and the drafts ``d1 .. di``. From them:

* **Greedy** (temperature 0): keep drafts while the model's argmax agrees, then add the argmax of
  the first row that disagrees (or of the last row when all agree). The output is exactly what
  k + 1 plain greedy decodes would give, up to rounding of a wider matrix product.
* **Sampling** (Leviathan et al. 2023, Chen et al. 2023): let ``p`` be the model's distribution at
  a row (after temperature, top-k, top-p and min-p, as the sampler applies them) and ``q`` the
  drafter's. Accept draft ``x`` with probability ``min(1, p(x) / q(x))``; at the first rejection
  draw from ``norm(max(0, p - q))`` and stop; when all k are accepted draw the extra token from
  the last row's ``p``. Each kept token is then distributed exactly as ``p``: the drafter changes
  how many tokens a step yields, never which distribution they come from. The n-gram drafter
  proposes one token with certainty, so its ``q`` is one-hot: accept with probability ``p(x)``,
  and on a rejection draw from ``p`` with ``x`` removed.

A request with a grammar verifies masked rows (``verify_with_grammar``): row ``i`` allows only what the
grammar allows after the drafts before it, so ``p`` above is the masked distribution a plain decode
would sample from.

Draws come from the request's own ``torch.Generator`` when it has a seed, so a seeded run with
speculation repeats itself. It does not repeat a seeded run *without* speculation: the same
distribution, reached through other random numbers.
"""

from __future__ import annotations

import torch

from ..errors import RequestFailedError
from .sampler import apply_filters
from .sampling_params import SamplingParams


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """The rule's heart, ``min(1, p(x) / q(x))`` per draft token (a test breaks it on purpose to see a test fail)."""
    return torch.clamp(p_x / q_x, max=1.0)


def greedy_verify(target_ids: list[int], draft: list[int]) -> list[int]:
    """``target_ids``: the argmax of each of the k + 1 rows. The kept drafts, then the model's own token."""
    kept = []
    for i, d in enumerate(draft):
        kept.append(target_ids[i])
        if target_ids[i] != d:
            return kept
    kept.append(target_ids[len(draft)])
    return kept


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of probabilities ``[rows, V]`` after temperature, top-k, top-p and min-p (the sampler's order)."""
    rows, vocab = logits.shape

    def column(value, dtype):
        return torch.full((rows,), value, dtype=dtype, device=logits.device)

    top_k = column(params.top_k, torch.long) if 0 < params.top_k < vocab else None
    top_p = column(params.top_p, torch.float32) if params.top_p < 1.0 else None
    min_p = column(params.min_p, torch.float32) if params.min_p > 0.0 else None
    return torch.softmax(apply_filters(logits.float() / params.temperature, top_k, top_p, min_p), dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability row."""
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_verify(
    probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, generator: torch.Generator | None
) -> list[int]:
    """Speculative sampling for one request. ``probs``: the model's ``[k + 1, V]``; ``draft_probs``:
    the drafter's ``[k, V]``, or None for a one-hot drafter (n-gram). The kept drafts, then one drawn token."""
    k = len(draft)
    ids = torch.tensor(draft, dtype=torch.long, device=probs.device)
    rows = torch.arange(k, device=probs.device)
    p_x = probs[rows, ids]
    q_x = draft_probs[rows, ids] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=probs.device)
    accepted = (u < accept_probability(p_x, q_x)).tolist()
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return list(draft) + [draw(probs[k], generator)]
    residual = residual_distribution(probs[n], None if draft_probs is None else draft_probs[n], draft[n])
    return list(draft[:n]) + [draw(residual, generator)]


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, rejected: int) -> torch.Tensor:
    """``norm(max(0, p - q))``: what a rejection draws from (``q`` None: one-hot at the rejected token)."""
    if q is not None:
        residual = (p - q).clamp(min=0)
    else:
        residual = p.clone()
        residual[rejected] = 0.0
    if float(residual.sum()) <= 0:  # p == q up to rounding: nothing is left to correct; draw from p
        residual = p
    return residual / residual.sum()


def verify(
    logits: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    generator: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
    target_ids: list[int] | None = None,
) -> list[int]:
    """One request's verify rows ``[k + 1, V]`` → the tokens it keeps (1 to k + 1 of them).

    ``target_ids``: the rows' argmax when the caller computed them for the whole batch at once.
    """
    if params.temperature == 0:
        if target_ids is None:
            target_ids = logits.argmax(dim=-1).tolist()
        return greedy_verify(target_ids, draft)
    return rejection_verify(filtered_probs(logits, params), draft, draft_probs, generator)


def verify_sequence(seq, logits: torch.Tensor, target_ids: list[int]) -> tuple[list[int], list | None]:
    """One scheduled verify: the tokens ``seq`` keeps, and their logprobs if it asked for them.

    ``logits``: its k + 1 rows; ``target_ids``: their argmax. A seeded request draws from its own
    generator (``Sequence.random_stream``), as the sampler does.
    """
    params = seq.sampling_params
    generator = seq.random_stream(logits.device)
    if seq.grammar is not None:
        return verify_with_grammar(seq, seq.grammar, logits)
    kept = verify(logits, seq.spec_token_ids, params, generator, seq.spec_probs, target_ids)
    return kept, kept_logprobs(logits[: len(kept)], kept, params.logprobs)


def verify_with_grammar(seq, grammar, logits: torch.Tensor) -> tuple[list[int], list | None]:
    """A verify under a grammar: the drafts cut to what it allows, every row masked with the state after
    the drafts before it (``GrammarState.verify_bitmask``), the usual rule on the masked rows, and the
    kept tokens accepted by the matcher for real. The target's distribution at each row is then the
    masked one a plain decode would sample from, so greedy keeps exactly the plain tokens and sampling
    keeps their distribution. Logprobs stay the raw model's, as without speculation."""
    params = seq.sampling_params
    draft = seq.spec_token_ids[: grammar.valid_prefix(seq.spec_token_ids)]
    rows = logits[: len(draft) + 1].float().clone()
    grammar.backend.apply(rows, grammar.verify_bitmask(draft))
    draft_probs = None if seq.spec_probs is None else seq.spec_probs[: len(draft)]
    kept = verify(rows, draft, params, seq.generator, draft_probs)
    for token in kept:
        if not grammar.accept(token):
            raise RequestFailedError(f"request {seq.request_id!r}: token {token} breaks its structured_outputs grammar")
    return kept, kept_logprobs(logits[: len(kept)], kept, params.logprobs)


def kept_logprobs(rows: torch.Tensor, kept: list[int], num: int | None) -> list | None:
    """Per kept token: ``(logprob, {token_id: logprob} of the top num)`` from the raw logits of its row."""
    if num is None:
        return None
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    chosen = logprobs[torch.arange(len(kept)), torch.tensor(kept, device=rows.device)].tolist()
    if num == 0:
        return [(c, {}) for c in chosen]
    top_lp, top_ids = logprobs.topk(num, dim=-1)
    return [(c, dict(zip(i, v))) for c, i, v in zip(chosen, top_ids.tolist(), top_lp.tolist())]
