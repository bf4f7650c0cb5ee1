"""``Scheduler``: decides, every step, which requests run and how many of their tokens.

The cinema queue. Requests wait in line (WAITING), take a seat when there is room (RUNNING)
and leave when done (FINISHED). Each step has one token budget, ``max_num_batched_tokens``,
and there is no separate "prefill phase" or "decode phase": a step mixes them.

1. Running requests first, in the order they were admitted. A decoding request costs one
   token; a request still in the middle of its prompt gets its next chunk (chunked prefill),
   as much as the budget allows. Each needs its next tokens' cache slots
   (``allocate_slots``). When the pool is empty, the running request admitted last
   is *preempted*: its blocks are freed, its computed-token count goes back to zero and it
   returns to the front of the waiting line, to be recomputed later (its prompt's prefix-
   cached blocks are found again if nobody has reused them yet).
2. Then, if nobody was preempted this step, waiting requests are admitted in arrival order
   while the budget lasts, the running set is under ``max_num_seqs`` and ``allocate_slots``
   can give the request's first chunk. Admission first claims the longest cached prefix of the
   prompt, so those tokens are not computed again (not for a request that asks for
   ``prompt_logprobs``: it needs every prompt row, as in vLLM V1; its blocks are still cached).

Speculative decoding. A decoding request that carries draft tokens (``seq.spec_token_ids``)
costs 1 + k tokens of the same budget: a *verify* of its last token and its k drafts, never
chunked; when the budget is short it keeps fewer drafts, and when the pool cannot give their
slots it drops them rather than preempt anyone. After the step, ``update_from_output`` keeps only the
accepted drafts: ``num_computed_tokens`` steps back past the rejected ones and the blocks only
they reached go back to the pool (``BlockManager.trim``), before any full block is registered in
the prefix cache, so no cached block ever holds an unverified token.

Micro-batch groups (pipeline overlap, ``pipeline_overlap.py``). With ``num_groups`` = P > 1 each
new request joins the group with the fewest requests, and ``schedule(group=g)`` builds a step of
group g's requests only: its running ones, its own place in the waiting line, and, when the pool
runs dry, its own most recent admission as the victim. A step of one group can then be in the
pipeline while another group's is scheduled, and neither touches the other's sequences. Every
group draws blocks from the one block manager. ``schedule()`` with no group is the plain step.

A request whose prompt plus ``max_tokens`` needs more blocks than the whole pool could never
finish; ``check_fits`` names it with ``RequestTooLargeError`` (the engine asks once, when the
request is added) instead of letting it evict everyone forever.

The step, as vLLM's engine core runs it: ``schedule()`` returns a ``ScheduledBatch``, the runner
executes it, and ``update_from_output(batch, sampled)`` advances every sequence past its tokens and
decides who finished on a token: ``max_tokens`` or the context, EOS (unless ``ignore_eos``), a stop
token id (all held back until ``min_tokens``), or a prompt-only request (``max_tokens=0``) whose prompt
is computed. That is the one place a sequence finishes on its own tokens; an end decided elsewhere
(an abort, a stop string found in the text after the step, a request's error) comes in through
``finish_requests``. Either way its blocks go back at once. Each batch carries its step's trace
(``ScheduledBatch.trace``, made here by ``record_step``; the classes are in ``step_trace.py``), which
the engine completes once the step ran and keeps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import RequestTooLargeError
from .block_manager import BlockManager
from .config import SchedulerConfig
from .sequence import Sequence, SequenceStatus
from .step_trace import ScheduledRequest, StepRecord


@dataclass
class SchedulerUpdate:
    """What ``update_from_output`` did: each sequence's new tokens, and who finished (why: ``seq.finish_reason``)."""

    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> tokens appended this step
    finished: list[Sequence] = field(default_factory=list)


@dataclass
class ScheduledBatch:
    """One step as the scheduler decided it: what the model runner executes (``seqs``, each with its
    ``num_scheduled_tokens``), who was admitted or preempted, and its trace (``step_trace.py``)."""

    step: int
    seqs: list[Sequence] = field(default_factory=list, repr=False)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)  # claimed from the prefix cache this step
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    group: int | None = None  # its micro-batch group (pipeline overlap), else None
    trace: StepRecord | None = None  # the step for people (``step_trace.py``), made with the batch
    samples: list[bool] = field(default_factory=list)  # per sequence: whether its last row samples a token
    expected: bool = False  # counted as computed when it started (async scheduling: ``Scheduler.expect``)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, block_manager: BlockManager, config: SchedulerConfig, eos_token_ids=()):
        """``eos_token_ids``: the tokens that end an answer unless it asks ``ignore_eos`` (the model's and
        the tokenizer's; none for the chapters' toy requests)."""
        self.block_manager, self.config = block_manager, config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_steps = 0
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests in and out
    def max_total_tokens(self, seq: Sequence) -> int:
        """Tokens the sequence may reach: prompt + max_tokens, or, without max_tokens, the context length."""
        max_tokens = seq.sampling_params.max_tokens
        total = seq.num_prompt_tokens + (max_tokens if max_tokens is not None else self.config.max_model_len)
        return min(total, self.config.max_model_len) if max_tokens is None else total

    def check_fits(self, seq: Sequence) -> None:
        """Raise ``RequestTooLargeError`` for a request the pool (or the context) could never hold."""
        total = self.max_total_tokens(seq)
        if total > self.config.max_model_len or seq.num_prompt_tokens >= self.config.max_model_len:
            bm, limit = self.block_manager, self.config.max_model_len
            raise RequestTooLargeError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.sampling_params.max_tokens}) = {total} "
                f"tokens exceeds the engine's limit of {limit} tokens (context length, or the whole KV pool: "
                f"{bm.num_blocks} blocks × {bm.block_size} = {bm.num_blocks * bm.block_size} tokens)",
                param="max_tokens",
            )

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue a request (``front=True``: ahead of everyone, as for a preempted one); ``check_fits`` first."""
        if self.config.num_groups > 1 and seq.group is None:
            seq.group = self.emptiest_group()
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def finish_requests(self, seqs: list[Sequence], reason: str) -> None:
        """End sequences from outside the step (``reason``: "abort", "stop" for a stop string, "error");
        their blocks go back at once. An already finished one is left as it is."""
        for seq in seqs:
            if seq.status != SequenceStatus.FINISHED:
                self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out and give its blocks back."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:  # an n > 1 answer not yet queued: no line
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if seq.num_placeholders:  # a token still in flight is never part of the answer
            seq.drop_placeholders()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def emptiest_group(self) -> int:
        """The micro-batch group with the fewest unfinished requests (the lowest on a tie), as vLLM's
        V0 engine gave a new request to the "virtual engine" with the fewest."""
        counts = [0] * self.config.num_groups
        for seq in self.seqs:
            if seq.group is not None:
                counts[seq.group] += 1
        return counts.index(min(counts))

    def has_work(self, group: int | None = None) -> bool:
        """Whether ``group`` (None: anyone) has a request running or waiting."""
        return any(group is None or seq.group == group for seq in self.seqs)

    def running_of(self, group: int | None) -> list[Sequence]:
        """The running sequences of ``group`` (None: all): who gets drafts after that group's step.

        With pipeline overlap another group's step may be in the pipe, its verify rows packed from
        its drafts; drafting for it now would change what its sampling and rollback read when it
        comes back. The group just collected has no other step in flight, so none of its are."""
        return self.running if group is None else [seq for seq in self.running if seq.group == group]

    @property
    def seqs(self) -> list[Sequence]:
        """Every sequence that may hold blocks (for ``check_invariants``)."""
        return list(self.running) + list(self.waiting)

    # ---------------------------------------------------------------- one step
    def schedule(self, group: int | None = None) -> ScheduledBatch:
        """One step: of every request, or (``group``) of one micro-batch group's requests only."""
        batch = ScheduledBatch(step=self.num_steps, group=group)
        self.num_steps += 1
        chunk = self.fair_chunk()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, chunk)
        if not batch.preempted and self.admission_open():  # a step that had to preempt admits nobody
            self._admit_waiting(batch, budget, chunk)
        batch.trace = record_step(batch, self)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int, chunk: int) -> int:
        """1. Running requests, oldest admission first: decodes, verifies and unfinished prompt chunks (at
        most ``chunk`` tokens), preempting the newest when the pool is dry. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if batch.group is not None and seq.group != batch.group:
                i += 1
                continue
            if seq.spec_token_ids:  # a verify: 1 + k rows, k cut to what the budget leaves
                seq.set_spec(seq.spec_token_ids[: budget - 1], seq.spec_probs)
            n = (
                1 + len(seq.spec_token_ids)
                if seq.spec_token_ids
                else min(len(seq) - seq.num_computed_tokens, budget, chunk)
            )
            n = self._make_room(batch, seq, n)
            if not n:
                break  # seq preempted itself: it was the last one
            self._add_to_step(batch, seq, n, cached=0)
            budget -= n
            i += 1
        return budget

    def _make_room(self, batch: ScheduledBatch, seq: Sequence, n: int) -> int:
        """Slots for ``seq``'s next ``n`` tokens: its drafts are dropped first (they never cost anyone
        their blocks), then the group's newest running request is preempted, until they fit. Returns
        the tokens it got slots for (1 once its drafts are dropped), 0 when ``seq`` itself had to go."""
        while not self.block_manager.allocate_slots(seq, n):
            if seq.spec_token_ids:
                seq.set_spec([])
                n = 1
                continue
            victim = next(s for s in reversed(self.running) if batch.group is None or s.group == batch.group)
            self._preempt(victim)
            batch.preempted.append(victim.request_id)
            if victim is seq:
                return 0
        return n

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, chunk: int) -> None:
        """2. Waiting requests, in order, while the budget, the seats and the pool last; each first claims
        its longest cached prefix, then gets its first chunk (at most ``chunk`` tokens)."""
        bm = self.block_manager
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = next((s for s in self.waiting if batch.group is None or s.group == batch.group), None)
            if seq is None:
                return
            cached = bm.claim_cached_prefix(seq, lookup=seq.prompt_logprobs is None)  # as vLLM V1
            seq.num_computed_tokens = cached
            n = min(seq.num_prompt_tokens + len(seq.output_token_ids) - cached, budget, chunk)
            if not bm.allocate_slots(seq, n):
                bm.cancel_claim(seq)  # give the claimed prefix back; try again next step
                seq.num_computed_tokens = 0
                return
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.num_preemptions == 0 and not seq.output_token_ids:
                seq.num_cached_tokens = cached
            batch.admitted.append(seq.request_id)
            self._add_to_step(batch, seq, n, cached=cached)
            budget -= n

    def fair_chunk(self) -> int:
        """The most tokens one prompt's chunk may take this step: fair chunked prefill (vLLM's
        ``long_prefill_token_threshold``). While anyone else waits or runs, a chunk takes at most the
        threshold, so a long prompt no longer holds every later request's first token and every later
        decode behind its whole prefill; alone, it takes the whole budget, as before (the step count of a
        lone prompt, and its throughput, unchanged). Asked once a step: admitting or preempting moves a
        request from one line to the other, never changes how many there are."""
        limit = self.config.long_prefill_token_threshold
        if limit and len(self.running) + len(self.waiting) > 1:
            return limit
        return self.config.max_num_batched_tokens

    def admission_open(self) -> bool:
        """Whether this step may admit waiting requests (continuous batching: always)."""
        return True

    def _add_to_step(self, batch: ScheduledBatch, seq: Sequence, n: int, cached: int) -> None:
        batch.seqs.append(seq)
        batch.num_scheduled_tokens.append(n)
        batch.num_cached_tokens.append(cached)
        end = seq.num_prompt_tokens + len(seq.output_token_ids) + len(seq.spec_token_ids)
        batch.samples.append(seq.num_computed_tokens + n == end)  # its last row reaches the end: it samples

    def _preempt(self, seq: Sequence) -> None:
        """Evict by recompute: blocks freed, computed count to zero, front of the waiting line."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        if seq.num_placeholders:  # the step in flight's token for it is dropped; recompute makes it again
            seq.drop_placeholders()
        seq.set_spec([])
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---------------------------------------------------------------- after the model ran
    def max_num_drafts(self, seq: Sequence) -> int:
        """Draft tokens a verify of ``seq`` may check: a verify yields up to k + 1 tokens, so at
        most one fewer than ``max_tokens`` (or the context) still allows."""
        return max(0, self.max_total_tokens(seq) - len(seq) - 1)

    def expect(self, batch: ScheduledBatch) -> None:
        """A step has started and the next is to be scheduled before it ends (async scheduling): count its
        rows as computed now, and hold a placeholder for each token it will sample, so the next step
        decodes from there. ``update_from_output`` later puts the sampled tokens in their places."""
        for seq, n, samples in zip(batch.seqs, batch.num_scheduled_tokens, batch.samples):
            if seq.status != SequenceStatus.RUNNING:
                continue  # ended after the step was planned: its row is computed and never read
            seq.num_computed_tokens += n
            if samples and seq.sampling_params.max_tokens != 0:
                seq.expect_token()
        batch.expected = True

    def update_from_output(self, batch: ScheduledBatch, sampled: list) -> SchedulerUpdate:
        """Advance each scheduled sequence past this step's tokens, append what it sampled, finish who stopped.

        ``sampled`` holds, per sequence, None (a prompt chunk, or a row the engine already ended), one
        token, or a verify's kept tokens (accepted drafts, then the model's own). A verify's rejected
        drafts are rolled back first: ``num_computed_tokens`` counts only the kept ones and the blocks
        only the rejected reached are freed. A stop among the new tokens ends the output there (the
        tokens after it are dropped); then full blocks are registered, and a finished sequence's blocks
        go back to the pool.
        """
        update = SchedulerUpdate()
        for seq, n, token in zip(batch.seqs, batch.num_scheduled_tokens, sampled):
            if seq.status != SequenceStatus.RUNNING:
                continue  # ended while the step ran
            tokens = token if isinstance(token, list) else ([] if token is None else [token])
            if batch.expected:  # counted when it started: its sampled token takes the placeholder's place
                start = seq.num_computed_tokens - n
                seq.drop_placeholders()
            else:
                start = seq.num_computed_tokens
                self._advance(seq, n, len(tokens))
            kept, reason = self._first_stop(seq, tokens)
            seq.output_token_ids.extend(kept)
            if len(kept) < len(tokens):  # the rows after the stop hold tokens the output dropped
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq) - 1)
            tokens = kept
            block_size = self.block_manager.block_size
            if seq.num_computed_tokens // block_size > start // block_size:  # this step filled a block
                self.block_manager.cache_full_blocks(seq)
            if tokens:
                update.new_tokens[seq.seq_id] = tokens
            if reason is None and self._prompt_only_done(seq):
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
                update.finished.append(seq)
        return update

    def _advance(self, seq: Sequence, num_tokens: int, num_kept: int) -> None:
        """Count the step's tokens as computed; a verify steps back past its rejected drafts and frees the
        blocks only they reached."""
        num_drafts = len(seq.spec_token_ids)
        seq.num_computed_tokens += num_tokens
        if num_drafts:
            seq.num_computed_tokens -= num_drafts - (num_kept - 1)  # step back past the rejected
            seq.set_spec([])
            self.block_manager.trim(seq, seq.num_computed_tokens)

    @staticmethod
    def _prompt_only_done(seq: Sequence) -> bool:
        """``max_tokens=0`` (its prompt's logprobs, nothing generated) and the whole prompt computed."""
        return seq.sampling_params.max_tokens == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens

    def _first_stop(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """The new tokens up to the first that ends the answer, and why ("length" or "stop", the stop
        token id in ``seq.stop_reason``); every stop but the length waits for ``min_tokens``."""
        params, limit = seq.sampling_params, self.config.max_model_len
        for j, token in enumerate(tokens):
            num_output = len(seq.output_token_ids) + j + 1
            may_stop = num_output >= params.min_tokens
            if num_output >= (params.max_tokens or limit) or seq.num_prompt_tokens + num_output >= limit:
                return tokens[: j + 1], "length"
            if may_stop and not params.ignore_eos and token in self.eos_token_ids:
                return tokens[: j + 1], "stop"
            if may_stop and token in params.stop_token_ids:
                seq.stop_reason = token
                return tokens[: j + 1], "stop"
        return tokens, None


# ----------------------------------------------------------------------------- the step's trace


def kind_of(seq, num_tokens: int) -> str:
    """What a scheduled share is, from the sequence as the step found it."""
    start = seq.num_computed_tokens
    if seq.spec_token_ids:
        return "verify"
    if start + num_tokens < seq.num_prompt_tokens + len(seq.output_token_ids):
        return "prefill chunk"
    if num_tokens == 1 and start >= seq.num_prompt_tokens:
        return "decode"
    return "recompute" if seq.output_token_ids else "prefill"


def traced_table(seq) -> list[int]:
    """The block table as the trace keeps it: a copy, shared by every step after it until the table
    changes (a decode inside its last block changes nothing), so the trace does not copy a long
    context's table every step."""
    key = (seq.block_table_version, len(seq.block_table))
    if seq.traced_block_table[0] != key:
        seq.traced_block_table = (key, list(seq.block_table))
    return seq.traced_block_table[1]


def record_step(batch: ScheduledBatch, scheduler: Scheduler) -> StepRecord:
    """The trace of a step just scheduled (before it runs: shares and block tables as the runner gets them)."""
    shares = [
        ScheduledRequest(
            seq.request_id,
            kind_of(seq, n),
            seq.num_computed_tokens,
            n,
            cached,
            traced_table(seq),
            len(seq.spec_token_ids),
        )
        for seq, n, cached in zip(batch.seqs, batch.num_scheduled_tokens, batch.num_cached_tokens)
    ]
    return StepRecord(
        batch.step,
        list(batch.num_scheduled_tokens),
        shares,
        list(batch.admitted),
        list(batch.preempted),
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        num_free_blocks=len(scheduler.block_manager.free_queue),  # BlockManager.num_free_blocks, read where it is kept
        group=batch.group,
    )
