"""Greedy decoding two ways: re-run everything (notebook 03) or keep a KV cache (notebook 04).

Both return the list of new token ids and ignore EOS, so the count is exact and the two can
be compared token for token. Both run the same layers of ``LlamaForCausalLM``; only the
attention metadata differs.
"""

from __future__ import annotations

import torch

from .attention import ContiguousCacheMetadata, ContiguousKVCache, NoCacheMetadata
from .errors import InvalidRequestError


def _check(token_ids, max_new_tokens: int, vocab_size: int) -> list[int]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}", param="max_new_tokens")
    ids = [int(t) for t in (token_ids.tolist() if torch.is_tensor(token_ids) else token_ids)]
    if not ids:
        raise InvalidRequestError("token_ids is empty: give at least one token id (tokenize a non-empty prompt)", param="token_ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="token_ids")
    return ids


@torch.no_grad()
def generate_naive(model, token_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding with no cache: every step runs the whole sequence and keeps only the last row."""
    ids = _check(token_ids, max_new_tokens, model.config.vocab_size)
    new: list[int] = []
    for _ in range(max_new_tokens):
        seq = torch.tensor(ids + new, device=model.device)
        meta = NoCacheMetadata.for_lengths([len(seq)], device=model.device, last_rows_only=True)
        logits = model(seq, torch.arange(len(seq), device=model.device), meta)
        new.append(int(logits[-1].argmax()))
    return new


@torch.no_grad()
def generate_cached(model, token_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding with a contiguous KV cache: prefill once, then one new row per step."""
    return generate_cached_batch(model, [token_ids], max_new_tokens)[0]


@torch.no_grad()
def generate_cached_batch(model, prompts: list, max_new_tokens: int) -> list[list[int]]:
    """Several prompts of different lengths at once: one flat prefill, then one row per sequence per step."""
    if not prompts:
        raise InvalidRequestError("prompts is empty: give at least one list of token ids", param="prompts")
    prompts = [_check(p, max_new_tokens, model.config.vocab_size) for p in prompts]
    device = model.device
    lengths = [len(p) for p in prompts]
    cache = ContiguousKVCache.for_model(model.config, len(prompts), max(lengths) + max_new_tokens,
                                        dtype=model.dtype, device=device)
    rows = torch.arange(len(prompts), device=device)
    outputs: list[list[int]] = [[] for _ in prompts]
    step_ids = [t for p in prompts for t in p]
    positions = [i for n in lengths for i in range(n)]
    query_lens = lengths
    for _ in range(max_new_tokens):
        seq_lens = [n + len(out) for n, out in zip(lengths, outputs)]
        pos = torch.tensor(positions, device=device)
        meta = ContiguousCacheMetadata(**ContiguousCacheMetadata.describe_batch(query_lens, seq_lens, device),
                                       cache=cache, cache_rows=rows, positions=pos)
        logits = model(torch.tensor(step_ids, device=device), pos, meta)
        next_ids = logits.argmax(dim=-1).tolist()
        for out, t in zip(outputs, next_ids):
            out.append(t)
        step_ids, positions, query_lens = next_ids, seq_lens, [1] * len(prompts)  # new token sits at index seq_len
    return outputs
