"""The step trace: what each step did, kept for people (the notebooks, the demo, the figures), not for the step.

The scheduler hands the runner a ``ScheduledBatch`` (who runs, how many tokens); the engine then
notes a ``StepRecord`` of it here: each request's share with its kind and block table, who was
admitted and preempted, and, once the step ran, who finished, how long it took and how it ran.
``lifeofprompt.figures.schedule.format_steps`` prints them, one line per request, as the demo and
chapter 08 show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """What one step did: its requests' shares, who came and went, when it ran and how."""

    step: int
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
    start_time: float | None = None
    end_time: float | None = None
    launch: object = None  # how the runner ran it (step_output.Launch), once it ran

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)


def kind_of(seq, num_tokens: int) -> str:
    """What a scheduled share is, from the sequence as the step found it."""
    start = seq.num_computed_tokens
    if seq.spec_token_ids:
        return "verify"
    if start + num_tokens < len(seq):
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


def record_step(batch, scheduler) -> StepRecord:
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
        num_free_blocks=scheduler.block_manager.num_free_blocks,
        group=batch.group,
    )
