"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): how likely the model found each prompt token.

The prefill already computes them. The hidden state of prompt row ``p`` predicts token ``p + 1``, so
a prompt of P tokens has P - 1 scores; its first token has nothing before it (vLLM and OpenAI put
None there). A step normally keeps the logits of its sampling rows only; for a request that asks,
the runner keeps the hidden states of its prompt rows too (``ModelRunner.scoring_step``) and this
file scores them: the lm_head, a log-softmax over the vocabulary, the prompt token's value and the
top k. ``SLICE_ROWS`` rows at a time: the log-softmax of 2,048 rows × 49,152 tokens in fp32 is
403 MB, of 256 rows 50 MB.

Chunked prefill: every prompt token is known from the start, so a chunk's last row scores the next
chunk's first token like any other row; each chunk scores all its rows but the prompt's last (which
predicts the first generated token: the sampler's row). Preemption: the sequence keeps what it
scored (``Sequence.prompt_logprobs``), and the recomputed rows below that are not scored again.

Each entry has the shape of a generated token's logprobs (``CompletionOutput.logprobs``):
``{token_id: logprob}``, the top k and the prompt token itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sequence import Sequence

SLICE_ROWS = 256  # rows whose whole-vocabulary log-softmax exists at once (256 × 49,152 × 4 bytes = 50 MB)


@dataclass
class PromptRows:
    """The rows of one step that score prompt tokens, in the flat batch's order."""

    rows: list[int] = field(default_factory=list)  # flat rows of the step's hidden states
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    top_k: list[int] = field(default_factory=list)  # how many of the most likely tokens each row keeps
    owners: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, rows) per sequence, in order


def plan_prompt_rows(seqs: list[Sequence], num_scheduled_tokens: list[int]) -> PromptRows | None:
    """Which rows of this step score prompt tokens not scored yet; None when no row does (the usual step)."""
    if all(seq.prompt_logprobs is None for seq in seqs):
        return None
    plan, offset = PromptRows(), 0
    for seq, n in zip(seqs, num_scheduled_tokens):
        start = seq.num_computed_tokens
        if seq.prompt_logprobs is not None:
            first = max(start, len(seq.prompt_logprobs))  # rows below were scored before a preemption
            last = min(start + n, seq.num_prompt_tokens - 1)  # row p scores token p + 1, a prompt token
            if first < last:
                plan.rows.extend(range(offset + first - start, offset + last - start))
                plan.targets.extend(seq.prompt_token_ids[first + 1 : last + 1])
                plan.top_k.extend([seq.sampling_params.prompt_logprobs] * (last - first))
                plan.owners.append((seq.seq_id, last - first))
        offset += n
    return plan if plan.rows else None


@torch.no_grad()
def score_prompt_rows(lm_head, hidden: torch.Tensor, plan: PromptRows, slice_rows: int = SLICE_ROWS) -> dict:
    """``{seq_id: [{token_id: logprob}, ...]}``: each planned row's prompt token and top k, ``slice_rows`` at a time."""
    k = max(plan.top_k)
    rows = torch.tensor(plan.rows, dtype=torch.long, device=hidden.device)
    targets = torch.tensor(plan.targets, dtype=torch.long, device=hidden.device)
    chosen, top_lp, top_ids = [], [], []
    for at in range(0, len(plan.rows), slice_rows):
        logprobs = torch.log_softmax(lm_head(hidden[rows[at : at + slice_rows]]).float(), dim=-1)
        chosen.append(logprobs.gather(-1, targets[at : at + slice_rows, None])[:, 0])
        if k > 0:
            values, ids = logprobs.topk(k, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
        del logprobs
    chosen = torch.cat(chosen).tolist()
    top_lp = torch.cat(top_lp).tolist() if k > 0 else [[]] * len(chosen)
    top_ids = torch.cat(top_ids).tolist() if k > 0 else [[]] * len(chosen)
    entries = [
        dict(zip(ids[:n], lps[:n])) | {target: value}
        for ids, lps, n, target, value in zip(top_ids, top_lp, plan.top_k, plan.targets, chosen)
    ]
    scores, at = {}, 0
    for seq_id, count in plan.owners:
        scores[seq_id] = entries[at : at + count]
        at += count
    return scores
