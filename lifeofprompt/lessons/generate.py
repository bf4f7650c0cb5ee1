"""Greedy decoding two ways: re-run everything (notebook 03) or keep a KV cache (notebook 04).

Both return the list of new token ids and ignore EOS, so the count is exact and the two can
be compared token for token. Both run the same layers of ``LlamaForCausalLM``; only the
attention metadata differs.
"""

from __future__ import annotations

import time

import torch

from ..errors import InvalidRequestError
from ..model.attention import NoCacheMetadata
from .contiguous_cache import ContiguousCacheMetadata, ContiguousKVCache


def _check(token_ids, max_new_tokens: int, vocab_size: int) -> list[int]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidRequestError(
            f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}", param="max_new_tokens"
        )
    ids = [int(t) for t in (token_ids.tolist() if torch.is_tensor(token_ids) else token_ids)]
    if not ids:
        raise InvalidRequestError(
            "token_ids is empty: give at least one token id (tokenize a non-empty prompt)", param="token_ids"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="token_ids"
        )
    return ids


@torch.no_grad()
def generate_naive(model, token_ids, max_new_tokens: int, step_times: list | None = None) -> list[int]:
    """Greedy decoding with no cache: every step runs the whole sequence and keeps only the last row.

    ``step_times``, when given, receives the seconds each forward took (notebooks 03 and 04).
    """
    ids = _check(token_ids, max_new_tokens, model.config.vocab_size)
    new: list[int] = []
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        seq = torch.tensor(ids + new, device=model.device)
        meta = NoCacheMetadata.for_lengths([len(seq)], device=model.device, last_rows_only=True)
        logits = model(seq, torch.arange(len(seq), device=model.device), meta)
        new.append(int(logits[-1].argmax()))  # int() waits for the device, so the time is complete
        if step_times is not None:
            step_times.append(time.perf_counter() - start)
    return new


@torch.no_grad()
def generate_cached(model, token_ids, max_new_tokens: int, step_times: list | None = None) -> list[int]:
    """Greedy decoding with a contiguous KV cache: prefill once, then one new row per step."""
    return generate_cached_batch(model, [token_ids], max_new_tokens, step_times)[0]


@torch.no_grad()
def generate_cached_batch(model, prompts: list, max_new_tokens: int, step_times: list | None = None) -> list[list[int]]:
    """Several prompts of different lengths at once: one flat prefill, then one row per sequence per step.

    ``step_times``, when given, receives the seconds of each forward (the first is the prefill).
    """
    if not prompts:
        raise InvalidRequestError("prompts is empty: give at least one list of token ids", param="prompts")
    prompts = [_check(p, max_new_tokens, model.config.vocab_size) for p in prompts]
    device = model.device
    lengths = [len(p) for p in prompts]
    cache = ContiguousKVCache.for_model(
        model.config, len(prompts), max(lengths) + max_new_tokens, dtype=model.dtype, device=device
    )
    rows = torch.arange(len(prompts), device=device)
    outputs: list[list[int]] = [[] for _ in prompts]
    step_ids = [t for p in prompts for t in p]
    positions = [i for n in lengths for i in range(n)]
    query_lens = lengths
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        seq_lens = [n + len(out) for n, out in zip(lengths, outputs)]
        pos = torch.tensor(positions, device=device)
        meta = ContiguousCacheMetadata(
            **ContiguousCacheMetadata.describe_batch(query_lens, seq_lens, device),
            cache=cache,
            cache_rows=rows,
            positions=pos,
        )
        logits = model(torch.tensor(step_ids, device=device), pos, meta)
        next_ids = logits.argmax(dim=-1).tolist()
        for out, t in zip(outputs, next_ids):
            out.append(t)
        if step_times is not None:
            step_times.append(time.perf_counter() - start)
        step_ids, positions, query_lens = next_ids, seq_lens, [1] * len(prompts)  # new token sits at index seq_len
    return outputs


# ----------------------------------------------------------------------------- looking inside a step (notebook 03)


class RecordingMetadata(NoCacheMetadata):
    """No-cache attention that keeps a copy of every layer's queries, keys, values and context rows.

    The same layers run unchanged; the metadata is the only thing a layer talks to, so it is
    the natural place to watch what a forward computes. ``records[layer]`` holds ``q``, ``k``,
    ``v`` (after the rotary embedding, as a cache would store them) and ``context``, one row per token.
    """

    def attend(self, layer_idx, q, k, v):
        context = super().attend(layer_idx, q, k, v)
        if not hasattr(self, "records"):
            self.records = {}
        self.records[layer_idx] = {
            "q": q.detach().clone(),
            "k": k.detach().clone(),
            "v": v.detach().clone(),
            "context": context.detach().clone(),
        }
        return context


@torch.no_grad()
def record_forward(model, token_ids) -> dict[int, dict[str, torch.Tensor]]:
    """One no-cache forward over ``token_ids`` (as a step of ``generate_naive`` runs it); its per-layer records."""
    ids = _check(token_ids, 0, model.config.vocab_size)
    device = model.device
    meta = RecordingMetadata(**RecordingMetadata.describe_batch([len(ids)], [len(ids)], device, last_rows_only=True))
    model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), meta)
    return meta.records


def compare_old_rows(earlier: dict, later: dict, name: str) -> dict:
    """How the first rows of ``later`` (a longer forward) compare with all rows of ``earlier``, over every layer.

    Returns ``rows`` compared, ``bit_equal`` (every bit the same in every layer), ``max_abs_diff``
    and ``max_rel_diff`` (largest difference over the largest magnitude).
    """
    diffs, scale, equal = [], [], True
    for layer, record in earlier.items():
        old = record[name]
        new = later[layer][name][: old.shape[0]]
        equal &= torch.equal(old, new)
        diffs.append((old.float() - new.float()).abs().max().item())
        scale.append(old.float().abs().max().item())
    rows = next(iter(earlier.values()))[name].shape[0]
    return {
        "rows": rows,
        "bit_equal": bool(equal),
        "max_abs_diff": max(diffs),
        "max_rel_diff": max(diffs) / max(max(scale), 1e-30),
    }
