"""What a request may ask to change in its logits before a token is chosen: bias, penalties, a minimum length.

vLLM's semantics and order, applied to the raw logits of each row, before temperature and the
top-k / top-p / min-p filters (and before the argmax of a greedy row):

1. ``min_tokens``: until the output has that many tokens, EOS and the request's stop token ids
   get ``-inf`` (the engine also holds its stop strings back until then);
2. ``logit_bias``: a number added to the logit of each listed token id;
3. ``repetition_penalty`` r (1 = off): every token present in the prompt *or* the output has a
   positive logit divided by r and a negative one multiplied by r, so r > 1 always lowers it;
4. ``frequency_penalty`` f and ``presence_penalty`` p, over the *output* tokens only:
   ``logit -= f × count + p × (count > 0)``.

Only the rows whose request asks for one of these are touched; the others keep their logits.
"""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None,
    outputs: list[list[int]] | None,
    eos_token_ids=(),
) -> torch.Tensor:
    """Logits ``[B, V]`` (fp32) after each row's min_tokens, logit_bias and penalties; a new tensor if any applied."""
    rows = [b for b, p in enumerate(params) if p.needs_history]
    if not rows:
        return logits
    if prompts is None or outputs is None:
        raise ValueError("penalties, min_tokens and logit_bias need each row's prompt and output token ids")
    logits = logits.clone()
    vocab = logits.shape[-1]
    for b in rows:
        p, row = params[b], logits[b]
        if p.min_tokens and len(outputs[b]) < p.min_tokens:
            banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
            if banned and not p.ignore_eos:
                row[banned] = float("-inf")
            elif p.stop_token_ids:
                row[[t for t in p.stop_token_ids if 0 <= t < vocab]] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long, device=row.device)
            bias = torch.tensor([v for t, v in p.logit_bias.items() if t < vocab], dtype=row.dtype, device=row.device)
            row.index_add_(0, ids, bias)
        if p.repetition_penalty != 1:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(list(prompts[b]) + list(outputs[b]), dtype=torch.long, device=row.device)] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if (p.frequency_penalty or p.presence_penalty) and outputs[b]:
            counts = torch.bincount(torch.tensor(outputs[b], dtype=torch.long, device=row.device), minlength=vocab)[
                :vocab
            ]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits
