"""``StepOutput``: what one step of the model runner returns, and ``sample_step``, the one way to it from logits.

A step's logits hold one row per sequence that reached the end of what it knows (a decode, the
last chunk of a prompt) and k + 1 rows per speculative verify. ``sample_step`` sends the plain
rows through the batched sampler (``sampler.py``: penalties, the grammar's mask, temperature,
filters, a draw) and each verify through the rejection rule (``rejection_sampler.py``); a step
may hold both, and every step, plain, verify or mixed, takes this same path. A row that cannot be
sampled (a bad seed, a grammar that refuses the token, a failing verify) fails its request alone:
it is named in ``failures`` and the other rows keep their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidRequestError, RequestFailedError
from . import rejection_sampler
from .sampler import Sampler, SamplerOutput
from .sequence import Sequence
from .structured_output import grammar_bitmask


@dataclass(frozen=True)
class Launch:
    """How the runner ran one step (the trace and chapter 10's figures print it)."""

    mode: str  # "eager", "CUDA graph replay", "padded eager decode", "pipelined eager", ...
    rows: int  # the step's rows (query tokens)
    padded_to: int | None  # a replayed or padded decode: the graph's batch size
    backend: str  # the attention backend: "torch" or "triton"
    path: str = "torch"  # how the layers ran: "torch", "fused" or "c-step (packed)" / "c-step (row-major)"


@dataclass
class StepOutput:
    """One entry per scheduled sequence, in the step's order.

    ``tokens``: None (a prompt chunk short of its end, or a failed row), the sampled token, or a
    verify's kept tokens (a list). ``logprobs``: None, ``(logprob, {token_id: logprob})`` for a
    request that asked, or a verify's list of them. ``failures``: seq_id -> why its row could not
    be sampled (the engine ends that request alone). ``prompt_logprobs``: seq_id -> the scores of the
    prompt tokens this step's rows predicted, for requests that asked (``prompt_logprobs.py``).
    """

    tokens: list
    logprobs: list
    failures: dict[int, BaseException] = field(default_factory=dict)
    launch: Launch | None = None
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # seq_id -> this step's prompt tokens' scores


def sample_step(
    sampler: Sampler, seqs: list[Sequence], num_tokens: list[int], logits, eos_token_ids, samples=None
) -> StepOutput:
    """A step's tokens from its logits: plain rows through the sampler, each verify through the rejection rule.

    ``samples``: which sequences' last rows sample, as the scheduler saw them (``ScheduledBatch.samples``);
    None reads it off the sequences, which is right until the scheduler counts the step as computed
    (async scheduling counts it when the step starts)."""
    if samples is None:
        samples = [
            s.num_computed_tokens + n == s.num_prompt_tokens + len(s.output_token_ids) + len(s.spec_token_ids)
            for s, n in zip(seqs, num_tokens)
        ]
    plain, plain_rows, verifies, row = [], [], [], 0
    for seq, samples_here in zip(seqs, samples):
        if not samples_here:
            continue  # a prompt chunk short of the prompt's end: no logits row
        if seq.sampling_params.max_tokens == 0:  # prompt only: its row is computed, nothing is sampled
            row += 1
            continue
        if seq.spec_token_ids:
            verifies.append((seq, row))
            row += 1 + len(seq.spec_token_ids)
        else:
            plain.append(seq)
            plain_rows.append(row)
            row += 1
    results, failures = {}, {}
    if plain:
        rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
        sample_plain(sampler, rows, plain, eos_token_ids, results, failures)
    if verifies:
        verify_all(logits, verifies, results, failures)
    tokens = [results.get(seq.seq_id, (None, None))[0] for seq in seqs]
    return StepOutput(tokens, [results.get(seq.seq_id, (None, None))[1] for seq in seqs], failures)


def sample_plain(sampler: Sampler, logits, seqs: list[Sequence], eos_token_ids, results: dict, failures: dict) -> None:
    """One token per row on the device; each seeded request draws from its own generator. The chosen ids
    come back to the host once (a logprob's values with them) and walk each request's grammar."""
    generators = []
    for seq in seqs:
        if seq.sampling_params.seed is None:  # the shared stream: nothing to make
            generators.append(None)
            continue
        try:
            generators.append(seq.random_stream(logits.device))
        except Exception as exc:  # this request's seed alone: the others still sample
            generators.append(None)
            failures[seq.seq_id] = InvalidRequestError(
                f"seed {seq.sampling_params.seed!r} cannot seed a generator: {exc}", param="seed"
            )
    # each row's tokens so far, by reference: the sampler reads them only for rows with penalties,
    # min_tokens or logit_bias (it asks the settings which, once); only those copy theirs past a placeholder
    outputs = [
        s.sampled_token_ids if s.num_placeholders and s.sampling_params.needs_history else s.output_token_ids
        for s in seqs
    ]
    history = ([s.prompt_token_ids for s in seqs], outputs, eos_token_ids)
    states = [s.grammar for s in seqs]
    grammar = None
    if any(state is not None for state in states):
        bitmask = grammar_bitmask(states)
        grammar = (next(g for g in states if g is not None).backend.apply, bitmask)
    out = sampler(logits, [s.sampling_params for s in seqs], generators, history, grammar)
    failures.update({seqs[row].seq_id: exc for row, exc in out.failed.items()})
    entries = read_logprobs(out, seqs) if out.logprobs is not None else [None] * len(seqs)
    for seq, token, entry in zip(seqs, out.token_ids.tolist(), entries):
        if seq.seq_id in failures:
            continue
        if seq.grammar is not None and not seq.grammar.accept(token):
            failures[seq.seq_id] = RequestFailedError(
                f"request {seq.request_id!r}: token {token} breaks its structured_outputs grammar"
            )
            continue
        results[seq.seq_id] = (token, entry)


def verify_all(logits, verifies: list[tuple[Sequence, int]], results: dict, failures: dict) -> None:
    """Each verify's kept tokens (``rejection_sampler.verify_sequence`` over its k + 1 rows)."""
    argmax = logits.argmax(dim=-1).tolist()  # greedy verifies read theirs from here: one copy
    for seq, start in verifies:
        end = start + len(seq.spec_token_ids) + 1
        try:
            results[seq.seq_id] = rejection_sampler.verify_sequence(seq, logits[start:end], argmax[start:end])
        except Exception as exc:  # this request alone fails (the engine ends it); the others go on
            failures[seq.seq_id] = exc


def read_logprobs(out: SamplerOutput, seqs: list[Sequence]) -> list:
    """Per row: None, or ``(logprob of the sampled token, {token_id: logprob} of the top N)`` if it asked."""
    if out.logprobs is None:
        return [None] * len(seqs)
    chosen = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in seqs]
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in seqs]
    rows = []
    for i, seq in enumerate(seqs):
        n = seq.sampling_params.logprobs
        rows.append(None if n is None else (chosen[i], dict(zip(top_ids[i][:n], top_lp[i][:n]))))
    return rows
