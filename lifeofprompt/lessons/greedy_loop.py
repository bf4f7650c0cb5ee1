"""A model runner driven without a scheduler: blocks handed out up front, one prefill, then decodes.

Chapter 11 compares a runner's eager and graph-replayed decodes with it, and the runner's tests
pin tokens through it; the engine never uses it (its scheduler admits, chunks and preempts).
"""

from __future__ import annotations

import math

from ..engine.model_runner import ModelRunner
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import OutOfMemoryError


def run_greedy_loop(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int | list[int], params=None, chunk: int | None = None
) -> list[list[int]]:
    """Drive a runner without a scheduler: each prompt gets its blocks up front, one prefill step, then
    every sequence decodes together until its ``max_tokens`` (EOS ignored).

    The engine's scheduler does this properly (admission, chunking, preemption); this loop lets
    chapter 11 and the runner's tests run the runner on its own.
    """
    params = params or SamplingParams(temperature=0, ignore_eos=True)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    r, seqs, next_block = runner.resolved, [], 0
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        seq = Sequence(f"r{i}", prompt, params)
        blocks = math.ceil((len(prompt) + limit) / r.block_size)
        if next_block + blocks > r.num_kv_blocks:
            raise OutOfMemoryError(f"run_greedy_loop: {len(prompts)} requests need more than {r.num_kv_blocks} blocks")
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    budget = chunk or r.max_num_batched_tokens
    pending = list(seqs)
    while pending:  # prefill, as many whole prompts per step as fit the budget
        batch, used = [], 0
        while pending and (not batch or used + len(pending[0]) <= budget):
            used += len(pending[0])
            batch.append(pending.pop(0))
        step(runner, batch, [len(s) for s in batch])
    running = [s for s, limit in zip(seqs, limits) if len(s.output_token_ids) < limit]
    while running:
        for start in range(0, len(running), r.max_num_seqs):
            group = running[start : start + r.max_num_seqs]
            step(runner, group, [1] * len(group))
        running = [s for s, limit in zip(seqs, limits) if len(s.output_token_ids) < limit]
    return [s.output_token_ids for s in seqs]


def step(runner: ModelRunner, seqs: list[Sequence], num_tokens: list[int]) -> None:
    """One runner step, then the bookkeeping a scheduler would do: advance counters, append samples."""
    sampled = runner.execute(seqs, num_tokens).tokens
    for seq, n, token in zip(seqs, num_tokens, sampled):
        seq.num_computed_tokens += n
        if token is not None:
            seq.output_token_ids.append(token)
