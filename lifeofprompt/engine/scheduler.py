"""``Scheduler``: decides, every step, which requests run and how many of their tokens.

The cinema queue. Requests wait in line (WAITING), take a seat when there is room (RUNNING)
and leave when done (FINISHED). Each step has one token budget, ``max_num_batched_tokens``,
and there is no separate "prefill phase" or "decode phase": a step mixes them.

1. Running requests first, in the order they were admitted. A decoding request costs one
   token; a request still in the middle of its prompt gets its next chunk (chunked prefill),
   as much as the budget allows. Each needs its next tokens' cache slots
   (``allocate_slots``). When the pool is empty, the most recently admitted running request
   is *preempted*: its blocks are freed, its computed-token count goes back to zero and it
   returns to the front of the waiting line, to be recomputed later (its prompt's prefix-
   cached blocks are found again if nobody has reused them yet).
2. Then, if nobody was preempted this step, waiting requests are admitted in arrival order
   while the budget lasts, the running set is under ``max_num_seqs`` and ``allocate_slots``
   can give the request's first chunk. Admission first claims the longest cached prefix of the
   prompt, so those tokens are not computed again.

Speculative decoding. A decoding request that carries draft tokens (``seq.spec_token_ids``)
costs 1 + k tokens of the same budget: a *verify* of its last token and its k drafts, never
chunked; when the budget is short it keeps fewer drafts, and when the pool cannot give their
slots it drops them rather than preempt anyone. After the step, ``update`` keeps only the
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
finish; ``add`` rejects it with ``RequestTooLargeError`` instead of letting it evict everyone
forever. Every step leaves a ``StepRecord`` (who ran, how many tokens, which blocks) for the
trace and the timelines.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import ConfigError, RequestTooLargeError
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    """One request's share of one step (a trace line)."""

    request_id: str
    kind: str  # "prefill", "prefill chunk", "recompute", "decode", "verify"
    start: int  # num_computed_tokens before the step: first position computed
    num_tokens: int  # tokens computed this step
    num_cached_tokens: int  # tokens claimed from the prefix cache when admitted this step (else 0)
    block_table: list[int]  # the block table after this step's allocation
    num_draft_tokens: int = 0  # a verify: the drafts checked (num_tokens = 1 + num_draft_tokens)
    num_accepted_tokens: int | None = None  # a verify, after the step: drafts kept (the rest rolled back)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepRecord:
    """What one step did; ``seqs``/``num_scheduled_tokens`` are what the model runner executes."""

    step: int
    seqs: list[Sequence] = field(default_factory=list, repr=False)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # filled in after the step ran
    num_waiting: int = 0  # after scheduling
    num_running: int = 0
    num_free_blocks: int = 0
    group: int | None = None  # its micro-batch group (pipeline overlap), else None
    overlapped: list[int] = field(default_factory=list)  # steps still in flight when this one was submitted
    start_time: float | None = None  # filled in by whoever runs the step
    end_time: float | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def format(self) -> str:
        """One line per scheduled request: kind, token positions, blocks."""
        head = (
            f"step {self.step:3d}: {self.num_batched_tokens:4d} tokens, {len(self.seqs)} running, "
            f"{self.num_waiting} waiting, {self.num_free_blocks} blocks free"
        )
        if self.group is not None:
            beside = f", beside step {', '.join(map(str, self.overlapped))}" if self.overlapped else ""
            head += f"; group {self.group}{beside}"
        lines = [head]
        for r in self.scheduled:
            cached = f", {r.num_cached_tokens} cached" if r.num_cached_tokens else ""
            cached += f", {r.num_draft_tokens} drafts" if r.num_draft_tokens else ""
            cached += f", {r.num_accepted_tokens} kept" if r.num_accepted_tokens is not None else ""
            lines.append(
                f"    {r.request_id:>10} {r.kind:13} tokens {r.start:3d}..{r.end - 1:<3d} "
                f"({r.num_tokens}{cached})  blocks {r.block_table}"
            )
        for rid in self.preempted:
            lines.append(f"    {rid:>10} PREEMPTED: blocks freed, back to the front of the queue")
        for rid in self.finished:
            lines.append(f"    {rid:>10} finished: its blocks go back to the pool after this step")
        return "\n".join(lines)


def format_steps(records, fold_quiet: bool = False) -> str:
    """The schedule as text, step by step. ``fold_quiet`` folds runs of steps in which every
    request only decoded one token into its existing blocks (nothing admitted, grown, freed)."""
    lines, folded, previous = [], [], {}

    def flush():
        if folded:
            span = f"step {folded[0]}" if len(folded) == 1 else f"steps {folded[0]}..{folded[-1]}"
            lines.append(f"{span}: one decode token per running request, no new block")
            folded.clear()

    for record in records:
        tables = {r.request_id: r.block_table for r in record.scheduled}
        quiet = (
            fold_quiet
            and not record.admitted
            and not record.finished
            and not record.preempted
            and all(r.kind == "decode" and previous.get(r.request_id) == r.block_table for r in record.scheduled)
        )
        previous = tables
        if quiet:
            folded.append(record.step)
            continue
        flush()
        lines.append(record.format())
    flush()
    return "\n".join(lines)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        long_prefill_token_threshold: int | None = None,
        num_groups: int = 1,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, {max_num_batched_tokens}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # None or 0: off (see fair_chunk)
        self.num_groups = num_groups  # micro-batch groups (pipeline overlap); 1: none
        pool_tokens = block_manager.num_blocks * block_manager.block_size
        self.max_model_len = min(max_model_len or pool_tokens, pool_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_steps = 0
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests in and out
    def max_total_tokens(self, seq: Sequence) -> int:
        """Tokens the sequence may reach: prompt + max_tokens, capped by the context length."""
        max_tokens = seq.sampling_params.max_tokens
        total = seq.num_prompt_tokens + (max_tokens if max_tokens is not None else self.max_model_len)
        return min(total, self.max_model_len) if max_tokens is None else total

    def check_fits(self, seq: Sequence) -> None:
        """Raise ``RequestTooLargeError`` for a request the pool (or the context) could never hold."""
        total = self.max_total_tokens(seq)
        if total > self.max_model_len or seq.num_prompt_tokens >= self.max_model_len:
            pool = self.block_manager.num_blocks * self.block_manager.block_size
            raise RequestTooLargeError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.sampling_params.max_tokens}) = {total} "
                f"tokens exceeds the engine's limit of {self.max_model_len} tokens (context length, or the whole "
                f"KV pool: "
                f"{self.block_manager.num_blocks} blocks × {self.block_manager.block_size} = {pool} tokens)",
                param="max_tokens",
            )

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue a request (``front=True``: ahead of everyone, as for a preempted one)."""
        self.check_fits(seq)
        if self.num_groups > 1 and seq.group is None:
            seq.group = self.emptiest_group()
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a request out (finished or aborted) and give its blocks back at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def emptiest_group(self) -> int:
        """The micro-batch group with the fewest unfinished requests (the lowest on a tie), as vLLM
        gives a new request to the virtual engine with the fewest."""
        counts = [0] * self.num_groups
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
    def schedule(self, group: int | None = None) -> StepRecord:
        """One step: of every request, or (``group``) of one micro-batch group's requests only."""
        record = StepRecord(step=self.num_steps, group=group)
        self.num_steps += 1
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running requests: decodes and unfinished prompt chunks, oldest admission first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if group is not None and seq.group != group:
                i += 1
                continue
            if seq.spec_token_ids:  # a verify: 1 + k rows, k cut to what the budget leaves
                seq.set_spec(seq.spec_token_ids[: budget - 1], seq.spec_probs)
            n = (
                1 + len(seq.spec_token_ids)
                if seq.spec_token_ids
                else self.fair_chunk(min(len(seq) - seq.num_computed_tokens, budget))
            )
            while not bm.allocate_slots(seq, n):
                if seq.spec_token_ids:  # drafts never cost anyone their blocks: decode plainly
                    seq.set_spec([])
                    n = 1
                    continue
                victim = next(s for s in reversed(self.running) if group is None or s.group == group)
                self._preempt(victim)
                record.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                self._add_to_step(record, seq, n, cached=0)
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: it was the last one

        # 2. waiting requests, in order, while there is room (not in a step that had to preempt)
        admitting = self.admission_open()
        while budget > 0 and len(self.running) < self.max_num_seqs and not record.preempted and admitting:
            seq = next((s for s in self.waiting if group is None or s.group == group), None)
            if seq is None:
                break
            cached = bm.claim_cached_prefix(seq)
            seq.num_computed_tokens = cached
            n = self.fair_chunk(min(len(seq) - cached, budget))
            if not bm.allocate_slots(seq, n):
                bm.cancel_claim(seq)  # give the claimed prefix back; try again next step
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.num_preemptions == 0 and not seq.output_token_ids:
                seq.num_cached_tokens = cached
            record.admitted.append(seq.request_id)
            self._add_to_step(record, seq, n, cached=cached)
            budget -= n

        record.num_waiting = len(self.waiting)
        record.num_running = len(self.running)
        record.num_free_blocks = bm.num_free_blocks
        return record

    def fair_chunk(self, n: int) -> int:
        """Fair chunked prefill (vLLM's ``long_prefill_token_threshold``): while anyone else waits or
        runs, one prompt's chunk takes at most the threshold, so a long prompt no longer holds every
        later request's first token and every later decode behind its whole prefill; alone, it takes
        the whole budget, as before (the step count of a lone prompt, and its throughput, unchanged)."""
        limit = self.long_prefill_token_threshold
        if limit and n > limit and len(self.running) + len(self.waiting) > 1:
            return limit
        return n

    def admission_open(self) -> bool:
        """Whether this step may admit waiting requests (continuous batching: always)."""
        return True

    def _add_to_step(self, record: StepRecord, seq: Sequence, n: int, cached: int) -> None:
        start = seq.num_computed_tokens
        if seq.spec_token_ids:
            kind = "verify"
        elif start + n < len(seq):
            kind = "prefill chunk"
        elif start + n == len(seq) and n == 1 and start >= seq.num_prompt_tokens:
            kind = "decode"
        elif seq.output_token_ids:
            kind = "recompute"
        else:
            kind = "prefill"
        record.seqs.append(seq)
        record.num_scheduled_tokens.append(n)
        record.scheduled.append(
            ScheduledRequest(seq.request_id, kind, start, n, cached, list(seq.block_table), len(seq.spec_token_ids))
        )

    def _preempt(self, seq: Sequence) -> None:
        """Evict by recompute: blocks freed, computed count to zero, front of the waiting line."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
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

    def update(self, record: StepRecord, sampled: list) -> list[Sequence]:
        """Advance each scheduled sequence past this step's tokens and append what it sampled.

        ``sampled`` holds, per sequence, None (a prompt chunk), one token, or a verify's kept
        tokens (accepted drafts, then the model's own). A verify's rejected drafts are rolled back
        first: ``num_computed_tokens`` counts only the kept ones and the blocks only the rejected
        reached are freed, then full blocks are registered. Returns the sequences that got new
        tokens. Finishing (EOS, stop strings, length) is the engine's call; it then calls ``finish``.
        """
        grown = []
        for seq, n, token in zip(record.seqs, record.num_scheduled_tokens, sampled):
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = token if isinstance(token, list) else ([] if token is None else [token])
            num_drafts = len(seq.spec_token_ids)
            seq.num_computed_tokens += n
            if num_drafts:
                seq.num_computed_tokens -= num_drafts - (len(tokens) - 1)  # step back past the rejected
                seq.set_spec([])
                self.block_manager.trim(seq, seq.num_computed_tokens)
            seq.output_token_ids.extend(tokens)
            self.block_manager.cache_full_blocks(seq)
            if tokens:
                grown.append(seq)
        return grown


MIN_FAIR_CHUNK = 64  # fair prefill never cuts a prompt's chunk thinner than this


def fair_prefill_threshold(requested: int | None, max_num_batched_tokens: int) -> int | None:
    """The scheduler's ``long_prefill_token_threshold``: ``requested`` if given (0 = off), else a
    quarter of the step's budget (512 of 2,048), never under ``MIN_FAIR_CHUNK`` tokens.

    A quarter leaves three quarters of every step to the others while a long prompt prefills, so a
    short request's first token comes one step after it arrives, in a step about a quarter as long;
    and since the cap holds only while others wait or run, a lone prompt keeps the whole budget. The
    floor keeps chunks thick enough for fast matrix products, and leaves tiny budgets (a lesson's 8
    tokens a step) with plain chunked prefill. vLLM's own default is off (4% of max_model_len when
    ``max_num_partial_prefills`` > 1).
    """
    if requested is not None:
        if requested < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0 (0 = off), got {requested}")
        return requested or None
    threshold = max(max_num_batched_tokens // 4, MIN_FAIR_CHUNK)
    return threshold if threshold < max_num_batched_tokens else None
